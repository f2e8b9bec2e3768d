"""PruneRows on hand-written graphs (no PyTorch): a transformer block whose output is read at
some rows (a class token, the last token, a range), run on ONNX Runtime before and after
(random weights); the ops that read other rows stop the selection."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

import fusion
from fusion import Code
from fusion.prune_rows import PruneRows
from tests.support.graphs import assert_close, run
from tests.support.norm_graphs import Graph, fuse_and_compare, inputs

FLOAT = TensorProto.FLOAT
B, S, N, H = 2, 7, 2, 8
D = N * H


def _weights(g: Graph, rng: np.random.Generator, name: str, shape) -> str:
    return g.const(name, (0.3 * rng.standard_normal(shape)).astype(np.float32))


def _linear(g: Graph, rng, x: str, name: str, width: int = D) -> str:
    w = _weights(g, rng, f"{name}_w", (D if x != "fc1_out" else 4 * D, width))
    y = g.node("MatMul", [x, w], f"{name}_mm")
    return g.node("Add", [y, _weights(g, rng, f"{name}_b", (width,))], name)


def _norm(g: Graph, rng, x: str, name: str) -> str:
    scale = g.const(f"{name}_s", (1 + 0.3 * rng.standard_normal(D)).astype(np.float32))
    return g.node("LayerNormalization", [x, scale, _weights(g, rng, f"{name}_b", (D,))], name)


def _heads(g: Graph, x: str, name: str) -> str:
    """``(B, S, D)`` -> ``(B, N, S, H)``."""
    shape = g.const(f"{name}_shape", np.array([B, S, N, H], np.int64))
    split = g.node("Reshape", [x, shape], f"{name}_r")
    return g.node("Transpose", [split], name, perm=[0, 2, 1, 3])


def _block(g: Graph, rng, x: str, *, causal: bool = False, mask: bool = False) -> str:
    """A pre-norm transformer block: ONNX's 4-D Attention, a GELU MLP, two residual adds."""
    h = _norm(g, rng, x, "ln1")
    q, k, v = (_heads(g, _linear(g, rng, h, n), f"{n}_h") for n in ("q", "k", "v"))
    inputs = [q, k, v]
    if mask:
        inputs.append(_weights(g, rng, "mask", (1, 1, S, S)))
    a = g.node("Attention", inputs, "attn", is_causal=int(causal))
    merged = g.node("Transpose", [a], "attn_t", perm=[0, 2, 1, 3])
    flat = g.node("Reshape", [merged, g.const("flat", np.array([B, S, D], np.int64))], "attn_f")
    x = g.node("Add", [x, _linear(g, rng, flat, "o")], "res1")
    up = g.node("Gelu", [_linear(g, rng, _norm(g, rng, x, "ln2"), "fc1", 4 * D)], "fc1_out")
    return g.node("Add", [x, _linear(g, rng, up, "fc2")], "res2")


def _gather(g: Graph, x: str, index, axis: int = 1) -> str:
    return g.node("Gather", [x, g.const("index", np.array(index, np.int64))], "picked", axis=axis)


def _classifier(rng, select, **block):
    """``head(LN(block(x))[select])``, the selection a function of the graph and a value."""
    g = Graph(opset=23)
    y = select(g, _norm(g, rng, _block(g, rng, "x", **block), "ln_f"))
    return g, y


def _shape_of(model, name: str) -> list:
    value = next(v for n in model.graph for v in n.outputs if v.name == name)
    return list(value.shape)


def _inputs_of(model, op_type: str) -> list[list]:
    return [list(n.inputs[0].shape) for n in model.graph if n.op_type == op_type]


@pytest.mark.parametrize("index", [0, -1, [0], [0, 3]])
def test_class_token_reaches_the_attentions_query(index):
    rng = np.random.default_rng(0)
    g, y = _classifier(rng, lambda g, x: _gather(g, x, index))
    model = g.model({"x": (FLOAT, (B, S, D))}, {y: (FLOAT, None)})
    report = fuse_and_compare(model, PruneRows(), rng)
    rows = 1 if np.ndim(index) == 0 else len(index)
    assert report.counts["rows_pruned"] == 1
    # the query (B, N, rows, H) and its projection on the rows, the keys and values whole;
    # every MatMul after the attention on the rows
    assert [s[2] for s in _inputs_of(model, "Attention")] == [rows]
    assert sorted(s[1] for s in _inputs_of(model, "MatMul")) == [rows] * 4 + [S] * 2
    assert [s[1] for s in _inputs_of(model, "LayerNormalization")] == [S, rows, rows]


def test_last_tokens_by_a_slice_and_a_mask_over_the_scores():
    rng = np.random.default_rng(1)

    def last_two(g, x):
        consts = [g.const(n, np.array([a], np.int64)) for n, a in
                  (("st", -2), ("en", 2**63 - 1), ("ax", 1), ("sp", 1))]  # fmt: skip
        return g.node("Slice", [x, *consts], "picked")

    g, y = _classifier(rng, last_two, mask=True)
    model = g.model({"x": (FLOAT, (B, S, D))}, {y: (FLOAT, None)})
    fuse_and_compare(model, PruneRows(), rng)
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert list(attention.inputs[0].shape)[2] == 2
    assert list(attention.inputs[3].shape) == [1, 1, 2, S]  # the mask's rows of those queries


def test_a_causal_attention_keeps_its_query_whole():
    """A causal mask's rows are positions: the selection stops at the attention's output."""
    rng = np.random.default_rng(2)
    g, y = _classifier(rng, lambda g, x: _gather(g, x, -1), causal=True)
    model = g.model({"x": (FLOAT, (B, S, D))}, {y: (FLOAT, None)})
    fuse_and_compare(model, PruneRows(), rng)
    assert [s[2] for s in _inputs_of(model, "Attention")] == [S]
    assert sorted(s[1] for s in _inputs_of(model, "MatMul")) == [1] * 3 + [S] * 3


def test_multi_head_attention_query_and_bias_rows():
    """ONNX Runtime's MultiHeadAttention: the query's rows and the attention bias's rows."""
    rng = np.random.default_rng(3)
    g = Graph(opset=18)
    q, k, v = (_linear(g, rng, "x", n) for n in ("q", "k", "v"))
    bias = _weights(g, rng, "bias", (1, N, S, S))
    a = g.node("MultiHeadAttention", [q, k, v, "", "", bias], "a", num_heads=N,
               domain="com.microsoft")  # fmt: skip
    y = _gather(g, g.node("Relu", [_linear(g, rng, a, "o")], "r"), 0)
    model = g.model({"x": (FLOAT, (B, S, D))}, {y: (FLOAT, None)})
    fuse_and_compare(model, PruneRows(), rng)  # its outputs' shapes: the pass's own
    mha = next(n for n in model.graph if n.op_type == "MultiHeadAttention")
    assert list(mha.inputs[0].shape) == [B, 1, D]
    assert list(mha.inputs[5].shape) == [1, N, 1, S]


def _moved(model) -> tuple[bool, list]:
    """PruneRows on ``model``: whether it changed it, and what it recorded as moved."""
    fusion_pass = PruneRows()
    return fusion_pass(model).modified, fusion_pass.outcomes.fused


def test_a_value_read_whole_elsewhere_stops_the_selection():
    """The block's output is also a graph output: every row of it is read."""
    rng = np.random.default_rng(4)
    g = Graph(opset=23)
    h = g.node("Relu", [_linear(g, rng, "x", "fc")], "h")
    y = _gather(g, h, 0)
    model = g.model({"x": (FLOAT, (B, S, D))}, {y: (FLOAT, None), h: (FLOAT, None)})
    assert _moved(model) == (False, [])


MIXERS = ["softmax_over_rows", "norm_over_rows", "reshape_merging_rows", "columns"]


@pytest.mark.parametrize("mixer", MIXERS)
def test_ops_that_read_other_rows_stop_it(mixer):
    rng = np.random.default_rng(5)
    g = Graph(opset=23)
    h = _linear(g, rng, "x", "fc")
    if mixer == "softmax_over_rows":
        y = _gather(g, g.node("Softmax", [h], "sm", axis=1), 0)
    elif mixer == "norm_over_rows":  # LayerNormalization over (S, D)
        scale = g.const("s", (1 + rng.standard_normal((S, D))).astype(np.float32))
        y = _gather(g, g.node("LayerNormalization", [h, scale], "ln", axis=1), 0)
    elif mixer == "reshape_merging_rows":
        merged = g.node("Reshape", [h, g.const("to", np.array([B, S * D], np.int64))], "m")
        y = _gather(g, merged, [0, 1])
    else:  # a selection of the MatMul's columns reads every row of its input
        y = _gather(g, g.node("MatMul", [h, _weights(g, rng, "w2", (D, D))], "mm"), 0, axis=2)
    assert _moved(g.model({"x": (FLOAT, (B, S, D))}, {y: (FLOAT, None)})) == (False, [])


@pytest.mark.parametrize("reduce", ["ReduceMean", "ReduceSum"])
def test_a_mean_over_rows_is_said_to_read_every_row(reduce):
    """Mean pooling (sentence-transformers): nothing to prune, and the report says so."""
    rng = np.random.default_rng(6)
    g = Graph(opset=23)
    h = g.node("Gelu", [_linear(g, rng, "x", "fc")], "h")
    pooled = g.node(reduce, [h, g.const("axes", np.array([1], np.int64))], "pooled", keepdims=0)
    model = g.model({"x": (FLOAT, (B, S, D))}, {pooled: (FLOAT, None)})
    fusion_pass = PruneRows()
    assert not fusion_pass(model).modified
    assert fusion_pass.outcomes.codes() == [Code.EVERY_ROW_READ]


def test_last_rows_keeps_a_decoders_logits_at_the_last_position():
    """``last_rows``: the logits at the last position only, the selection moved up to the
    causal attention; each equal to the full model's last row."""
    rng = np.random.default_rng(7)
    g = Graph(opset=23)
    h = _norm(g, rng, _block(g, rng, "x", causal=True), "ln_f")
    logits = g.node("MatMul", [h, _weights(g, rng, "lm_head", (D, 40))], "logits")
    model = g.model({"x": (FLOAT, (B, S, D))}, {logits: (FLOAT, None)})
    feeds = inputs(rng, model)
    (full,) = run(model, feeds)
    fusion_pass = PruneRows(last_rows=("logits",))
    assert fusion_pass(model).modified
    fusion.check(model)
    (last,) = run(model, feeds)
    assert last.shape == (B, 1, 40)
    assert_close([last], [full[:, -1:]], rtol=1e-5)
    assert fusion_pass.outcomes.counts["rows_pruned"] == 1
    assert sorted(s[1] for s in _inputs_of(model, "MatMul")) == [1] * 4 + [S] * 3
    assert [s[2] for s in _inputs_of(model, "Attention")] == [S]  # causal: its query whole
