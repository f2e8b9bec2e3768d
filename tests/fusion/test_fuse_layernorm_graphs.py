"""FuseLayerNorm on hand-written ONNX graphs (no PyTorch): what it fuses, what it refuses.

Every fused graph runs on ONNX Runtime before and after the pass on random inputs with
randomized weights, and must pass :func:`fusion.check`; every refusal is asserted by its code,
with the graph left byte for byte as it was. The exporter-based cases are in
``test_fuse_layernorm.py`` (slow).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from graphs import ops
from norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare, layernorm
from onnx import TensorProto

from fusion.base import Code
from fusion.fuse_layernorm import FuseLayerNorm

H = SHAPE[-1]
FLOAT = TensorProto.FLOAT
IO = {"x": (FLOAT, SHAPE)}


def _model(g: Graph, y: str, outputs=()):
    """The model of ``g`` with input ``x`` and output ``y`` (plus ``outputs``, of unknown
    shape)."""
    return g.model(IO, {y: (FLOAT, SHAPE), **{o: (FLOAT, None) for o in outputs}})


def _the_node(model):
    (node,) = model.graph
    assert node.op_type == "LayerNormalization"
    return node


@pytest.mark.parametrize("reciprocal", [False, True], ids=["div", "mul_reciprocal"])
def test_textbook_layernorm_is_fused(rng, reciprocal):
    g = Graph()
    y = layernorm(g, "x", reciprocal=reciprocal)
    model = _model(g, y)
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    node = _the_node(model)
    assert node.attributes.get_int("axis") == -1
    assert node.attributes.get_float("epsilon") == np.float32(1e-5)
    assert node.attributes.get_int("stash_type") == 1


def test_weight_and_bias_are_absorbed(rng):
    g = Graph()
    normed = layernorm(g, "x", axes=(-2, -1))
    w = g.const("w", (1 + 0.5 * rng.standard_normal(SHAPE[1:])).astype(np.float32))
    b = g.const("b", rng.standard_normal(SHAPE[1:]).astype(np.float32))
    y = g.node("Add", [g.node("Mul", [w, normed], "scaled"), b], "y")
    model = _model(g, y)
    fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    node = _the_node(model)
    assert node.attributes.get_int("axis") == -2
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), g.constants["w"])
    np.testing.assert_array_equal(node.inputs[2].const_value.numpy(), g.constants["b"])


def test_float16_round_trip_is_fused_on_float16(rng):
    """Cast up, normalize in float32, Cast back, then a float16 weight and bias: one
    LayerNormalization on the float16 input (stash_type=1 normalizes in float32)."""
    g = Graph()
    x = g.node("Cast", ["x16"], "x", to=FLOAT)
    normed = g.node("Cast", [layernorm(g, x)], "normed16", to=TensorProto.FLOAT16)
    w = g.const("w", (1 + 0.5 * rng.standard_normal(H)).astype(np.float16))
    b = g.const("b", rng.standard_normal(H).astype(np.float16))
    y = g.node("Add", [g.node("Mul", [normed, w], "scaled"), b], "y")
    model = g.model({"x16": (TensorProto.FLOAT16, SHAPE)}, {y: (TensorProto.FLOAT16, SHAPE)})
    fuse_and_compare(model, FuseLayerNorm("onnx"), rng, rtol=2e-3)
    node = _the_node(model)
    assert node.inputs[0].name == "x16"
    assert node.inputs[1].dtype == node.inputs[2].dtype == ir.DataType.FLOAT16


def test_opset_16_is_fused_for_ort(rng):
    """ONNX Runtime registers LayerNormalization in the default domain at every opset."""
    g = Graph(opset=16)
    model = _model(g, layernorm(g, "x"))
    fuse_and_compare(model, FuseLayerNorm("ort"), rng)
    assert ops(model) == ["LayerNormalization"]


def test_opset_16_is_refused_for_onnx():
    g = Graph(opset=16)
    report = assert_refused(_model(g, layernorm(g, "x")), FuseLayerNorm("onnx"), Code.OPSET_TOO_LOW)
    assert "export with --opset 17" in report.refused[0].detail


def test_weight_varying_along_a_non_normalized_axis_stays_a_mul(rng):
    g = Graph()
    w = g.const("w", (1 + 0.5 * rng.standard_normal((SHAPE[1], 1))).astype(np.float32))
    y = g.node("Mul", [layernorm(g, "x"), w], "y")
    model = _model(g, y)
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1
    assert report.codes() == [Code.AXIS_NOT_NORMALIZED]
    assert ops(model) == ["LayerNormalization", "Mul"]


def _assert_refused(code: Code, outputs=(), **kwargs) -> None:
    g = Graph()
    model = _model(g, layernorm(g, "x", **kwargs), outputs)
    assert_refused(model, FuseLayerNorm("onnx"), code)


def test_eps_outside_sqrt_is_refused():
    _assert_refused(Code.EPS_OUTSIDE_SQRT, eps_outside=True)


def test_mean_over_non_trailing_axes_is_refused():
    _assert_refused(Code.AXES_NOT_TRAILING, axes=(1,))


def test_mean_and_variance_over_different_axes_are_refused():
    _assert_refused(Code.DIFFERENT_AXES, var_axes=(-2, -1))


def test_intermediate_read_outside_is_refused():
    _assert_refused(Code.SHARED_OUTPUT, outputs=("var",))


def test_other_numerator_is_refused():
    _assert_refused(Code.WRONG_NUMERATOR, numerator="x")


def test_eps_of_several_elements_is_refused():
    _assert_refused(Code.EPS_NOT_SCALAR, eps=np.full(H, 1e-5, np.float32))


def test_eps_from_a_graph_input_is_refused():
    g = Graph()
    y = layernorm(g, "x", eps="eps_in")
    model = g.model({**IO, "eps_in": (FLOAT, [])}, {y: (FLOAT, SHAPE)})
    assert_refused(model, FuseLayerNorm("onnx"), Code.NOT_CONSTANT)


def test_float64_norm_is_refused():
    g = Graph()
    x = g.node("Cast", ["x"], "x64", to=TensorProto.DOUBLE)
    g.const("two", np.float64(2))
    d = g.node("Sub", [x, g.reduce("ReduceMean", x, "mean", (-1,))], "d")
    var = g.reduce("ReduceMean", g.node("Pow", [d, "two"], "sq"), "var", (-1,))
    den = g.node("Sqrt", [g.node("Add", [var, g.const("eps", np.float64(1e-5))], "ve")], "den")
    y = g.node("Div", [d, den], "y")
    model = g.model(IO, {y: (TensorProto.DOUBLE, SHAPE)})
    assert_refused(model, FuseLayerNorm("onnx"), Code.UNSUPPORTED_DTYPE)
