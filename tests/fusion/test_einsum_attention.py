"""Attention as tf2onnx writes Keras' ``MultiHeadAttention`` (its Einsums decomposed into
batched MatMuls between Unsqueeze / Transpose / Reshape / Squeeze chains, the Reshapes' targets
computed from ``Shape``), on the exporter's own files (``tests/data/exporters``, static batch 1
and a symbolic batch), and the look-alikes the rewrite must leave: each run on ONNX Runtime
before and after the passes. The rewrite: :mod:`fusion.simplify.batched`."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

import fusion
from fusion import Code
from fusion.simplify.batched import bias_before_split, unmerge_batched_matmuls
from tests.support.graphs import assert_close, make_model, run

DATA = Path(__file__).resolve().parents[1] / "data" / "exporters"
F = TensorProto.FLOAT


def _feeds(model: ir.Model, batch: int, rng) -> dict[str, np.ndarray]:
    (value,) = model.graph.inputs
    dims = [d if isinstance(d, int) else batch for d in value.shape]
    return {value.name: rng.standard_normal(dims).astype(np.float32)}


@pytest.mark.parametrize(
    ("name", "batches"),
    [("keras_encoder.onnx", (1,)), ("keras_encoder_dynamic.onnx", (1, 2, 3))],
)
def test_keras_attention_is_one_op(rng, name, batches):
    """Both attentions of the Keras encoder become com.microsoft ``Attention``; no Softmax and
    none of the Einsums' shape arithmetic is left (the Dense layers' Tensordot keeps its own
    Shape reads); the outputs are the file's."""
    model = ir.load(DATA / name)
    feeds = [_feeds(model, b, rng) for b in batches]
    before = [run(model, f) for f in feeds]
    report = fusion.optimize(model, target="ort")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert report.counts["attention_fused"] == 2 and not report.refused, report.to_dict()
    assert not {"Softmax", "Squeeze", "Unsqueeze", "ReduceProd"} & set(ops), ops
    fusion.check(model)
    for f, b in zip(feeds, before, strict=True):
        assert_close(run(model, f), b, rtol=1e-5)


def test_keras_attention_for_the_portable_target_says_why_not(rng):
    """``target="onnx"`` needs ONNX's Attention (opset 23), and onnxscript's converter raises
    from 18 only: the opset-17 file's attentions are refused with the code, not missed."""
    model = ir.load(DATA / "keras_encoder_dynamic.onnx")
    report = fusion.optimize(model, target="onnx")
    codes = [r.code for r in report.refused if r.family == "attention"]
    assert codes == [Code.OPSET_TOO_LOW] * 2, report.to_dict()


def _einsum_scores(batch: int | str, keep_merged: bool = False):
    """q, k (B, 8, 2, 16) -> scores (B, 2, 8, 8) the way tf2onnx writes ``aecd,abcd->acbe``
    (the Reshape targets computed from Shape); ``keep_merged``: the scores stay (B*2, 8, 8)."""
    nodes = [
        ("Unsqueeze", ["q", "ax3"], ["qu"], {}),
        ("Transpose", ["qu"], ["qt"], {"perm": [0, 2, 1, 3, 4]}),
        ("Shape", ["qt"], ["qs"], {}),
        ("Gather", ["qs", "i01"], ["qb"], {}),
        ("ReduceProd", ["qb"], ["qbp"], {"keepdims": 1}),
        ("Gather", ["qs", "i4"], ["qh"], {}),
        ("Concat", ["qbp", "m1", "qh"], ["qshape"], {"axis": 0}),
        ("Reshape", ["qt", "qshape"], ["q3"], {}),
        ("Unsqueeze", ["k", "ax1"], ["ku"], {}),
        ("Transpose", ["ku"], ["kt"], {"perm": [0, 3, 1, 2, 4]}),
        ("Shape", ["kt"], ["ks"], {}),
        ("Gather", ["ks", "i01"], ["kb"], {}),
        ("ReduceProd", ["kb"], ["kbp"], {"keepdims": 1}),
        ("Gather", ["ks", "i4"], ["kh"], {}),
        ("Concat", ["kbp", "m1", "kh"], ["kshape"], {"axis": 0}),
        ("Reshape", ["kt", "kshape"], ["k3"], {}),
        ("Transpose", ["k3"], ["k3t"], {"perm": [0, 2, 1]}),
        ("MatMul", ["q3", "k3t"], ["s3"], {}),
    ]
    if not keep_merged:
        nodes += [
            ("Max", ["qb", "kb"], ["b2"], {}),
            ("Gather", ["qs", "i2"], ["sq"], {}),
            ("Gather", ["ks", "i3"], ["sk"], {}),
            ("Concat", ["b2", "sq", "sk", "one"], ["sshape"], {"axis": 0}),
            ("Reshape", ["s3", "sshape"], ["s5"], {}),
            ("Squeeze", ["s5", "i4"], ["y"], {}),
        ]
    else:
        nodes.append(("Identity", ["s3"], ["y"], {}))
    ints = {"ax3": [3], "ax1": [1], "i01": [0, 1], "i4": [4], "i2": [2], "i3": [3], "m1": [-1]}
    constants = {k: np.array(v, np.int64) for k, v in ints.items()} | {"one": np.array([1])}
    shape = [batch, 8, 2, 16]
    out = [batch * 2 if isinstance(batch, int) else "BN", 8, 8] if keep_merged else None
    return make_model(nodes, {"q": (F, shape), "k": (F, shape)}, {"y": (F, out)}, constants)


@pytest.mark.parametrize("batch", [1, 3, "B"])
def test_the_scores_einsum_is_the_4d_matmul(rng, batch):
    model = _einsum_scores(batch)
    feeds = {n: rng.standard_normal((2 if batch == "B" else batch, 8, 2, 16)).astype(np.float32)
             for n in ("q", "k")}  # fmt: skip
    before = run(model, feeds)
    fusion.optimize(model, target="onnx")  # the clean-up makes the rewrite; no pass applies
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops == {"Transpose": 2, "MatMul": 1}, ops
    assert_close(run(model, feeds), before, rtol=1e-6)


def test_a_batch_that_stays_merged_is_left(rng):
    """The scores kept as (B*N, S, L): no chain after the MatMul splits the batch back, and
    the MatMul of the sources would give another shape: nothing to rewrite."""
    model = _einsum_scores(2, keep_merged=True)
    from fusion.cleanup import cleanup
    from fusion.shapes import FillShapes

    cleanup(model)
    FillShapes()(model)
    assert unmerge_batched_matmuls(model.graph) == 0


def test_a_bias_after_the_split_into_heads_moves_before_it(rng):
    bias = rng.standard_normal((2, 16)).astype(np.float32)
    nodes = [("Reshape", ["x", "shape"], ["h"], {}), ("Add", ["h", "b"], ["y"], {})]
    model = make_model(
        nodes,
        {"x": (F, [3, 8, 32])},
        {"y": (F, [3, 8, 2, 16])},
        {"shape": np.array([-1, 8, 2, 16], np.int64), "b": bias},
    )
    feeds = {"x": rng.standard_normal((3, 8, 32)).astype(np.float32)}
    before = run(model, feeds)
    assert bias_before_split(model.graph) == 1
    assert [n.op_type for n in model.graph] == ["Add", "Reshape"]
    assert_close(run(model, feeds), before, rtol=0)


def test_an_einsum_the_rewrite_cannot_read_is_refused_naming_the_op(rng):
    """Batched MatMuls over 3-D inputs of the graph (no view of a 4-D source to undo) with a
    Reshape and a Squeeze between the scores' MatMul and the Softmax: the attention is a
    candidate, refused with ``scores_form`` naming an op in the way."""
    nodes = [
        ("MatMul", ["q", "kt"], ["s3"], {}),
        ("Reshape", ["s3", "split"], ["s5"], {}),
        ("Squeeze", ["s5", "last"], ["s4"], {}),
        ("Softmax", ["s4"], ["p4"], {"axis": -1}),
        ("Reshape", ["p4", "merge"], ["p3"], {}),
        ("MatMul", ["p3", "v"], ["y"], {}),
    ]
    constants = {
        "split": np.array([1, 2, 8, 8, 1], np.int64),
        "last": np.array([4], np.int64),
        "merge": np.array([2, 8, 8], np.int64),
    }
    io = {"q": (F, [2, 8, 16]), "kt": (F, [2, 16, 8]), "v": (F, [2, 8, 16])}
    model = make_model(nodes, io, {"y": (F, [2, 8, 16])}, constants, opset=23, ir_version=11)
    report = fusion.optimize(model, target="onnx")
    (refused,) = [r for r in report.refused if r.family == "attention"]
    assert refused.code == Code.SCORES_FORM, refused
    assert "Squeeze" in refused.detail or "Reshape" in refused.detail, refused


def _tf2onnx_attention(
    seq: int = 64,
    heads: int = 4,
    size: int = 32,
    batch: int | str = 1,
    memory: str | None = None,
) -> ir.Model:
    """Keras' ``MultiHeadAttention`` (input ``x`` of shape ``(batch, seq, heads * size)``,
    float32) as tf2onnx lowers its two Einsums: ``Unsqueeze -> Transpose -> Reshape`` into 3-D
    MatMuls, the weights reaching ``@ V`` through ``Unsqueeze -> Reshape -> MatMul -> Reshape ->
    Squeeze``, each Reshape's target computed by ``Shape -> Gather -> ReduceProd / Max ->
    Concat``; every intermediate value carries the ``unk__N`` dimensions tf2onnx writes where
    TensorFlow's shape functions lost the sizes (the output too where ``batch`` is a symbol).
    ``memory``: the keys and values projected from a second input ``m``, of that symbolic batch
    (a cross-attention)."""
    width = heads * size
    nodes = [
        op
        for n in "vqk"
        for op in (
            ("MatMul", ["m" if memory and n != "q" else "x", f"w{n}"], [f"{n}m"], {}),
            ("Reshape", [f"{n}m", "split"], [f"{n}r"], {}),
            ("Add", [f"{n}r", f"b{n}"], [n], {}),
        )
    ]
    for n, axis, perm in (("v", "c2", [0, 3, 2, 4, 1]), ("k", "c1", [0, 3, 1, 2, 4])):
        nodes += [
            ("Unsqueeze", [n, axis], [f"{n}u"], {}),
            ("Transpose", [f"{n}u"], [f"{n}t"], {"perm": perm}),
        ]
    nodes += [
        ("Unsqueeze", ["q", "c3"], ["qu"], {}),
        ("Transpose", ["qu"], ["qt"], {"perm": [0, 2, 1, 3, 4]}),
        *_merge_batch("vt", "v3", transpose=True),
        *_merge_batch("kt", "k3", transpose=True),
        *_merge_batch("qt", "q3"),
        ("MatMul", ["q3", "k3"], ["s3"], {}),
        *_split_batch("s3", ("qt_b", "kt_b"), "qt_s", "kt_t", "s4"),
        ("Mul", ["s4", "scale"], ["ss"], {}),
        ("Softmax", ["ss"], ["p"], {}),
        ("Unsqueeze", ["p", "c3"], ["pu"], {}),
        *_merge_batch("pu", "p3"),
        ("MatMul", ["p3", "v3"], ["o3"], {}),
        *_split_batch("o3", ("pu_b", "vt_b"), "pu_s", "vt_t", "o4"),
        ("Transpose", ["o4"], ["ot"], {"perm": [0, 2, 1, 3]}),
        ("Reshape", ["ot", "merge"], ["om"], {}),
        ("MatMul", ["om", "wo"], ["y"], {}),
    ]
    rng = np.random.default_rng(7)
    ints = {"c1": [1], "c2": [2], "c3": [3], "c4": [4], "c01": [0, 1], "m1": [-1]}
    constants = {k: np.array(v, np.int64) for k, v in ints.items()}
    constants["split"] = np.array([-1, seq, heads, size], np.int64)
    constants["merge"] = np.array([-1, seq, width], np.int64)
    constants["scale"] = np.array(size**-0.5, np.float32)
    for n in "qkvo":
        constants[f"w{n}"] = rng.standard_normal((width, width)).astype(np.float32) / 8
    for n in "qkv":
        constants[f"b{n}"] = rng.standard_normal((heads, size)).astype(np.float32)
    io = {"x": (F, [batch, seq, width])} | ({"m": (F, [memory, seq, width])} if memory else {})
    out = [batch if isinstance(batch, int) else "unk__out", seq, width]
    model = make_model(nodes, io, {"y": (F, out)}, constants, opset=17)
    inferred = ir.passes.common.ShapeInferencePass()(model.clone()).model
    ranks = {v.name: len(v.shape) for node in inferred.graph for v in node.outputs}
    count = iter(range(1000))
    for value in (v for node in model.graph for v in node.outputs if v.name != "y"):
        value.shape = ir.Shape([f"unk__{next(count)}" for _ in range(ranks[value.name])])
    return model


def _merge_batch(x: str, out: str, transpose: bool = False):
    """tf2onnx's Reshape of a 5-D ``x`` to ``(prod(x.shape[:2]), -1, x.shape[4])`` (then a
    Transpose of the last two axes): the target from Shape, Gather, ReduceProd and Concat."""
    nodes = [
        ("Shape", [x], [f"{x}_shape"], {}),
        ("Gather", [f"{x}_shape", "c01"], [f"{x}_b"], {}),
        ("ReduceProd", [f"{x}_b"], [f"{x}_bp"], {"keepdims": 1}),
        ("Gather", [f"{x}_shape", "c4"], [f"{x}_h"], {}),
        ("Gather", [f"{x}_shape", "c2"], [f"{x}_s"], {}),
        ("Gather", [f"{x}_shape", "c3"], [f"{x}_t"], {}),
        ("Concat", [f"{x}_bp", "m1", f"{x}_h"], [f"{x}_target"], {"axis": 0}),
        ("Reshape", [x, f"{x}_target"], [f"{out}_r" if transpose else out], {}),
    ]
    if transpose:
        nodes.append(("Transpose", [f"{out}_r"], [out], {"perm": [0, 2, 1]}))
    return nodes


def _split_batch(x: str, batches: tuple[str, str], rows: str, cols: str, out: str):
    """tf2onnx's Reshape of the 3-D MatMul result back to ``(B, N, rows, cols, 1)`` (the batch
    axes the Max of the operands'), then the Squeeze of the unit axis."""
    return [
        ("Max", list(batches), [f"{x}_b"], {}),
        ("Concat", [f"{x}_b", rows, cols, "c1"], [f"{x}_target"], {"axis": 0}),
        ("Reshape", [x, f"{x}_target"], [f"{x}_5"], {}),
        ("Squeeze", [f"{x}_5", "c4"], [out], {}),
    ]


def test_tf2onnx_attention_with_unknown_dims_named_fuses(rng):
    """The shapes are static (a 1x64x128 input) but every value names its dimensions
    ``unk__N``: the folder's node-by-node shape inference proves them numbers, the Shape
    arithmetic folds, and both Einsums read as the attention (one com.microsoft Attention);
    the output is the graph's."""
    model = _tf2onnx_attention()
    feeds = {"x": rng.standard_normal((1, 64, 128)).astype(np.float32)}
    before = run(model, feeds)
    report = fusion.optimize(model, target="ort")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert report.counts["attention_fused"] == 1 and not report.refused, report.to_dict()
    assert not {"Shape", "Softmax", "Squeeze", "ReduceProd", "Max"} & set(ops), ops
    assert_close(run(model, feeds), before, rtol=1e-5)


@pytest.mark.parametrize(
    ("target", "opset", "kind"), [("ort", 17, "attention_fused"), ("onnx", 23, "sdpa_fused")]
)
def test_tf2onnx_attention_with_a_symbolic_batch_fuses(rng, target, opset, kind):
    """The input's batch a symbol (``unk__in``, as tf2onnx names it) and every intermediate
    value's dimensions ``unk__N``: the Shape arithmetic cannot fold, and is followed
    symbolically instead. Inference proves the projections' batch the input's symbol (their
    ``unk__N`` replaced), the Reshape targets are read as products of it (``unk__in * 4``), and
    both Einsums read as the attention (one com.microsoft Attention; ONNX's at opset 23); the
    same fused model gives the graph's output for batches 1, 2 and 3."""
    model = _tf2onnx_attention(batch="unk__in")
    model.opset_imports[""] = opset
    feeds = [{"x": rng.standard_normal((b, 64, 128)).astype(np.float32)} for b in (1, 2, 3)]
    before = [run(model, f) for f in feeds]
    report = fusion.optimize(model, target=target)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert report.counts[kind] == 1 and not report.refused, report.to_dict()
    assert not {"Shape", "Softmax", "Squeeze", "ReduceProd", "Max"} & set(ops), ops
    assert [str(d) for d in model.graph.outputs[0].shape] == ["unk__out", "64", "128"]
    for f, b in zip(feeds, before, strict=True):
        assert_close(run(model, f), b, rtol=1e-5)


def test_a_max_over_two_batches_that_can_differ_is_left(rng):
    """A cross-attention of one head whose query and memory have batches of their own (``B``,
    ``C``): the 3-D MatMuls broadcast a batch of 1 against the other (ONNX Runtime runs it for
    1 and 3), and the ``Max`` of the two batches in the Reshape targets is neither symbol. The
    targets cannot be read, the Einsums stay as written (the ``Max`` with them), the attention
    is refused, and the output is the graph's."""
    model = _tf2onnx_attention(heads=1, size=128, batch="B", memory="C")
    shapes = [(1, 3), (2, 2), (3, 1)]
    feeds = [
        {
            n: rng.standard_normal((b, 64, 128)).astype(np.float32)
            for n, b in zip("xm", pair, strict=True)
        }
        for pair in shapes
    ]
    before = [run(model, f) for f in feeds]
    assert [b[0].shape[0] for b in before] == [3, 2, 3]
    report = fusion.optimize(model, target="ort")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert report.counts["attention_fused"] == 0, report.to_dict()
    assert [(r.family, r.code) for r in report.refused] == [("attention", Code.SCORES_FORM)]
    assert {"Max", "Squeeze", "Softmax"} <= set(ops), ops
    for f, b in zip(feeds, before, strict=True):
        assert_close(run(model, f), b, rtol=1e-6)


def test_batches_that_may_broadcast_are_not_paired(rng):
    """One head merged into batches of their own (``B``, ``C``): the 3-D MatMul broadcasts a
    batch of 1 against the other, so the result's batch is neither symbol where they differ,
    and the Reshape after it (its -1) cannot be read as the query's batch: left as written."""
    nodes = [
        ("Reshape", ["q", "three"], ["q3"], {}),
        ("Reshape", ["k", "three"], ["k3"], {}),
        ("MatMul", ["q3", "k3"], ["s3"], {}),
        ("Reshape", ["s3", "four"], ["y"], {}),
    ]
    constants = {"three": np.array([-1, 8, 8], np.int64), "four": np.array([-1, 1, 8, 8])}
    io = {"q": (F, ["B", 1, 8, 8]), "k": (F, ["C", 1, 8, 8])}
    model = make_model(nodes, io, {"y": (F, None)}, constants)
    feeds = {
        n: rng.standard_normal((b, 1, 8, 8)).astype(np.float32)
        for n, b in zip("qk", (1, 3), strict=True)
    }
    before = run(model, feeds)
    assert before[0].shape == (3, 1, 8, 8)
    fusion.optimize(model, target="onnx")
    assert [n.op_type for n in model.graph] == ["Reshape", "Reshape", "MatMul", "Reshape"]
    assert_close(run(model, feeds), before, rtol=0)
