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
from graphs import ops
from norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare, rmsnorm
from onnx import TensorProto

from fusion.base import Code
from fusion.fuse_rmsnorm import FuseRMSNorm

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
