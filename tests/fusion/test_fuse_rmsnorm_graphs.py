"""FuseRMSNorm on hand-written ONNX graphs (no PyTorch): what it fuses, what it refuses.

Every fused graph runs on ONNX Runtime before and after the pass on random inputs with
randomized weights, and must pass :func:`fusion.check`; every refusal is asserted by its code,
with the graph left byte for byte as it was. The exporter-based cases are in
``test_fuse_rmsnorm.py`` (slow).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

from fusion import Code
from fusion.fuse_rmsnorm import FuseRMSNorm
from tests.support.graphs import ops
from tests.support.norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare, rmsnorm

H = SHAPE[-1]
FLOAT = TensorProto.FLOAT
IO = {"x": (FLOAT, SHAPE)}


def _llama(g: Graph, rng: np.random.Generator, **kwargs) -> ir.Model:
    """``weight * rmsnorm(x)`` with a random weight."""
    w = g.const("w", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
    y = g.node("Mul", [w, rmsnorm(g, "x", **kwargs)], "y")
    return g.model(IO, {y: (FLOAT, SHAPE)})


@pytest.mark.parametrize(
    ("opset", "target", "op"),
    [
        (23, "onnx", "RMSNormalization"),
        (23, "ort", "RMSNormalization"),
        (18, "ort", "SimplifiedLayerNormalization"),
    ],
)
def test_llama_rmsnorm_is_fused(rng, opset, target, op):
    g = Graph(opset)
    model = _llama(g, rng)
    report = fuse_and_compare(model, FuseRMSNorm(target), rng)
    assert report.counts["rmsnorm_fused"] == 1 and not report.refused
    (node,) = model.graph
    assert (node.op_type, node.domain) == (op, "")
    assert node.attributes.get_int("axis") == -1
    assert node.attributes.get_float("epsilon") == np.float32(1e-6)
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), g.constants["w"])
    assert model.opset_imports[""] == opset  # never raised


def test_float16_round_trip_is_fused_on_float16(rng):
    """The HF habit: Cast up, normalize, Cast back, then the float16 weight."""
    g = Graph(23)
    normed = rmsnorm(g, g.node("Cast", ["x16"], "x", to=FLOAT))
    w = g.const("w", (1 + 0.5 * rng.standard_normal(H)).astype(np.float16))
    y = g.node("Mul", [g.node("Cast", [normed], "normed16", to=TensorProto.FLOAT16), w], "y")
    model = g.model({"x16": (TensorProto.FLOAT16, SHAPE)}, {y: (TensorProto.FLOAT16, SHAPE)})
    fuse_and_compare(model, FuseRMSNorm("onnx"), rng, rtol=2e-3)
    assert ops(model) == ["RMSNormalization"]
    assert model.graph.node(0).inputs[0].name == "x16"


def test_opset_18_with_target_onnx_is_refused(rng):
    report = assert_refused(_llama(Graph(18), rng), FuseRMSNorm("onnx"), Code.OPSET_TOO_LOW)
    assert "export with --opset 23" in report.refused[0].detail


def test_weight_varying_along_a_non_normalized_axis_stays_a_mul(rng):
    g = Graph(23)
    w = g.const("w", (1 + 0.5 * rng.standard_normal((SHAPE[1], 1))).astype(np.float32))
    y = g.node("Mul", [rmsnorm(g, "x"), w], "y")
    model = g.model(IO, {y: (FLOAT, SHAPE)})
    report = fuse_and_compare(model, FuseRMSNorm("onnx"), rng)
    assert report.codes() == [Code.AXIS_NOT_NORMALIZED]
    assert ops(model) == ["RMSNormalization", "Mul"]


def test_eps_outside_sqrt_is_refused(rng):
    assert_refused(
        _llama(Graph(23), rng, eps_outside=True), FuseRMSNorm("ort"), Code.EPS_OUTSIDE_SQRT
    )


def test_mean_over_non_trailing_axes_is_refused(rng):
    assert_refused(_llama(Graph(23), rng, axes=(1,)), FuseRMSNorm("ort"), Code.AXES_NOT_TRAILING)


def test_mean_square_read_outside_is_refused():
    g = Graph(23)
    y = rmsnorm(g, "x")
    model = g.model(IO, {y: (FLOAT, SHAPE), "ms": (FLOAT, None)})
    assert_refused(model, FuseRMSNorm("ort"), Code.SHARED_OUTPUT)


@pytest.mark.parametrize("clamp", ["Max", "Clip"])
def test_f_normalize_is_refused(clamp):
    """``F.normalize(x) * sqrt(d)``: the L2 norm clamped at eps, then a division."""
    g = Graph(23)
    norm = g.reduce("ReduceL2", "x", "l2", (-1,))
    eps = g.const("eps", np.float32(1e-12))
    den = g.node(clamp, [norm, eps], "den")
    normed = g.node("Div", ["x", den], "normed")
    y = g.node("Mul", [normed, g.const("sqrt_d", np.float32(np.sqrt(H)))], "y")
    model = g.model(IO, {y: (FLOAT, SHAPE)})
    assert_refused(model, FuseRMSNorm("ort"), Code.F_NORMALIZE)


def _written_rmsnorm(g: Graph, rng, *, total=None, eps: float | None = 1e-6) -> str:
    """``w * x / sqrt(ms + eps)``, the mean square ``ReduceMean(x * x)`` or, with ``total =
    (op, c)``, ``ReduceSum(x * x)`` then ``Div`` / ``Mul`` by ``c``; ``eps=None``: no Add."""
    sq = g.node("Mul", ["x", "x"], "sq")
    if total is None:
        ms = g.reduce("ReduceMean", sq, "ms", (-1,))
    else:
        op, c = total
        s = g.node("ReduceSum", [sq, g.const("ms_axes", np.array([-1], np.int64))], "ms_sum")
        ms = g.node(op, [s, g.const("c", np.float32(c))], "ms")
    if eps is not None:
        ms = g.node("Add", [ms, g.const("eps", np.float32(eps))], "ms_eps")
    den = g.node("Sqrt", [ms], "den")
    w = g.const("w", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
    return g.node("Mul", [g.node("Div", ["x", den], "normed"), w], "y")


@pytest.mark.parametrize("total", [("Div", H), ("Mul", 1 / H)], ids=["div", "mul"])
def test_sum_of_squares_over_d_is_fused(rng, total):
    g = Graph(23)
    model = g.model(IO, {_written_rmsnorm(g, rng, total=total): (FLOAT, SHAPE)})
    report = fuse_and_compare(model, FuseRMSNorm("onnx"), rng)
    assert report.counts["rmsnorm_fused"] == 1 and not report.refused
    (node,) = model.graph
    assert node.attributes.get_float("epsilon") == np.float32(1e-6)
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), g.constants["w"])


def test_sum_of_squares_over_another_constant_is_a_scaled_mean_square(rng):
    """``sum(x^2) / c`` is ``H / c`` times the mean square: exact with epsilon ``eps c / H``
    and scale ``w sqrt(c / H)``."""
    g = Graph(23)
    model = g.model(IO, {_written_rmsnorm(g, rng, total=("Div", H - 1)): (FLOAT, SHAPE)})
    fuse_and_compare(model, FuseRMSNorm("onnx"), rng)
    (node,) = model.graph
    assert node.attributes.get_float("epsilon") == pytest.approx(1e-6 * (H - 1) / H, rel=1e-6)


def test_rmsnorm_with_no_eps_is_fused_with_epsilon_0(rng):
    g = Graph(23)
    model = g.model(IO, {_written_rmsnorm(g, rng, eps=None): (FLOAT, SHAPE)})
    report = fuse_and_compare(model, FuseRMSNorm("onnx"), rng)
    (node,) = model.graph
    assert node.attributes.get_float("epsilon") == 0.0
    (note,) = report.notes
    assert "NaN on a row of zeros" in note
    assert "epsilon 0" in report.fused[0].became


def test_rmsnorms_sharing_their_mean_square_are_all_fused(rng):
    """Two RMSNorms of one x with eps 1e-6 and 1e-5 read one square and one mean square."""
    g = Graph(23)
    ms = g.reduce("ReduceMean", g.node("Mul", ["x", "x"], "sq"), "ms", (-1,))
    outputs = {}
    for k, eps in enumerate((1e-6, 1e-5)):
        den = g.node(
            "Sqrt", [g.node("Add", [ms, g.const(f"eps{k}", np.float32(eps))], f"a{k}")], f"s{k}"
        )
        w = g.const(f"w{k}", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
        outputs[g.node("Mul", [g.node("Div", ["x", den], f"n{k}"), w], f"y{k}")] = (FLOAT, SHAPE)
    model = g.model(IO, outputs)
    report = fuse_and_compare(model, FuseRMSNorm("onnx"), rng)
    assert report.counts["rmsnorm_fused"] == 2 and not report.refused
    assert ops(model) == ["RMSNormalization", "RMSNormalization"]


def test_weight_before_the_division_is_the_scale(rng):
    """``w * x / sqrt(mean(x^2) + eps)``: the weight multiplies before the division."""
    g = Graph(23)
    ms = g.reduce("ReduceMean", g.node("Mul", ["x", "x"], "sq"), "ms", (-1,))
    den = g.node("Sqrt", [g.node("Add", [ms, g.const("eps", np.float32(1e-6))], "a")], "den")
    w = g.const("w", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
    y = g.node("Div", [g.node("Mul", [w, "x"], "wx"), den], "y")
    model = g.model(IO, {y: (FLOAT, SHAPE)})
    fuse_and_compare(model, FuseRMSNorm("onnx"), rng)
    (node,) = model.graph
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), g.constants["w"])
