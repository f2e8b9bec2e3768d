"""FuseSDPA on hand-built graphs: each decomposition of scaled dot-product attention becomes
ONNX's Attention with the numbers of the graph it replaces (ONNX Runtime and numpy), rows masked
everywhere included; the look-alikes are refused with their code, or, not being attention, left
alone with nothing said."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from onnx import TensorProto

import fusion
from fusion import Code
from fusion.fuse_gqa.standard import ABOVE_LOWEST, LOWEST
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_sdpa import FuseSDPA
from fusion.registry import PASSES
from tests.support.attention_graphs import YOLO, YOLO_SCALE, random_feeds, yolo_attention
from tests.support.graphs import assert_close, make_model, ops, run

F, BOOL = TensorProto.FLOAT, TensorProto.BOOL
B, N, S, L, H, HV = 2, 3, 5, 7, 8, 6
Q, K, V = (B, N, S, H), (B, N, L, H), (B, N, L, HV)
SCALE = 1 / math.sqrt(H)
SQRT = math.sqrt(SCALE)


def _inputs(**more) -> dict:
    return {"q": (F, Q), "k": (F, K), "v": (F, V), **more}


def _attention(scores: list, inputs: dict, inits: dict, *, guard=False, opset=20, axis=-1):
    """``nodes`` computing ``scores`` from q, k, then Softmax (behind the NaN guard) @ v."""
    nodes = [*scores, ("Softmax", ["scores"], ["p"], {"axis": axis})]
    weights = "p"
    if guard:
        nodes += [("IsNaN", ["p"], ["nan"], {}), ("Where", ["nan", "zero", "p"], ["pg"], {})]
        inits = {**inits, "zero": np.array(0.0, np.float32)}
        weights = "pg"
    nodes.append(("MatMul", [weights, "v"], ["y"], {}))
    return make_model(nodes, inputs, {"y": (F, None)}, inits, opset=opset)


def _scaled(qk: str = "qk") -> list:
    """``Transpose(k) -> q @ k^T -> * SCALE`` into ``qk``."""
    return [
        ("Transpose", ["k"], ["kt"], {"perm": [0, 1, 3, 2]}),
        ("MatMul", ["q", "kt"], ["raw"], {}),
        ("Mul", ["raw", "scale"], [qk], {}),
    ]


def _reference(q, k, v, scale, add=None, keep=None, fill=None, guard=False):
    """Softmax attention in float32, as the unfused graph computes it."""
    scores = (q @ np.swapaxes(k, -1, -2)).astype(np.float32) * np.float32(scale)
    if add is not None:
        scores = scores + add
    if keep is not None:
        scores = np.where(keep, scores, np.float32(fill))
    with np.errstate(invalid="ignore"):
        e = np.exp(scores - scores.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
    return (np.where(np.isnan(p), 0, p) if guard else p) @ v


def _fused(model, feeds, target="onnx", **kwargs):
    """Optimize ``model``; assert one Attention and no Softmax, the same outputs as before."""
    (before,) = run(model, feeds)
    report = fusion.optimize(model, target=target, **kwargs)
    assert report.counts["sdpa_fused"] == 1, report.refused
    assert "Attention" in ops(model) and "Softmax" not in ops(model), ops(model)
    assert model.opset_imports[""] == 23
    fusion.check(model)
    (after,) = run(model, feeds)
    assert_close([after], [before])
    return report, after


def _assert_refused(model, code: Code, target="onnx") -> None:
    report = fusion.optimize(model, target=target)
    assert report.counts["sdpa_fused"] == 0 and "Softmax" in ops(model)
    assert report.codes("attention") == [code], report.refused


SCALES = {  # the scale on the scores, on q and k each (torch's decomposition), through CastLike
    "mul": ([("Mul", ["raw", "c"], ["scores"], {})], {"c": SCALE}),
    "div": ([("Div", ["raw", "c"], ["scores"], {})], {"c": 1 / SCALE}),
    "none": ([("Identity", ["raw"], ["scores"], {})], {}),
    "sqrt_q_and_k": (
        [("Mul", ["q", "r"], ["qs"], {}), ("Mul", ["kt", "r"], ["kts"], {})],
        {"r": SQRT},
    ),
    "castlike": (
        [
            ("Mul", ["q", "r"], ["qs"], {}),
            ("CastLike", ["r2", "kt"], ["rc"], {}),
            ("Mul", ["kt", "rc"], ["kts"], {}),
        ],
        {"r": SQRT, "r2": SQRT},
    ),
}


@pytest.mark.parametrize("form", SCALES)
def test_every_scale_is_the_ops_scale(rng, form):
    nodes, consts = SCALES[form]
    on_qk = form in ("sqrt_q_and_k", "castlike")
    matmul = ("MatMul", ["qs", "kts"] if on_qk else ["q", "kt"], ["scores" if on_qk else "raw"], {})
    transpose = ("Transpose", ["k"], ["kt"], {"perm": [0, 1, 3, 2]})
    scores = [transpose, *nodes, matmul] if on_qk else [transpose, matmul, *nodes]
    inits = {n: np.array(c, np.float32) for n, c in consts.items()}
    model = _attention(scores, _inputs(), inits)
    feeds = random_feeds(rng, _inputs())
    _, got = _fused(model, feeds)
    attention = next(n for n in model.graph if n.op_type == "Attention")
    expected = 1.0 if form == "none" else SCALE
    assert attention.attributes.get_float("scale") == pytest.approx(expected, rel=1e-6)
    assert_close([got], [_reference(feeds["q"], feeds["k"], feeds["v"], expected)], atol=1e-5)


def _key_form(form: str):
    """``(nodes making kt, key input shape, K for numpy from the key feed)``."""
    if form == "perm_0132":
        return [("Transpose", ["k"], ["kt"], {"perm": [0, 1, 3, 2]})], K, lambda k: k
    if form == "perm_0231":  # k as (B, L, N, H)
        nodes = [("Transpose", ["k"], ["kt"], {"perm": [0, 2, 3, 1]})]
        return nodes, (B, L, N, H), lambda k: k.transpose(0, 2, 1, 3)
    if form == "reshape_chain":  # the dynamo exporter's
        nodes = [
            ("Reshape", ["k", "merged"], ["k3"], {}),
            ("Transpose", ["k3"], ["k3t"], {"perm": [0, 2, 1]}),
            ("Reshape", ["k3t", "split"], ["kt"], {}),
        ]
        return nodes, K, lambda k: k
    if form == "transpose_reshape":  # nn.MultiheadAttention's k (B * N, L, H), swapped, viewed
        nodes = [
            ("Transpose", ["k"], ["k3t"], {"perm": [0, 2, 1]}),
            ("Reshape", ["k3t", "split"], ["kt"], {}),
        ]
        return nodes, (B * N, L, H), lambda k: k.reshape(K)
    # YOLO's k: (B, N, H, L) is K^T as it is
    return [("Identity", ["k"], ["kt"], {})], (B, N, H, L), lambda k: np.swapaxes(k, -1, -2)


@pytest.mark.parametrize(
    "form", ["perm_0132", "perm_0231", "reshape_chain", "transpose_reshape", "k_transposed"]
)
def test_every_layout_of_k_transposed(rng, form):
    """K is the source of K^T's Transposes and views (a Reshape of it where the views split the
    leading axes), a Transpose added only where no layout gives it."""
    nodes, key_shape, key_of = _key_form(form)
    inits = {
        "scale": np.array(SCALE, np.float32),
        "merged": np.array([-1, L, H], np.int64),
        "split": np.array([B, N, H, L], np.int64),
    }
    scores = [
        *nodes,
        ("MatMul", ["q", "kt"], ["raw"], {}),
        ("Mul", ["raw", "scale"], ["scores"], {}),
    ]
    inputs = _inputs(k=(F, key_shape))
    model = _attention(scores, inputs, inits)
    feeds = random_feeds(rng, inputs)
    _fused(model, feeds)
    transposes = [n for n in model.graph if n.op_type == "Transpose"]
    assert len(transposes) == (
        0 if form in ("perm_0132", "reshape_chain", "transpose_reshape") else 1
    )
    (got,) = run(model, feeds)
    expected = _reference(feeds["q"], key_of(feeds["k"]), feeds["v"], SCALE)
    assert_close([got], [expected], atol=1e-5)


def test_yolo_transposed_query_and_output(rng):
    """C2PSA's attention, on both targets."""
    feeds = random_feeds(rng, YOLO)
    swap = (0, 1, 3, 2)
    q, k, v = (feeds[n].transpose(swap) for n in "qkv")
    expected = _reference(q, k, v, YOLO_SCALE).transpose(swap)
    for target in ("ort", "onnx"):
        _, got = _fused(yolo_attention(), feeds, target=target)
        assert_close([got], [expected], atol=1e-5)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_sdpa_transposed_false_leaves_the_transposed_form(rng, target):
    """``sdpa_transposed=False`` leaves C2PSA's attention (``transposed_form``), the model as
    it was; True fuses it, exact, on 2 threads too (the per-provider choice is the caller's:
    the policy tests, test_policy.py)."""
    feeds = random_feeds(rng, YOLO)
    model = yolo_attention()
    before = ops(model)
    report = fusion.optimize(model, target=target, threads=2, sdpa_transposed=False)
    assert report.codes("attention") == [Code.TRANSPOSED_FORM], report.refused
    assert ops(model) == before and model.opset_imports[""] == 20
    report, _ = _fused(yolo_attention(), feeds, target=target, threads=2, sdpa_transposed=True)
    assert report.counts["sdpa_fused"] == 1


def _row_masked(array: np.ndarray, value) -> np.ndarray:
    """``array`` with query row 1 of the first batch set to ``value`` at every key."""
    array = array.copy()
    array[0, ..., 1, :] = value
    return array


def test_additive_masks_constant_and_broadcast(rng):
    """A constant (B, 1, S, L) mask with -inf and float32's lowest (a row of lowest: the mean of
    the values, as in the model), a padding mask (B, 1, 1, L) expanded to the rows, a causal
    (S, L) one."""
    full = np.where(rng.random((B, 1, S, L)) > 0.3, 0, -np.inf).astype(np.float32)
    full[..., 0] = 0.0
    full = _row_masked(full, LOWEST)
    padding = np.zeros((B, 1, 1, L), np.float32)
    padding[1, ..., 4:] = LOWEST
    causal = np.triu(np.full((S, L), -np.inf, np.float32), 1)
    for mask in (full, padding, causal):
        scores = [*_scaled(), ("Add", ["qk", "mask"], ["scores"], {})]
        inits = {"scale": np.float32(SCALE), "mask": mask}
        model = _attention(scores, _inputs(), inits)
        feeds = random_feeds(rng, _inputs())
        _, got = _fused(model, feeds)
        expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, add=mask)
        assert_close([got], [expected], atol=1e-5)


def test_where_mask_with_lowest_keeps_the_models_fully_masked_row(rng):
    """torch's boolean attn_mask: ``Where(m, 0, finfo.min)`` added, the NaN guard after."""
    inputs = _inputs(m=(BOOL, (B, 1, S, L)))
    scores = [
        *_scaled(),
        ("Where", ["m", "zero", "low"], ["bias"], {}),
        ("Add", ["qk", "bias"], ["scores"], {}),
    ]
    inits = {"scale": np.float32(SCALE), "low": np.float32(LOWEST)}
    model = _attention(scores, inputs, inits, guard=True)
    feeds = random_feeds(rng, inputs)
    feeds["m"] = _row_masked(feeds["m"], False)
    _, got = _fused(model, feeds)
    add = np.where(feeds["m"], 0, LOWEST).astype(np.float32)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, add=add)
    assert_close([got], [expected], atol=1e-5)
    assert np.abs(got[0, :, 1] - feeds["v"][0].mean(-2)).max() < 1e-5  # the mean of the values


def test_callers_mask_behind_the_guard(rng):
    """A float mask input: rows of -inf (NaN, then 0 by the guard) and of lowest (the mean)."""
    inputs = _inputs(m=(F, (B, 1, S, L)))
    model = _attention([*_scaled(), ("Add", ["qk", "m"], ["scores"], {})], inputs,
                       {"scale": np.float32(SCALE)}, guard=True)  # fmt: skip
    feeds = random_feeds(rng, inputs)
    feeds["m"] = _row_masked(feeds["m"], -np.inf)
    feeds["m"][1, 0, 3] = LOWEST
    _, got = _fused(model, feeds)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, add=feeds["m"], guard=True)
    assert_close([got], [expected], atol=1e-5)
    assert not got[0, :, 1].any()


@pytest.mark.parametrize("fill", [-np.inf, LOWEST])
@pytest.mark.parametrize("attend_branch", [1, 2])
def test_boolean_masks_either_way_round(rng, fill, attend_branch):
    """``Where(c, scores, fill)`` and ``Where(Not(c), fill, scores)``, a row all masked: NaN
    mapped to 0 by the guard (-inf), the mean of the values (lowest)."""
    where = ["c", "qk", "fill"] if attend_branch == 1 else ["nc", "fill", "qk"]
    scores = [*_scaled(), ("Not", ["c"], ["nc"], {}), ("Where", where, ["scores"], {})]
    inputs = _inputs(c=(BOOL, (B, 1, S, L)))
    inits = {"scale": np.float32(SCALE), "fill": np.float32(fill)}
    model = _attention(scores, inputs, inits, guard=fill == -np.inf)
    feeds = random_feeds(rng, inputs)
    feeds["c"] = _row_masked(feeds["c"], False)
    _, got = _fused(model, feeds)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, keep=feeds["c"], fill=fill,
                          guard=True)  # fmt: skip
    assert_close([got], [expected], atol=1e-5)


def test_constant_boolean_mask_with_a_large_negative_fill(rng):
    """nanoGPT's ``masked_fill(~tril, -1e9)``: no row all masked, so no guard needed."""
    keep = np.tril(np.ones((1, 1, S, L), bool))
    scores = [*_scaled(), ("Where", ["keep", "qk", "fill"], ["scores"], {})]
    inits = {"scale": np.float32(SCALE), "fill": np.float32(-1e9), "keep": keep}
    model = _attention(scores, _inputs(), inits)
    feeds = random_feeds(rng, _inputs())
    _, got = _fused(model, feeds)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, keep=keep, fill=-1e9)
    assert_close([got], [expected], atol=1e-5)


def test_sam_relative_positions_through_a_view_of_3d_scores(rng):
    """segment-anything: heads in the batch (B*N, S, H), ``(q * scale) @ k^T`` viewed as
    (B*N, h, w, h, w), plus ``rel_h[..., None]`` and ``rel_w[..., None, :]`` (products of the
    query with tables of relative positions), viewed back."""
    side, batch = 3, B * N
    seq = side * side
    inputs = {"q": (F, (batch, seq, H)), "k": (F, (batch, seq, H)), "v": (F, (batch, seq, HV))}
    scores = [
        ("Reshape", ["q", "grid"], ["qg"], {}),
        ("MatMul", ["qg", "table_h"], ["rh"], {}),
        ("Unsqueeze", ["rh", "four"], ["rel_h"], {}),
        ("MatMul", ["qg", "table_w"], ["rw"], {}),
        ("Unsqueeze", ["rw", "three_axis"], ["rel_w"], {}),
        ("Mul", ["q", "scale"], ["qs"], {}),
        ("Transpose", ["k"], ["kt"], {"perm": [0, 2, 1]}),
        ("MatMul", ["qs", "kt"], ["raw"], {}),
        ("Reshape", ["raw", "five"], ["r5"], {}),
        ("Add", ["r5", "rel_h"], ["a"], {}),
        ("Add", ["a", "rel_w"], ["b"], {}),
        ("Reshape", ["b", "three"], ["scores"], {}),
    ]
    inits = {
        "scale": np.float32(SCALE),
        "grid": np.array([batch, side, side, H], np.int64),
        "table_h": rng.standard_normal((H, side)).astype(np.float32),
        "table_w": rng.standard_normal((H, side)).astype(np.float32),
        "four": np.array([4], np.int64),
        "three_axis": np.array([3], np.int64),
        "five": np.array([batch, side, side, side, side], np.int64),
        "three": np.array([batch, seq, seq], np.int64),
    }
    model = _attention(scores, inputs, inits)
    feeds = random_feeds(rng, inputs)
    _, got = _fused(model, feeds)
    grid = feeds["q"].reshape(batch, side, side, H)
    rel_h, rel_w = (grid @ inits[t] for t in ("table_h", "table_w"))
    bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(batch, seq, seq)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, add=bias)
    assert_close([got], [expected], atol=1e-5)


def test_symbolic_lengths_and_a_padding_mask_expanded_at_run_time(rng):
    inputs = {
        "q": (F, ["batch", N, "seq", H]), "k": (F, ["batch", N, "seq", H]),
        "v": (F, ["batch", N, "seq", HV]), "pad": (F, ["batch", 1, 1, "seq"]),
    }  # fmt: skip
    scores = [*_scaled(), ("Where", ["keep", "zero", "low"], ["bias"], {}),
              ("Add", ["qk", "bias"], ["scores"], {})]  # fmt: skip
    scores.insert(0, ("Greater", ["pad", "zero"], ["keep"], {}))
    inits = {"scale": np.float32(SCALE), "zero": np.float32(0), "low": np.float32(LOWEST)}
    model = _attention(scores, inputs, inits)
    for batch, seq in ((2, 6), (1, 3)):
        feeds = {n: rng.standard_normal([batch, N, seq, H if n != "v" else HV]).astype(np.float32)
                 for n in "qkv"}  # fmt: skip
        feeds["pad"] = rng.standard_normal((batch, 1, 1, seq)).astype(np.float32)
        feeds["pad"][0, ..., 0] = 1.0
        if batch == 2:  # fused at the first sizes, run at both
            _fused(model, feeds)
        (got,) = run(model, feeds)
        add = np.where(feeds["pad"] > 0, 0, LOWEST).astype(np.float32)
        expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, add=add)
        assert_close([got], [expected], atol=1e-5)


def test_excluded_anchor_is_left_alone_and_not_refused(rng):
    model = _attention(_scaled("scores"), _inputs(), {"scale": np.float32(SCALE)})
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    left_out = fusion.Fused("sdpa_fused", softmax.name or softmax.outputs[0].name, "Attention")
    report = fusion.optimize(model, target="onnx", exclude=[left_out])
    assert report.counts["sdpa_fused"] == 0 and report.refused == []
    assert "Softmax" in ops(model) and model.opset_imports[""] == 20


def _with_scale(name: str, inputs=None, **inits):
    """``q @ k^T`` scaled by ``Mul`` with ``name`` (an input or a constant), Softmax, @ v."""
    scores = [*_scaled("raw_scaled")[:2], ("Mul", ["raw", name], ["scores"], {})]
    return _attention(scores, inputs or _inputs(), inits)


def _masked(*extra, inputs=None, guard=False, **inits):
    """``q @ k^T * scale`` then the nodes ``extra`` (making ``scores`` from ``qk``)."""
    inits = {"scale": np.float32(SCALE), **inits}
    return _attention([*_scaled(), *extra], inputs or _inputs(), inits, guard=guard)


def _where(fill, condition="c"):
    return ("Where", [condition, "qk", "fill"], ["scores"], {}), {"fill": np.float32(fill)}


LOOK_ALIKES = {
    "softmax over the queries": (
        lambda: _attention(_scaled("scores"), _inputs(), {"scale": np.float32(SCALE)}, axis=2),
        Code.SOFTMAX_AXIS,
    ),
    "scale computed at run time": (
        lambda: _with_scale("s", _inputs(s=(F, []))),
        Code.NOT_CONSTANT,
    ),
    "negative scale": (lambda: _with_scale("s", s=np.float32(-SCALE)), Code.SCALE_NOT_POSITIVE),
    "mask scaled with the scores": (
        lambda: _attention(
            [
                *_scaled("raw_scaled")[:2],
                ("Add", ["raw", "m"], ["a"], {}),
                ("Mul", ["a", "s"], ["scores"], {}),
            ],
            _inputs(m=(F, (B, 1, S, L))),
            {"s": np.float32(SCALE)},
            guard=True,
        ),  # fmt: skip
        Code.SCORES_FORM,
    ),
    "soft-capped scores": (
        lambda: _masked(("Tanh", ["qk"], ["scores"], {})),
        Code.SCORES_FORM,
    ),
    "-inf boolean mask, a row may be all masked, no guard": (
        lambda: _masked(
            _where(-np.inf)[0], inputs=_inputs(c=(BOOL, (B, 1, S, L))), **_where(-np.inf)[1]
        ),  # fmt: skip
        Code.MASK_NOT_EXACT,
    ),
    "large negative boolean mask, a row may be all masked": (
        lambda: _masked(
            _where(-1e9)[0], inputs=_inputs(c=(BOOL, (B, 1, S, L))), guard=True, **_where(-1e9)[1]
        ),  # fmt: skip
        Code.MASK_NOT_EXACT,
    ),
    "masked_fill with 0: masked keys keep a weight": (
        lambda: _masked(
            _where(0.0)[0], inputs=_inputs(c=(BOOL, (B, 1, S, L))), guard=True, **_where(0.0)[1]
        ),  # fmt: skip
        Code.MASK_NOT_EXACT,
    ),
    "caller's float mask, no guard": (
        lambda: _masked(("Add", ["qk", "m"], ["scores"], {}), inputs=_inputs(m=(F, (B, 1, S, L)))),
        Code.MASK_NOT_EXACT,
    ),
    "constant mask with a row all -inf, no guard": (
        lambda: _masked(
            ("Add", ["qk", "m"], ["scores"], {}),
            m=_row_masked(np.zeros((B, 1, S, L), np.float32), -np.inf),
        ),  # fmt: skip
        Code.MASK_NOT_EXACT,
    ),
    "mask broadcasting the scores to more batches": (
        lambda: _masked(
            ("Add", ["qk", "m"], ["scores"], {}),
            inputs=_inputs(q=(F, (1, N, S, H)), k=(F, (1, N, L, H)), v=(F, (1, N, L, HV))),
            m=np.zeros((B, 1, S, L), np.float32),
        ),  # fmt: skip
        Code.SHAPE_MISMATCH,
    ),
    "value of another length than the key": (
        lambda: _attention(
            _scaled("scores"),
            _inputs(k=(F, [B, N, "L", H]), v=(F, [B, N, "M", HV])),
            {"scale": np.float32(SCALE)},
        ),  # fmt: skip
        Code.SHAPE_MISMATCH,
    ),
    "opset 17": (
        lambda: _attention(_scaled("scores"), _inputs(), {"scale": np.float32(SCALE)}, opset=17),
        Code.OPSET_TOO_LOW,
    ),
}


@pytest.mark.parametrize("case", LOOK_ALIKES)
def test_look_alikes_are_refused_with_their_code(case):
    build, code = LOOK_ALIKES[case]
    _assert_refused(build(), code)


def test_weights_read_elsewhere_are_refused():
    nodes = [*_scaled("scores"), ("Softmax", ["scores"], ["p"], {"axis": -1}),
             ("MatMul", ["p", "v"], ["y"], {})]  # fmt: skip
    model = make_model(nodes, _inputs(), {"y": (F, None), "p": (F, None)},
                       {"scale": np.float32(SCALE)}, opset=20)  # fmt: skip
    _assert_refused(model, Code.SHARED_OUTPUT)


@pytest.mark.parametrize("where", ["no MatMul before", "no MatMul after"])
def test_a_softmax_that_is_no_attention_is_left_alone_unsaid(where):
    """A Softmax of an input read by a MatMul; a classifier's MatMul -> Softmax output."""
    if where == "no MatMul before":
        nodes = [("Softmax", ["q"], ["p"], {"axis": -1}), ("MatMul", ["p", "w"], ["y"], {})]
        inits = {"w": np.ones((H, 4), np.float32)}
    else:
        nodes = [("MatMul", ["q", "w"], ["logits"], {}), ("Softmax", ["logits"], ["y"], {})]
        inits = {"w": np.ones((H, 4), np.float32)}
    model = make_model(nodes, {"q": (F, Q)}, {"y": (F, None)}, inits, opset=20)
    report = fusion.optimize(model, target="onnx")
    assert report.refused == [] and "Softmax" in ops(model)
    assert model.opset_imports[""] == 20  # nothing to fuse: the opset is kept


def _kernel(mask: np.ndarray, rng, scale: float = SCALE) -> np.ndarray:
    """ONNX Runtime's Attention (opset 23) on random q, k, v with ``mask``."""
    dtype = BOOL if mask.dtype == bool else F
    model = make_model(
        [("Attention", ["q", "k", "v", "m"], ["y"], {"scale": scale})],
        _inputs(m=(dtype, mask.shape)), {"y": (F, None)}, opset=23,
    )  # fmt: skip
    feeds = {**random_feeds(rng, _inputs()), "m": mask}
    return run(model, feeds)[0], feeds


@pytest.mark.parametrize(
    "shape, takes",
    [((B, 1, S, L), True), ((1, N, S, L), True), ((N, S, L), True), ((S, L), True),
     ((B, 1, 1, L), False), ((B, 1, S, 1), False), ((L,), False)],
)  # fmt: skip
def test_the_kernel_takes_masks_broadcast_over_batch_and_heads_only(rng, shape, takes):
    """Why :mod:`fusion.fuse_sdpa.masks` expands a mask to the rows and the keys."""
    mask = rng.standard_normal(shape).astype(np.float32)
    if not takes:
        with pytest.raises(Exception, match="attn_mask"):
            _kernel(mask, rng)
        return
    got, feeds = _kernel(mask, rng)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], SCALE, add=mask)
    assert_close([got], [expected], atol=1e-5)


def test_the_kernel_computes_rows_masked_everywhere_as_the_masks_module_says(rng):
    """A row of float32's lowest or of -inf, or all False: zeros; one step above lowest: the
    mean of the values, as the model's Softmax gives it for a row of lowest."""
    for value, zeros in ((LOWEST, True), (-np.inf, True), (ABOVE_LOWEST, False)):
        got, feeds = _kernel(_row_masked(np.zeros((B, 1, S, L), np.float32), value), rng)
        mean = np.broadcast_to(feeds["v"][0].mean(-2), got[0, :, 1].shape)
        np.testing.assert_allclose(got[0, :, 1], 0 if zeros else mean, atol=1e-5)
    got, _ = _kernel(_row_masked(np.ones((B, 1, S, L), bool), False), rng)
    assert not got[0, :, 1].any()
    with pytest.raises(Exception, match="scale"):
        _kernel(np.zeros((S, L), np.float32), rng, scale=-SCALE)


def _heads_model(batch, heads, rank: int = 4):
    """The scaled attention of ``batch`` x ``heads`` (3-D: ``batch`` is batch times heads)."""
    lead = (batch, heads) if rank == 4 else (batch,)
    inputs = {"q": (F, (*lead, S, H)), "k": (F, (*lead, L, H)), "v": (F, (*lead, L, HV))}
    perm = [0, 1, 3, 2] if rank == 4 else [0, 2, 1]
    scores = [
        ("Transpose", ["k"], ["kt"], {"perm": perm}),
        ("MatMul", ["q", "kt"], ["raw"], {}),
        ("Mul", ["raw", "scale"], ["scores"], {}),
    ]
    return _attention(scores, inputs, {"scale": np.array(SCALE, np.float32)}), inputs


@pytest.mark.parametrize(
    ("batch", "heads", "rank", "threads", "fused"),
    [
        (1, 1, 4, 1, True),  # no thread count: every attention (the CUDA policy)
        (1, 1, 4, 2, False),  # a VAE's single head on 2 threads
        (1, 2, 4, 2, True),
        (2, 1, 4, 2, True),  # the batch counts
        ("batch", 1, 4, 2, False),  # an unknown batch counts as 1
        ("batch", 4, 4, 4, True),
        (1, None, 3, 2, False),  # 3-D: batch times heads in the first dimension
        ("bn", None, 3, 8, True),  # unknown there: no limit
    ],
)
def test_on_the_cpu_an_attention_of_fewer_heads_than_threads_is_left(
    rng, batch, heads, rank, threads, fused
):
    """The CPU policy's ``threads``: ONNX Runtime's CPU Attention runs one thread per batch and
    head, so an attention with fewer is left alone (``few_heads``); with enough, fused, exact."""
    model, inputs = _heads_model(batch, heads, rank)
    if fused:
        concrete = {
            n: (t, [3 if isinstance(d, str) else d for d in s]) for n, (t, s) in inputs.items()
        }
        _fused(model, random_feeds(rng, concrete), threads=threads)
        return
    report = fusion.optimize(model, target="onnx", threads=threads)
    assert report.codes("attention") == [Code.FEW_HEADS], report.refused
    assert "Softmax" in ops(model) and "Attention" not in ops(model)
    assert f"fewer than the {threads} intra-op threads" in report.refused[0].detail


def test_the_policy_turns_the_pass_off_and_its_threads_reach_it(rng):
    """``sdpa=False`` (the autotuner's unfused variant) leaves every attention and says
    nothing; the policy's ``threads`` is the pass's setting, which no other pass takes."""
    model, _ = _heads_model(1, 1)
    report = fusion.optimize(model, target="onnx", sdpa=False)
    assert report.counts["sdpa_fused"] == 0 and not report.refused
    assert "Softmax" in ops(model)
    assert dataclasses.asdict(fusion.Policy(threads=4).without_attention()) == {
        "target": "ort",
        "skip": False,
        "attention": False,
        "gqa": False,
        "sdpa": False,
        "threads": 4,
        "sdpa_transposed": True,
        "last_rows": (),
    }
    assert FuseSDPA("onnx", threads=3).threads == 3
    with pytest.raises(ValueError, match="no setting"):
        FuseLayerNorm("onnx", threads=3)
    with pytest.raises(ValueError, match="threads=0"):
        fusion.Policy(threads=0)
    with pytest.raises(ValueError, match="sdpa_transposed=None"):
        fusion.Policy(sdpa_transposed=None)
    with pytest.raises(ValueError, match="last_rows='logits'"):
        fusion.Policy(last_rows="logits")
    policy = fusion.Policy(threads=4)
    report = fusion.optimize(_heads_model(1, 1)[0], policy, target="onnx", sdpa=False)
    assert report.counts["sdpa_fused"] == 0  # the keywords replace the policy's fields
    with pytest.raises(TypeError, match="bar"):
        fusion.optimize(_heads_model(1, 1)[0], policy, bar=1)


def test_a_pass_takes_its_settings_from_the_policy_and_declares_no_default():
    """Each pass's settings are fields of :class:`fusion.Policy`, annotated on the pass with no
    value: made directly, a pass takes the policy's defaults and is checked as the policy is, so
    that no default is kept in step across passes."""
    fields = {f.name for f in dataclasses.fields(fusion.Policy)}
    for fusion_pass in PASSES:
        for name in fusion_pass.settings:
            assert name in fields, (fusion_pass.__name__, name)
            assert all(name not in vars(c) for c in fusion_pass.__mro__), (fusion_pass, name)
    made, policy = FuseSDPA("onnx"), fusion.Policy()
    assert (made.threads, made.sdpa_transposed) == (policy.threads, policy.sdpa_transposed)
    with pytest.raises(ValueError, match="threads=0"):
        FuseSDPA("onnx", threads=0)


E = N * H  # the width before the split into heads


def _views_model(rng, layout: str, reader: str = "merged", batch: int = B, masked=False):
    """Projections of ``x``, their split into heads by a view, the scaled attention, its heads
    merged back: ``batch_first`` (``x`` ``(batch, S, E)``: transformers, diffusers) or
    ``sequence_first`` (``x`` ``(S, batch, E)``: torch's decomposition of
    ``nn.MultiheadAttention``). ``reader``: ``merged`` (Transpose, Reshape), ``wrong_order``
    (a Transpose to ``(B, S, H, N)``), ``also_4d`` (the attention's output is an output too),
    ``copied`` (the merging Reshape copies its input's first axis by a 0);
    ``masked``: a constant additive mask ``(batch, 1, S, S)`` on the scores."""
    inits = {f"w{t}": rng.standard_normal((E, E)).astype(np.float32) / 4 for t in "qkv"}
    inits["scale"] = np.array(SCALE, np.float32)
    projections = None
    if layout.startswith("packed"):
        x, merged, back = (batch, S, E), (batch, S, E), [0, 2, 1, 3]
        projections, views = _packed(rng, inits, batch, layout.removeprefix("packed_"))
    elif layout == "batch_first":
        x, merged = (batch, S, E), (batch, S, E)
        inits["split"] = np.array([batch, S, N, H], np.int64)
        views = {t: [("Transpose", [f"s{t}"], [t], {"perm": [0, 2, 1, 3]})] for t in "qkv"}
        back = [0, 2, 1, 3] if reader != "wrong_order" else [0, 2, 3, 1]
    else:
        x, merged = (S, batch, E), (S * batch, E)
        inits["split"] = np.array([S, batch * N, H], np.int64)
        inits["heads"] = np.array([batch, N, S, H], np.int64)
        views = {
            t: [
                ("Transpose", [f"s{t}"], [f"h{t}"], {"perm": [1, 0, 2]}),
                ("Reshape", [f"h{t}", "heads"], [t], {}),
            ]
            for t in "qkv"
        }
        back = [2, 0, 1, 3]
    nodes = projections or [
        n
        for t in "qkv"
        for n in (
            ("MatMul", ["x", f"w{t}"], [f"p{t}"], {}),
            ("Reshape", [f"p{t}", "split"], [f"s{t}"], {}),
            *views[t],
        )
    ]
    inits["merged"] = np.array(merged if reader != "copied" else (0, *merged[1:]), np.int64)
    nodes += [
        *_scaled("qk"),
        ("Add" if masked else "Identity", ["qk", "m"][: 1 + masked], ["scores"], {}),
        ("Softmax", ["scores"], ["p"], {"axis": -1}),
        ("MatMul", ["p", "v"], ["y"], {}),
        ("Transpose", ["y"], ["yt"], {"perm": back}),
        ("Reshape", ["yt", "merged"], ["out"], {}),
    ]
    outputs = {"out": (F, None)} | ({"y": (F, None)} if reader == "also_4d" else {})
    if masked:
        inits["m"] = rng.standard_normal((batch, 1, S, S)).astype(np.float32)
    model = make_model(nodes, {"x": (F, x)}, outputs, inits, opset=20)
    return model, {"x": rng.standard_normal(x).astype(np.float32)}


def _packed(rng, inits: dict, batch: int, part: str) -> tuple[list, None]:
    """timm's packed projection ``qkv(x).reshape(B, S, 3, N, H).permute(2, 0, 3, 1, 4)``, its
    parts taken by ``Split`` and ``Squeeze`` (``part="split"``), ``Slice`` and ``Squeeze``
    (``"slice"``, the dynamo exporter's ``unbind``) or ``Gather`` (``"gather"``), with a random
    bias; ``inits`` filled."""
    inits["w"] = np.concatenate([inits.pop(f"w{t}") for t in "qkv"], axis=1)
    inits["b"] = rng.standard_normal(3 * E).astype(np.float32)
    inits["split"] = np.array([batch, S, 3, N, H], np.int64)
    nodes = [
        ("MatMul", ["x", "w"], ["xw"], {}),
        ("Add", ["xw", "b"], ["qkv"], {}),
        ("Reshape", ["qkv", "split"], ["s"], {}),
        ("Transpose", ["s"], ["t"], {"perm": [2, 0, 3, 1, 4]}),
    ]
    if part == "split":
        inits["ones"], inits["axis"] = np.ones(3, np.int64), np.array([0], np.int64)
        nodes.append(("Split", ["t", "ones"], ["t0", "t1", "t2"], {"axis": 0}))
        nodes += [("Squeeze", [f"t{i}", "axis"], [t], {}) for i, t in enumerate("qkv")]
    elif part == "slice":  # the dynamo exporter's unbind, the last bound past the end
        inits["axis"] = np.array([0], np.int64)
        bounds = {"q": (0, 1), "k": (1, 2), "v": (-1, 2**62)}
        for t, (start, end) in bounds.items():
            inits[f"s{t}"], inits[f"e{t}"] = np.array([start]), np.array([end])
            nodes.append(("Slice", ["t", f"s{t}", f"e{t}", "axis"], [f"p{t}"], {}))
            nodes.append(("Squeeze", [f"p{t}", "axis"], [t], {}))
    else:
        inits |= {f"i{t}": np.array(i, np.int64) for i, t in enumerate("qkv")}
        nodes += [("Gather", ["t", f"i{t}"], [t], {"axis": 0}) for t in "qkv"]
    return nodes, None


def _attention_node(model):
    (node,) = [n for n in model.graph if n.op_type == "Attention"]
    return node


@pytest.mark.parametrize(
    ("layout", "batch", "masked"),
    [("batch_first", B, False), ("batch_first", 1, False), ("sequence_first", 1, False),
     ("batch_first", B, True), ("sequence_first", 1, True)],
)  # fmt: skip
def test_heads_made_by_a_view_are_attentions_3d_form_without_transposes(rng, layout, batch, masked):
    """Where Q, K, V are views of the projections split into heads and the output's heads are
    merged back, Attention takes the projections (3-D, ``q_num_heads``) and gives the merged
    tensor: no Transpose is left, the numbers are the graph's."""
    model, feeds = _views_model(rng, layout, batch=batch, masked=masked)
    (before,) = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    assert report.counts["sdpa_fused"] == 1, report.refused
    node = _attention_node(model)
    assert [len(v.shape) for v in node.inputs[:3]] == [3, 3, 3]
    assert node.attributes["q_num_heads"].value == node.attributes["kv_num_heads"].value == N
    assert "Transpose" not in ops(model), ops(model)
    fusion.check(model)
    assert_close(run(model, feeds), [before])


@pytest.mark.parametrize(
    ("part", "batch", "target"),
    [
        ("split", B, "onnx"),
        ("slice", B, "onnx"),
        ("gather", B, "onnx"),
        ("split", 1, "onnx"),
        ("split", B, "ort"),
    ],
)
def test_parts_of_a_packed_projection_become_dense_layers_of_their_own(rng, part, batch, target):
    """timm's packed projection: the query, key and value each ``x @ W_i + b_i`` of the
    packed weight's columns, Attention 3-D on them; no Transpose or Split is left, the numbers
    are the graph's. For ONNX Runtime too: FuseAttention leaves it to FuseSDPA."""
    model, feeds = _views_model(rng, f"packed_{part}", batch=batch)
    (before,) = run(model, feeds)
    report = fusion.optimize(model, target=target)
    assert report.counts["sdpa_fused"] == 1 and report.counts["attention_fused"] == 0, report
    node = _attention_node(model)
    assert [len(v.shape) for v in node.inputs[:3]] == [3, 3, 3]
    assert [v.producer().op_type for v in node.inputs[:3]] == ["Add"] * 3
    assert ops(model).count("MatMul") == 3, ops(model)
    assert not {"Transpose", "Split", "Squeeze", "Gather"} & set(ops(model)), ops(model)
    fusion.check(model)
    assert_close(run(model, feeds), [before])


@pytest.mark.parametrize(
    ("layout", "reader", "batch"),
    [
        ("sequence_first", "merged", 2),  # the batch is no reshape away from the sequence
        ("batch_first", "wrong_order", B),  # heads merged as (B, S, H, N)
        ("batch_first", "also_4d", B),  # the 4-D output is read as it is
        ("sequence_first", "copied", 1),  # its 0 would copy the 3-D output's batch, not S
    ],
)
def test_views_that_are_not_the_3d_form_keep_the_4d_form(rng, layout, reader, batch):
    """Fused all the same, with the 4-D tensors, exact."""
    model, feeds = _views_model(rng, layout, reader, batch)
    before = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    assert report.counts["sdpa_fused"] == 1, report.refused
    assert [len(v.shape) for v in _attention_node(model).inputs[:3]] == [4, 4, 4]
    fusion.check(model)
    assert_close(run(model, feeds), before)


@pytest.mark.parametrize(
    ("q", "k", "v", "fused"),
    [
        ((1, 1, S, H), (1, 1, L, H), (1, L, HV), True),  # V's unit head axis dropped
        ((1, S, H), (1, L, H), (1, 1, L, HV), True),  # Q and K 3-D, V 4-D
        ((1, S, H), (1, 1, L, H), (1, L, HV), True),  # only K 4-D
        ((3, S, H), (1, 3, L, H), (1, 3, L, HV), True),  # 3-D Q read as (1, 3, S, H): 3 heads
        ((3, S, H), (2, 3, L, H), (2, 3, L, HV), False),  # Q broadcast over the batch
    ],
)
def test_q_k_v_of_mixed_rank_are_read_as_the_matmuls_broadcast_them(rng, q, k, v, fused):
    """A 3-D operand beside 4-D ones is the MatMul's broadcast, ``(1, X, ., .)``: Attention
    takes it unsqueezed where that gives one batch and heads alike (exact on ONNX Runtime);
    where it would broadcast the batch, ``shape_mismatch``, not ``unsupported_rank``."""
    inputs = {"q": (F, q), "k": (F, k), "v": (F, v)}
    nodes = [
        ("Transpose", ["k"], ["kt"], {"perm": [*range(len(k) - 2), len(k) - 1, len(k) - 2]}),
        ("MatMul", ["q", "kt"], ["raw"], {}),
        ("Mul", ["raw", "scale"], ["scores"], {}),
    ]
    model = _attention(nodes, inputs, {"scale": np.array(SCALE, np.float32)})
    if fused:
        _fused(model, random_feeds(rng, inputs))
        return
    report = fusion.optimize(model, target="onnx")
    assert report.codes("attention") == [Code.SHAPE_MISMATCH], report.refused
