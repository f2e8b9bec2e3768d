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
from onnx import TensorProto

from fusion import Code
from fusion.fuse_layernorm import FuseLayerNorm
from tests.support.graphs import ops, run
from tests.support.norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare, layernorm

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


# Sums instead of means (issue 13 item 4): x.sum(-1, keepdim=True) / d, with ReduceSum's axes
# an input (opset 13 and up).


def _statistic(g: Graph, value: str, out: str, spelling) -> str:
    """The mean of ``value`` over the last axis: ``"mean"`` (ReduceMean), or ``(op, c)``: a
    ReduceSum then ``Div`` by ``c`` or ``Mul`` by ``c`` (``(op, c, reduce)``: another reduce)."""
    if spelling == "mean":
        return g.reduce("ReduceMean", value, out, (-1,))
    op, c, reduce = (*spelling, "ReduceSum")[:3]
    total = g.node(reduce, [value, g.const(f"{out}_axes", np.array([-1], np.int64))], out)
    return g.node(op, [total, g.const(f"{out}_c", np.float32(c))], f"{out}_{op.lower()}")


def _written_layernorm(g: Graph, x: str, *, mean="mean", var="mean", eps=1e-5, inverse=False):
    """``(x - m) / sqrt(v + eps)`` with the mean and the variance spelled as :func:`_statistic`
    says; ``eps=None`` leaves out the Add (a norm with no eps); ``inverse`` multiplies by
    ``Reciprocal(sqrt)``."""
    d = g.node("Sub", [x, _statistic(g, x, "m", mean)], "d")
    v = _statistic(g, g.node("Mul", [d, d], "sq"), "v", var)
    if eps is not None:
        v = g.node("Add", [v, g.const("eps", np.float32(eps))], "v_eps")
    den = g.node("Sqrt", [v], "den")
    if inverse:
        return g.node("Mul", [d, g.node("Reciprocal", [den], "inv")], "normed")
    return g.node("Div", [d, den], "normed")


def _affine(g: Graph, rng, normed: str) -> str:
    w = g.const("w", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
    b = g.const("b", rng.standard_normal(H).astype(np.float32))
    return g.node("Add", [g.node("Mul", [normed, w], "scaled"), b], "y")


@pytest.mark.parametrize(
    "var", ["mean", ("Div", H), ("Mul", 1 / H)], ids=["var_mean", "var_div", "var_mul"]
)
@pytest.mark.parametrize("mean", [("Div", H), ("Mul", 1 / H)], ids=["mean_div", "mean_mul"])
def test_sum_divided_by_the_count_is_a_mean(rng, mean, var):
    g = Graph()
    model = _model(g, _affine(g, rng, _written_layernorm(g, "x", mean=mean, var=var)))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    node = _the_node(model)
    assert node.attributes.get_float("epsilon") == np.float32(1e-5)
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), g.constants["w"])


def test_sum_of_squares_over_d_minus_1_is_the_unbiased_variance(rng):
    """``sum(d^2) / (H - 1)`` is ``H/(H-1)`` times the variance: epsilon ``eps (H-1)/H``,
    scale ``w sqrt((H-1)/H)`` (the module docstring's scaled variance)."""
    g = Graph()
    normed = _written_layernorm(g, "x", mean=("Div", H), var=("Div", H - 1))
    model = _model(g, _affine(g, rng, normed))
    fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    node = _the_node(model)
    assert node.attributes.get_float("epsilon") == pytest.approx(1e-5 * (H - 1) / H, rel=1e-6)
    scale = g.constants["w"] * np.sqrt((H - 1) / H)
    np.testing.assert_allclose(node.inputs[1].const_value.numpy(), scale, rtol=1e-6)


@pytest.mark.parametrize("mean", [("Div", H - 1), ("Mul", 1 / (H + 1))], ids=["d_minus_1", "mul"])
def test_sum_over_a_wrong_count_is_not_a_mean(mean):
    g = Graph()
    report = assert_refused(
        _model(g, _written_layernorm(g, "x", mean=mean)),
        FuseLayerNorm("onnx"),
        Code.WRONG_MEAN_DIVISOR,
    )
    assert f"over {H} element(s)" in report.refused[0].detail


def test_scaled_reduce_mean_is_not_a_mean():
    g = Graph()
    normed = _written_layernorm(g, "x", mean=("Mul", 0.5, "ReduceMean"))
    assert_refused(_model(g, normed), FuseLayerNorm("onnx"), Code.WRONG_MEAN_DIVISOR)


def test_sum_over_a_symbolic_axis_is_refused():
    """The count a sum is divided by must be read from the shape."""
    g = Graph()
    y = _written_layernorm(g, "x", mean=("Div", H), var=("Div", H))
    model = g.model({"x": (FLOAT, (2, 3, "h"))}, {y: (FLOAT, (2, 3, "h"))})
    assert_refused(model, FuseLayerNorm("onnx"), Code.UNKNOWN_SHAPE)


# No eps (issue 13 item 10): torch.onnx.export's optimizer drops an eps of 1e-8, leaving
# (x - m) / sqrt(var). Fused with epsilon 0, the same function, and the report says so.


@pytest.mark.parametrize("inverse", [False, True], ids=["div", "mul_reciprocal"])
def test_layernorm_with_no_eps_is_fused_with_epsilon_0(rng, inverse):
    g = Graph()
    model = _model(g, _affine(g, rng, _written_layernorm(g, "x", eps=None, inverse=inverse)))
    constant = {"x": np.full(SHAPE, 3.0, np.float32)}
    assert np.isnan(run(model, constant)[0]).all()  # the file's own NaN on a constant row
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    node = _the_node(model)
    assert node.attributes.get_float("epsilon") == 0.0
    assert "epsilon 0" in report.fused[0].became
    (note,) = report.notes
    assert "NaN on a constant row" in note and "optimize=False" in note
    assert np.isnan(run(model, constant)[0]).all()  # ORT's LayerNormalization: NaN too


def test_layernorm_with_eps_reports_no_note(rng):
    g = Graph()
    model = _model(g, _affine(g, rng, _written_layernorm(g, "x")))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert not report.notes and report.fused[0].became == "LayerNormalization"


# Values shared among norms (issue 13 item 6): two LayerNorms of one x with different eps share
# x - mean, the square and the variance (as CSE leaves them). Both fused; a value also read by a
# node that is not fused blocks the norm.


def _two_layernorms(g: Graph, rng, *, second_eps_outside: bool = False) -> ir.Model:
    """Two LayerNorms of ``x`` sharing the centering and the variance ``v``: eps 1e-5 and 1e-3
    (the second with eps outside the square root when ``second_eps_outside``)."""
    d = g.node("Sub", ["x", g.reduce("ReduceMean", "x", "m", (-1,))], "d")
    v = g.reduce("ReduceMean", g.node("Mul", [d, d], "sq"), "v", (-1,))
    first = g.node("Sqrt", [g.node("Add", [v, g.const("eps1", np.float32(1e-5))], "ve1")], "s1")
    if second_eps_outside:
        second = g.node(
            "Add", [g.node("Sqrt", [v], "sd2"), g.const("eps2", np.float32(1e-3))], "s2"
        )
    else:
        second = g.node(
            "Sqrt", [g.node("Add", [v, g.const("eps2", np.float32(1e-3))], "ve2")], "s2"
        )
    outputs = {}
    for k, den in enumerate((first, second)):
        w = g.const(f"w{k}", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
        outputs[g.node("Mul", [g.node("Div", [d, den], f"n{k}"), w], f"y{k}")] = (FLOAT, SHAPE)
    return g.model(IO, outputs)


def test_norms_sharing_their_variance_are_all_fused(rng):
    model = _two_layernorms(Graph(), rng)
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 2 and not report.refused
    assert ops(model) == ["LayerNormalization", "LayerNormalization"]
    epsilons = [n.attributes.get_float("epsilon") for n in model.graph]
    assert epsilons == [np.float32(1e-5), np.float32(1e-3)]


def test_variance_shared_with_a_refused_look_alike_blocks_the_norm(rng):
    model = _two_layernorms(Graph(), rng, second_eps_outside=True)
    before = ir.to_proto(model).SerializeToString()
    fusion_pass = FuseLayerNorm("onnx")
    assert not fusion_pass(model).modified
    assert sorted(fusion_pass.outcomes.codes()) == [Code.EPS_OUTSIDE_SQRT, Code.SHARED_OUTPUT]
    assert "'sd2'" in fusion_pass.outcomes.refused[0].detail
    assert ir.to_proto(model).SerializeToString() == before


def test_no_op_cast_after_the_centering_is_looked_through(rng):
    """ORT's layer_norm_with_cast.onnx: Cast(x - mean, to=float32) of a float32 x, squared."""
    g = Graph()
    d = g.node("Sub", ["x", g.reduce("ReduceMean", "x", "m", (-1,))], "d")
    d32 = g.node("Cast", [d], "d32", to=FLOAT)
    v = g.reduce(
        "ReduceMean", g.node("Pow", [d32, g.const("two", np.float32(2))], "sq"), "v", (-1,)
    )
    den = g.node("Sqrt", [g.node("Add", [v, g.const("eps", np.float32(1e-5))], "ve")], "den")
    model = _model(g, _affine(g, rng, g.node("Div", [d, den], "normed")))
    fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert ops(model) == ["LayerNormalization"]


def test_cast_to_another_type_after_the_centering_is_no_layernorm():
    """Cast(x - mean, float16): the square and variance in float16, another function."""
    g = Graph()
    d = g.node("Sub", ["x", g.reduce("ReduceMean", "x", "m", (-1,))], "d")
    d16 = g.node("Cast", [d], "d16", to=TensorProto.FLOAT16)
    v = g.reduce("ReduceMean", g.node("Mul", [d16, d16], "sq"), "v", (-1,))
    den = g.node("Sqrt", [g.node("Add", [v, g.const("eps", np.float16(1e-5))], "ve")], "den")
    y = g.node("Div", [g.node("Cast", [d], "d16b", to=TensorProto.FLOAT16), den], "y")
    model = g.model(IO, {y: (TensorProto.FLOAT16, SHAPE)})
    fusion_pass = FuseLayerNorm("onnx")
    assert not fusion_pass(model).modified
    assert not fusion_pass.outcomes.codes()  # no LayerNorm candidate at all


# The tutorials' order: g * (x - m) / sqrt(var + eps) + b, the weight before the division.


def _weight_first(g: Graph, w: np.ndarray) -> str:
    d = g.node("Sub", ["x", g.reduce("ReduceMean", "x", "m", (-1,))], "d")
    v = g.reduce("ReduceMean", g.node("Mul", [d, d], "sq"), "v", (-1,))
    den = g.node("Sqrt", [g.node("Add", [v, g.const("eps", np.float32(1e-8))], "ve")], "den")
    weighted = g.node("Mul", [g.const("w", w), d], "weighted")
    return g.node("Div", [weighted, den], "normed")


def test_weight_before_the_division_is_the_scale(rng):
    g = Graph()
    normed = _weight_first(g, (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
    b = g.const("b", rng.standard_normal(H).astype(np.float32))
    model = _model(g, g.node("Add", [normed, b], "y"))
    fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    node = _the_node(model)
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), g.constants["w"])
    np.testing.assert_array_equal(node.inputs[2].const_value.numpy(), g.constants["b"])


def test_weight_before_the_division_along_another_axis_is_refused(rng):
    g = Graph()
    w = (1 + 0.5 * rng.standard_normal((SHAPE[1], 1))).astype(np.float32)
    model = _model(g, _weight_first(g, w))
    assert_refused(model, FuseLayerNorm("onnx"), Code.AXIS_NOT_NORMALIZED)
