"""The passes inside subgraphs (docs/fusions.md#subgraphs): a LayerNorm in both branches of an
``If``, an attention in a ``Loop`` body, an RMSNorm in a ``Scan`` body, each reading values of
the outer graph; each optimized model is run on ONNX Runtime against the unfused one, and what
was fused or left alone carries the subgraph's path."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusion
from tests.support.graphs import assert_close, run
from tests.support.norm_graphs import Graph, layernorm, rmsnorm

F = TensorProto.FLOAT
SHAPE = (2, 3, 16)


def _subgraph(g: Graph, prefix: str, inputs, outputs, outer=()) -> onnx.GraphProto:
    """``g``'s nodes and constants as a subgraph whose names carry ``prefix`` (sibling
    subgraphs do not share names), except ``outer``: names of the graph around it. ``inputs``
    and ``outputs`` map the subgraph's own names to ``(type, shape)``."""
    keep = set(outer) | set(inputs)

    def named(name: str) -> str:
        return name if name in keep or not name else f"{prefix}_{name}"

    nodes = [
        helper.make_node(op, [named(i) for i in ins], [named(o) for o in outs], **attrs)
        for op, ins, outs, attrs in g.nodes
    ]
    constants = [numpy_helper.from_array(np.asarray(a), named(n)) for n, a in g.constants.items()]
    return helper.make_graph(
        nodes,
        prefix,
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(named(n), t, s) for n, (t, s) in outputs.items()],
        constants,
    )


def _model(nodes, inputs, outputs, weights, opset=18) -> ir.Model:
    """A checked model of the main graph ``nodes`` (protos) with initializers ``weights``."""
    graph = helper.make_graph(
        nodes,
        "main",
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(n, t, s) for n, (t, s) in outputs.items()],
        [numpy_helper.from_array(a, n) for n, a in weights.items()],
    )
    imports = [helper.make_opsetid("", opset)]
    proto = helper.make_model(graph, opset_imports=imports, ir_version=11 if opset >= 23 else 10)
    onnx.checker.check_model(proto, full_check=True)
    return ir.serde.deserialize_model(proto)


def _ops(model: ir.Model) -> list[str]:
    """The op types of every graph of ``model``, subgraphs included."""
    return [n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph)]


def _optimized(model: ir.Model, feeds: list[dict], **settings) -> fusion.FusionReport:
    """Optimize ``model`` in place; assert it passes the checker and gives the outputs it gave
    before on each of ``feeds`` (ONNX Runtime, its own optimizations off)."""
    before = [run(model, f) for f in feeds]
    report = fusion.optimize(model, **settings)
    fusion.check(model)
    for f, want in zip(feeds, before, strict=True):
        assert_close(run(model, f), want)
    return report


def _if_layernorms(rng: np.random.Generator, eps_outside: bool = False) -> ir.Model:
    """``y = If(c, LN(x) * w + b, LN'(x) * w' + b')``: the then branch reads its weights from
    the main graph, the else branch holds its own (and another eps); ``eps_outside``: the then
    branch's eps is added to the root, not under it (no LayerNormalization)."""
    branches = {}
    for prefix, eps, outer in (("then", 1e-5, True), ("else", 1e-3, False)):
        g = Graph()
        normed = layernorm(g, "x", eps=eps, eps_outside=eps_outside and outer)
        w = "w" if outer else g.const("w", rng.standard_normal(16).astype(np.float32))
        b = "b" if outer else g.const("b", rng.standard_normal(16).astype(np.float32))
        g.node("Add", [g.node("Mul", [normed, w], "scaled"), b], "y")
        outer_names = ("x", "w", "b") if outer else ("x",)
        branches[f"{prefix}_branch"] = _subgraph(g, prefix, {}, {"y": (F, None)}, outer_names)
    weights = {n: rng.standard_normal(16).astype(np.float32) for n in ("w", "b")}
    node = helper.make_node("If", ["c"], ["y"], name="cond_node", **branches)
    inputs = {"x": (F, SHAPE), "c": (TensorProto.BOOL, [])}
    return _model([node], inputs, {"y": (F, SHAPE)}, weights)


def _feeds(rng: np.random.Generator) -> list[dict]:
    x = (0.5 + 2 * rng.standard_normal(SHAPE)).astype(np.float32)
    return [{"x": x, "c": np.array(c)} for c in (True, False)]


def test_a_layernorm_in_each_branch_of_an_if_is_fused_with_its_path():
    rng = np.random.default_rng(0)
    model = _if_layernorms(rng)
    report = _optimized(model, _feeds(rng))
    assert report.counts["layernorm_fused"] == 2, report
    paths = sorted(f.path for f in report.fused)
    assert paths == ["If 'cond_node' / else_branch", "If 'cond_node' / then_branch"]
    assert sorted(_ops(model)) == ["If", "LayerNormalization", "LayerNormalization"]
    assert fusion.norm_ops(model) == {"LayerNormalization": 2}  # the report's counts see them
    then_y = model.graph.node(0).attributes["then_branch"].as_graph().outputs[0]
    assert then_y.name == "then_y"  # a subgraph's output keeps its name


def test_a_refusal_in_a_branch_names_the_branch():
    rng = np.random.default_rng(1)
    model = _if_layernorms(rng, eps_outside=True)
    report = _optimized(model, _feeds(rng))
    (left,) = report.refused
    assert left.path == "If 'cond_node' / then_branch" and left.family == "layernorm", left
    assert left.code == "eps_outside_sqrt"
    assert left.where.startswith("If 'cond_node' / then_branch / '"), left.where
    assert report.counts["layernorm_fused"] == 1
    assert fusion.unlisted(model, report) == []


def _loop_attention(opset: int, trips: int = 2) -> ir.Model:
    """A decoder step run ``trips`` times by a ``Loop``: the state ``h`` (2, 3, 5, 8) is the
    query of a softmax attention over ``k`` and ``v`` of the main graph, ``h <- attention(h)``."""
    g = Graph(opset)
    kt = g.node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2])
    scores = g.node(
        "Mul",
        [g.node("MatMul", ["h", kt], "raw"), g.const("scale", np.float32(1 / math.sqrt(8)))],
        "s",
    )
    g.node("Identity", ["cond"], "cond_out")
    g.node("MatMul", [g.node("Softmax", [scores], "p", axis=-1), "v"], "h_out")
    state = (F, [2, 3, 5, 8])
    inputs = {"i": (TensorProto.INT64, []), "cond": (TensorProto.BOOL, []), "h": state}
    body = _subgraph(
        g, "body", inputs, {"cond_out": (TensorProto.BOOL, []), "h_out": state}, ("k", "v")
    )
    node = helper.make_node("Loop", ["trips", "", "h0"], ["h"], name="steps", body=body)
    weights = {"trips": np.array(trips, np.int64)}
    inputs = {n: (F, [2, 3, 5 if n == "h0" else 7, 8]) for n in ("h0", "k", "v")}
    return _model([node], inputs, {"h": (F, [2, 3, 5, 8])}, weights, opset)


@pytest.mark.parametrize(
    ("target", "opset", "outcome"),
    [
        ("onnx", 18, "sdpa_fused"),  # ONNX's Attention, the opset raised to 23
        ("ort", 18, "attention_fused"),  # onnxscript's rules: MultiHeadAttention
        ("onnx", 17, "opset_too_low"),  # the version converter does not raise below 18
    ],
)
def test_an_attention_in_a_loop_body_is_fused_or_refused_with_its_path(target, opset, outcome):
    rng = np.random.default_rng(2)
    model = _loop_attention(opset)
    feeds = {
        v.name: rng.standard_normal(v.shape.numpy()).astype(np.float32) for v in model.graph.inputs
    }
    report = _optimized(model, [feeds], target=target)
    (found,) = [*report.fused, *report.refused]
    assert found.path == "Loop 'steps' / body" and found.node == "body_p", found
    if outcome == "opset_too_low":
        assert found.code == outcome and "Softmax" in _ops(model)
    else:
        assert found.kind == outcome and "Softmax" not in _ops(model)
    assert fusion.unlisted(model, report) == []


def _scan_rmsnorm(rng: np.random.Generator, opset: int) -> ir.Model:
    """A recurrence over the rows of ``x`` (5, 2, 16) by a ``Scan``: ``s <- RMSNorm(s + x_t) *
    w``, each step's ``s`` an output, ``w`` from the main graph."""
    g = Graph(opset)
    summed = g.node("Add", ["s", "x_t"], "summed")
    normed = rmsnorm(g, summed)
    g.node("Identity", [g.node("Mul", [normed, "w"], "s_out")], "y_t")
    row = (F, [2, 16])
    body = _subgraph(g, "body", {"s": row, "x_t": row}, {"s_out": row, "y_t": row}, ("w",))
    node = helper.make_node(
        "Scan", ["s0", "x"], ["s", "y"], name="rows", body=body, num_scan_inputs=1
    )
    weights = {"w": rng.standard_normal(16).astype(np.float32)}
    inputs = {"s0": (F, [2, 16]), "x": (F, [5, 2, 16])}
    outputs = {"s": (F, [2, 16]), "y": (F, [5, 2, 16])}
    return _model([node], inputs, outputs, weights, opset)


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_an_rmsnorm_in_a_scan_body_is_fused(target):
    rng = np.random.default_rng(3)
    model = _scan_rmsnorm(rng, 23 if target == "onnx" else 18)  # RMSNormalization: opset 23
    feeds = {
        "s0": rng.standard_normal((2, 16)).astype(np.float32),
        "x": (0.5 + 2 * rng.standard_normal((5, 2, 16))).astype(np.float32),
    }
    report = _optimized(model, [feeds], target=target)
    assert report.counts["rmsnorm_fused"] == 1, report
    assert report.fused[0].path == "Scan 'rows' / body"
    assert "ReduceMean" not in _ops(model)
    assert fusion.unlisted(model, report) == []
