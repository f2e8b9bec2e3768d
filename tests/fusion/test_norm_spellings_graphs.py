"""The LayerNorm and RMSNorm spellings of other frameworks' exporters, node by node (no
PyTorch, no TensorFlow, no JAX): tf2onnx's TensorFlow moments (the mean as
``GlobalAveragePool``, ``Sqrt`` + ``Reciprocal``, the weight folded into the inverse and the
mean subtracted after it, batch-norm style), jax2onnx's Flax variance ``max(0, E[x^2] -
E[x]^2)``, and ``Pow(., -0.5)``. Each fused graph runs on ONNX Runtime before and after the pass
(random inputs, randomized weight and bias); each look-alike is refused by its code, the graph
left as it was. The exporters' own files: the main command's tests, ``test_exporter_files.py``."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from fusion import Code
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_rmsnorm import FuseRMSNorm
from tests.support.norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare

FLOAT = TensorProto.FLOAT
H = SHAPE[-1]


def _model(g: Graph, y: str, shape=SHAPE):
    return g.model({"x": (FLOAT, shape)}, {y: (FLOAT, shape)})


def _affine(g: Graph, rng, name: str, shape=(H,)) -> str:
    return g.const(name, (1 + 0.5 * rng.standard_normal(shape)).astype(np.float32))


def _tf_moments(g: Graph, x: str, gap: bool = True, var_axes=(-1,)) -> tuple[str, str]:
    """TensorFlow's ``tf.nn.moments`` as tf2onnx writes it: ``(mean, variance)``, the means
    as ``GlobalAveragePool`` (or ReduceMean over ``var_axes``), the square of ``x - mean`` as
    ``Mul`` (SquaredDifference)."""
    mean = (
        g.node("GlobalAveragePool", [x], "mean")
        if gap
        else g.reduce("ReduceMean", x, "mean", (-1,))
    )
    d = g.node("Sub", [x, mean], "d")
    sq = g.node("Mul", [d, d], "sq")
    if gap and tuple(var_axes) == (-1,):
        return mean, g.node("GlobalAveragePool", [sq], "var")
    return mean, g.reduce("ReduceMean", sq, "var", var_axes)


def _inverse_root(g: Graph, var: str, eps: float = 1e-3, rsqrt: bool = False) -> str:
    """``1 / sqrt(var + eps)``: Sqrt and Reciprocal, or Pow(., -0.5)."""
    ve = g.node("Add", [var, g.const("eps", np.float32(eps))], "ve")
    if rsqrt:
        return g.node("Pow", [ve, g.const("minus_half", np.float32(-0.5))], "r")
    return g.node("Reciprocal", [g.node("Sqrt", [ve], "std")], "r")


def _tf_layernorm(
    g: Graph, rng, *, gamma=True, beta="add", rsqrt=False, mean=None, shift_first=False
) -> str:
    """Keras' LayerNormalization through tf2onnx: ``x * g + (beta - mean * g)``, ``g = r *
    gamma``. ``beta``: ``"add"`` (``Add(Mul(Neg(m), g), beta)``), ``"sub"`` (``Sub(beta,
    Mul(m, g))``) or None; ``mean``: the mean subtracted (default: the variance's);
    ``shift_first``: the shift's nodes come before ``x * g`` in the graph."""
    m, var = _tf_moments(g, "x")
    r = _inverse_root(g, var, rsqrt=rsqrt)
    scaled = g.node("Mul", [r, _affine(g, rng, "gamma", (1, 1, H))], "g") if gamma else r
    if shift_first:
        g.nodes.append(("Mul", [g.node("Neg", [m], "neg_m"), scaled], ["mg"], {}))
        g.nodes.append(("Add", ["mg", _affine(g, rng, "beta", (1, 1, H))], ["b"], {}))
        return g.node("Add", [g.node("Mul", ["x", scaled], "xg"), "b"], "y")
    y = g.node("Mul", ["x", scaled], "xg")
    m = mean or m
    if beta == "sub":
        shift = g.node("Sub", [_affine(g, rng, "beta"), g.node("Mul", [m, scaled], "mg")], "b")
    else:
        shift = g.node("Mul", [g.node("Neg", [m], "neg_m"), scaled], "mg")
        if beta == "add":
            shift = g.node("Add", [shift, _affine(g, rng, "beta", (1, 1, H))], "b")
    return g.node("Add", [y, shift], "y")


@pytest.mark.parametrize(
    "form",
    [
        {},
        {"gamma": False},
        {"beta": "sub"},
        {"beta": None},
        {"rsqrt": True},
        {"shift_first": True},
    ],
    ids=["keras", "no_gamma", "beta_minus", "no_beta", "rsqrt", "shift_first"],
)
def test_tensorflow_layernorm_is_fused(rng, form):
    g = Graph()
    model = _model(g, _tf_layernorm(g, rng, **form))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    (node,) = model.graph
    assert node.op_type == "LayerNormalization" and node.attributes.get_int("axis") == -1
    assert node.attributes.get_float("epsilon") == np.float32(1e-3)
    assert len(node.inputs) == (3 if form.get("beta", "add") else 2)


def test_a_global_average_pool_over_two_trailing_axes_is_a_norm_over_both(rng):
    """``GlobalAveragePool`` of a 4-D tensor is the mean over its last two axes: axis -2."""
    g = Graph()
    shape = (2, 3, 4, 5)
    m, var = _tf_moments(g, "x")
    r = _inverse_root(g, var)
    y = g.node("Mul", [g.node("Sub", ["x", m], "d2"), r], "y")
    model = _model(g, y, shape)
    fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    (node,) = model.graph
    assert node.attributes.get_int("axis") == -2


def test_a_shift_by_another_tensors_mean_is_refused(rng):
    """``x * g + beta - m' * g`` where ``m'`` is not the mean the variance centers with."""
    g = Graph()
    other = g.reduce("ReduceMean", "x", "other_mean", (-2,))
    model = _model(g, _tf_layernorm(g, rng, mean=other))
    assert_refused(model, FuseLayerNorm("onnx"), Code.WRONG_NUMERATOR)


def test_a_mean_over_axes_the_variance_is_not_taken_over_is_refused(rng):
    g = Graph()
    m, var = _tf_moments(g, "x", gap=False, var_axes=(-2, -1))
    y = g.node("Mul", [g.node("Sub", ["x", m], "d2"), _inverse_root(g, var)], "y")
    assert_refused(_model(g, y), FuseLayerNorm("onnx"), Code.DIFFERENT_AXES)


def test_tensorflow_rmsnorm_is_fused(rng):
    """Keras' RMSNormalization through tf2onnx: ``x * (Reciprocal(Sqrt(GAP(x * x) + eps)) *
    scale)``."""
    g = Graph()
    ms = g.node("GlobalAveragePool", [g.node("Mul", ["x", "x"], "sq")], "ms")
    scaled = g.node("Mul", [_inverse_root(g, ms, eps=1e-6), _affine(g, rng, "scale")], "g")
    model = _model(g, g.node("Mul", ["x", scaled], "y"))
    report = fuse_and_compare(model, FuseRMSNorm("ort"), rng)
    assert report.counts["rmsnorm_fused"] == 1
    (node,) = model.graph
    assert node.op_type == "SimplifiedLayerNormalization"


def _flax_layernorm(g: Graph, rng, clip: str | None = "Max", mean_axes=(-1,), center_axes=(-1,)):
    """Flax's LayerNorm (``use_fast_variance``) as jax2onnx writes it: ``(x - m) /
    sqrt(max(0, E[x^2] - m^2) + eps) * scale + bias``."""
    m = g.reduce("ReduceMean", "x", "m", mean_axes)
    c = (
        m
        if tuple(center_axes) == tuple(mean_axes)
        else g.reduce("ReduceMean", "x", "m2", center_axes)
    )
    centered = g.node("Sub", ["x", c], "c")
    ex2 = g.reduce("ReduceMean", g.node("Mul", ["x", "x"], "xx"), "ex2", (-1,))
    var = g.node("Sub", [ex2, g.node("Mul", [m, m], "mm")], "var0")
    zero = g.const("zero", np.float32(0))
    if clip == "Max":
        var = g.node("Max", [var, zero], "var")
    elif clip == "Clip":
        var = g.node("Clip", [var, zero], "var")
    den = g.node("Sqrt", [g.node("Add", [var, g.const("eps", np.float32(1e-6))], "ve")], "std")
    normed = g.node("Div", [centered, den], "n")
    scaled = g.node("Mul", [normed, _affine(g, rng, "scale")], "ns")
    return g.node("Add", [scaled, _affine(g, rng, "bias")], "y")


@pytest.mark.parametrize("clip", ["Max", "Clip", None])
def test_flax_layernorm_from_the_moments_is_fused(rng, clip):
    g = Graph()
    model = _model(g, _flax_layernorm(g, rng, clip))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1
    (node,) = model.graph
    assert [v.name for v in node.inputs][1:] and node.attributes.get_int("axis") == -1


@pytest.mark.parametrize(
    "axes", [{"mean_axes": (-2, -1)}, {"center_axes": (-2, -1)}], ids=["mean", "center"]
)
def test_moments_over_other_axes_are_refused(rng, axes):
    """``E[x]`` (in the variance, or the one the numerator subtracts) over an axis the mean
    square is not taken over: not a LayerNorm."""
    g = Graph()
    model = _model(g, _flax_layernorm(g, rng, **axes))
    report = FuseLayerNorm("onnx")
    if "mean_axes" in axes:  # E[x^2] - E[x]^2 over different axes is no variance at all
        before = len(list(model.graph))
        assert not report(model).modified and len(list(model.graph)) == before
        assert report.outcomes.codes() in ([], [Code.DIFFERENT_AXES])
    else:
        assert_refused(model, report, Code.DIFFERENT_AXES)


def test_moments_are_no_rmsnorm(rng):
    """The variance from the moments never becomes an RMSNorm of ``x``: it is centered."""
    g = Graph()
    model = _model(g, _flax_layernorm(g, rng))
    assert not FuseRMSNorm("ort")(model).modified


# jax2tf then tf2onnx (issue 61): Flax's LayerNorm with each mean a ReduceSum divided by the
# count (jnp.mean is lax.reduce_sum then lax.div), the clamp jnp.maximum(0.0, var) as Max with
# the constant first, the rsqrt as Sqrt + Reciprocal, the scale folded into it.


def _jax_mean(g: Graph, value: str, out: str, spelling: str, count: float = H) -> str:
    """``sum(value) / count`` over the last axis: ``"div"`` (``Div`` by the count) or ``"mul"``
    (``Mul`` by its inverse)."""
    total = g.reduce("ReduceSum", value, f"{out}_sum", (-1,))
    if spelling == "div":
        return g.node("Div", [total, g.const(f"{out}_n", np.float32(count))], out)
    return g.node("Mul", [g.const(f"{out}_inv", np.float32(1 / count)), total], out)


def _clamp(g: Graph, var: str, clamp: str | None, at: float = 0.0) -> str:
    """``var`` clamped from below at ``at``, as ``clamp`` says."""
    zero = np.float32(at)
    if clamp == "max_first":
        return g.node("Max", [g.const("zero", zero), var], "var")
    if clamp == "max_last":
        return g.node("Max", [var, g.const("zero", zero)], "var")
    if clamp == "relu":
        return g.node("Relu", [var], "var")
    if clamp == "full":  # the scalar broadcast to the variance's shape, folded
        return g.node("Max", [g.const("zero", np.full((*SHAPE[:-1], 1), zero)), var], "var")
    if clamp == "expand":  # the scalar broadcast by an Expand tf2onnx did not fold
        shape = g.const("var_shape", np.array([*SHAPE[:-1], 1], np.int64))
        zeros = g.node("Expand", [g.const("zero", zero), shape], "zeros")
        return g.node("Max", [zeros, var], "var")
    return var


def _jax2tf_layernorm(
    g: Graph, rng, *, mean="div", square="div", clamp="max_first", at=0.0, count=H
) -> str:
    """Flax's ``nnx.LayerNorm`` through jax2tf and tf2onnx: ``(x - m) * (Reciprocal(Sqrt(
    max(0, E[x^2] - m^2) + eps)) * scale) + bias``, ``m = sum(x) / N`` (``mean``),
    ``E[x^2] = sum(x * x) / N`` (``square``), ``count`` the N written into the mean."""
    m = _jax_mean(g, "x", "m", mean, count)
    ex2 = _jax_mean(g, g.node("Mul", ["x", "x"], "xx"), "ex2", square)
    var = _clamp(g, g.node("Sub", [ex2, g.node("Mul", [m, m], "mm")], "var0"), clamp, at)
    r = _inverse_root(g, var, eps=1e-6)
    scaled = g.node("Mul", [r, _affine(g, rng, "scale", (1, 1, H))], "g")
    y = g.node("Mul", [g.node("Sub", ["x", m], "c"), scaled], "xg")
    return g.node("Add", [y, _affine(g, rng, "bias", (1, 1, H))], "y")


@pytest.mark.parametrize("square", ["div", "mul"])
@pytest.mark.parametrize("mean", ["div", "mul"])
def test_jax2tf_layernorm_with_sums_over_the_count_is_fused(rng, mean, square):
    g = Graph()
    model = _model(g, _jax2tf_layernorm(g, rng, mean=mean, square=square))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    assert [n.op_type for n in model.graph] == ["LayerNormalization"]
    (node,) = model.graph
    assert node.attributes.get_float("epsilon") == np.float32(1e-6)
    assert len(node.inputs) == 3


@pytest.mark.parametrize("clamp", ["max_first", "max_last", "relu", "full", "expand", None])
def test_the_clamp_at_zero_goes_wherever_it_is_written(rng, clamp):
    """``max(0, E[x^2] - E[x]^2)`` in each spelling: the fused op's variance is never
    negative, so the clamp is implied."""
    g = Graph()
    model = _model(g, _jax2tf_layernorm(g, rng, clamp=clamp))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    assert "LayerNormalization" in [n.op_type for n in model.graph]
    assert not {"Max", "Relu", "Sub"} & {n.op_type for n in model.graph}


@pytest.mark.parametrize(
    "form",
    [
        ({"count": H - 1}, Code.WRONG_MEAN_DIVISOR),
        ({"count": H - 1, "mean": "mul"}, Code.WRONG_MEAN_DIVISOR),
        ({"at": 0.1}, Code.CLAMP_NOT_ZERO),
        ({"at": 0.1, "clamp": "full"}, Code.CLAMP_NOT_ZERO),
    ],
    ids=["div_by_n_minus_1", "mul_by_1_over_n_minus_1", "clamp_at_0.1", "full_clamp_at_0.1"],
)
def test_sums_not_over_the_count_and_clamps_not_at_zero_are_refused(rng, form):
    g = Graph()
    model = _model(g, _jax2tf_layernorm(g, rng, **form[0]))
    assert_refused(model, FuseLayerNorm("onnx"), form[1])


def test_a_mean_square_not_over_the_count_is_refused(rng):
    """``E[x^2]`` written as ``sum(x * x) / (N - 1)``: ``E[x^2] * f - E[x]^2`` is no variance,
    scaled or not."""
    g = Graph()
    m = _jax_mean(g, "x", "m", "div")
    ex2 = _jax_mean(g, g.node("Mul", ["x", "x"], "xx"), "ex2", "div", H - 1)
    var = g.node("Sub", [ex2, g.node("Mul", [m, m], "mm")], "var")
    y = g.node("Mul", [g.node("Sub", ["x", m], "c"), _inverse_root(g, var)], "y")
    assert_refused(_model(g, y), FuseLayerNorm("onnx"), Code.WRONG_MEAN_DIVISOR)
