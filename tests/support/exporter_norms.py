"""The LayerNorm and RMSNorm spellings of other frameworks' exporters as ONNX graphs, node by
node (no TensorFlow, no JAX), for the norm passes' tests and the spellings their docs list
(:mod:`tests.support.spellings`): tf2onnx's TensorFlow moments (the mean as
``GlobalAveragePool``, ``Sqrt`` + ``Reciprocal``, the weight folded into the inverse and the mean
subtracted after it, batch-norm style), jax2onnx's Flax variance ``max(0, E[x^2] - E[x]^2)``,
jax2tf's means as sums over the count (over a batch of unknown size with ``keepdims=0``,
put back by a Reshape to a target computed at run time), and ``Pow(., -0.5)``. Each function but
:func:`as_model` adds its nodes to a :class:`~tests.support.norm_graphs.Graph` and returns its
output's name; weights are random (``rng``)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from tests.support.norm_graphs import SHAPE, Graph

FLOAT = TensorProto.FLOAT
H = SHAPE[-1]


def as_model(g: Graph, y: str, shape=SHAPE):
    """The model of ``g``: input ``x``, output ``y``, both float32 of ``shape``."""
    return g.model({"x": (FLOAT, shape)}, {y: (FLOAT, shape)})


def affine(g: Graph, rng, name: str, shape=(H,)) -> str:
    """A random weight ``1 + 0.5 N(0, 1)`` of ``shape`` (float32) added to ``g`` as ``name``;
    its name."""
    return g.const(name, (1 + 0.5 * rng.standard_normal(shape)).astype(np.float32))


def tf_moments(g: Graph, x: str, gap: bool = True, var_axes=(-1,)) -> tuple[str, str]:
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


def inverse_root(g: Graph, var: str, eps: float = 1e-3, rsqrt: bool = False) -> str:
    """``1 / sqrt(var + eps)``: Sqrt and Reciprocal, or Pow(., -0.5)."""
    ve = g.node("Add", [var, g.const("eps", np.float32(eps))], "ve")
    if rsqrt:
        return g.node("Pow", [ve, g.const("minus_half", np.float32(-0.5))], "r")
    return g.node("Reciprocal", [g.node("Sqrt", [ve], "std")], "r")


def tf_layernorm(
    g: Graph, rng, *, gamma=True, beta="add", rsqrt=False, mean=None, shift_first=False
) -> str:
    """Keras' LayerNormalization through tf2onnx: ``x * g + (beta - mean * g)``, ``g = r *
    gamma``. ``beta``: ``"add"`` (``Add(Mul(Neg(m), g), beta)``), ``"sub"`` (``Sub(beta,
    Mul(m, g))``) or None; ``mean``: the mean subtracted (default: the variance's);
    ``shift_first``: the shift's nodes come before ``x * g`` in the graph."""
    m, var = tf_moments(g, "x")
    r = inverse_root(g, var, rsqrt=rsqrt)
    scaled = g.node("Mul", [r, affine(g, rng, "gamma", (1, 1, H))], "g") if gamma else r
    if shift_first:
        g.nodes.append(("Mul", [g.node("Neg", [m], "neg_m"), scaled], ["mg"], {}))
        g.nodes.append(("Add", ["mg", affine(g, rng, "beta", (1, 1, H))], ["b"], {}))
        return g.node("Add", [g.node("Mul", ["x", scaled], "xg"), "b"], "y")
    y = g.node("Mul", ["x", scaled], "xg")
    m = mean or m
    if beta == "sub":
        shift = g.node("Sub", [affine(g, rng, "beta"), g.node("Mul", [m, scaled], "mg")], "b")
    else:
        shift = g.node("Mul", [g.node("Neg", [m], "neg_m"), scaled], "mg")
        if beta == "add":
            shift = g.node("Add", [shift, affine(g, rng, "beta", (1, 1, H))], "b")
    return g.node("Add", [y, shift], "y")


def flax_layernorm(g: Graph, rng, clip: str | None = "Max", mean_axes=(-1,), center_axes=(-1,)):
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
    scaled = g.node("Mul", [normed, affine(g, rng, "scale")], "ns")
    return g.node("Add", [scaled, affine(g, rng, "bias")], "y")


# jax2tf then tf2onnx (issue 61): Flax's LayerNorm with each mean a ReduceSum divided by the
# count (jnp.mean is lax.reduce_sum then lax.div), the clamp jnp.maximum(0.0, var) as Max with
# the constant first, the rsqrt as Sqrt + Reciprocal, the scale folded into it.


def jax_mean(g: Graph, value: str, out: str, spelling: str, count: float = H) -> str:
    """``sum(value) / count`` over the last axis: ``"div"`` (``Div`` by the count) or ``"mul"``
    (``Mul`` by its inverse)."""
    total = g.reduce("ReduceSum", value, f"{out}_sum", (-1,))
    if spelling == "div":
        return g.node("Div", [total, g.const(f"{out}_n", np.float32(count))], out)
    return g.node("Mul", [g.const(f"{out}_inv", np.float32(1 / count)), total], out)


def clamp_below(g: Graph, var: str, clamp: str | None, at: float = 0.0) -> str:
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


def jax2tf_layernorm(
    g: Graph, rng, *, mean="div", square="div", clamp="max_first", at=0.0, count=H
) -> str:
    """Flax's ``nnx.LayerNorm`` through jax2tf and tf2onnx: ``(x - m) * (Reciprocal(Sqrt(
    max(0, E[x^2] - m^2) + eps)) * scale) + bias``, ``m = sum(x) / N`` (``mean``),
    ``E[x^2] = sum(x * x) / N`` (``square``), ``count`` the N written into the mean."""
    m = jax_mean(g, "x", "m", mean, count)
    ex2 = jax_mean(g, g.node("Mul", ["x", "x"], "xx"), "ex2", square)
    var = clamp_below(g, g.node("Sub", [ex2, g.node("Mul", [m, m], "mm")], "var0"), clamp, at)
    r = inverse_root(g, var, eps=1e-6)
    scaled = g.node("Mul", [r, affine(g, rng, "scale", (1, 1, H))], "g")
    y = g.node("Mul", [g.node("Sub", ["x", m], "c"), scaled], "xg")
    return g.node("Add", [y, affine(g, rng, "bias", (1, 1, H))], "y")


# jax2tf then tf2onnx over a batch of unknown size (Google's magika 1.0.3, tf2onnx 1.16.1): the
# sums keep no axes, and each statistic is put back by a Reshape to a target computed at run
# time from the shape of the model's input, after the clamp.


def runtime_target(g: Graph, source: str, leading: int = 1, flipped: bool = False) -> str:
    """``Cast(Concat(Slice(Cast(Shape(source), int32), 0, leading), [1]), int64)``: the first
    ``leading`` sizes of ``source`` then 1, as tf2onnx computes a Reshape's target; with
    ``flipped``, 1 first."""
    sizes = g.node("Cast", [g.node("Shape", [source], "t_shape")], "t_shape32", to=6)
    zero = g.const("t_zero", np.array([0], np.int64))
    end = g.const("t_end", np.array([leading], np.int64))
    lead = g.node("Slice", [sizes, zero, end, zero], "t_lead")
    one = g.const("t_one", np.array([1], np.int32))
    parts = [one, lead] if flipped else [lead, one]
    return g.node("Cast", [g.node("Concat", parts, "t_concat", axis=0)], "t", to=7)


def jax2tf_rows_layernorm(
    g: Graph, rng, *, source="input", leading=1, expand=False, flipped=False
) -> str:
    """Flax's ``nnx.LayerNorm`` over the last axis of ``x = inp + c`` (``inp`` the model's
    input, of ``leading`` axes before ``H``) through jax2tf and tf2onnx for a batch of unknown
    size: ``m = ReduceSum(x, keepdims=0) * (1/N)``, likewise ``E[x^2]``, ``var = Reshape(Max(0,
    E[x^2] - m * m), T)``, ``(x - Reshape(m, T)) * (Reciprocal(Sqrt(var + eps)) * scale) +
    bias``; ``T`` :func:`runtime_target` of ``source`` (``"input"``, or ``"x"``; ``"constant"``:
    ``[-1, ..., 1]``), each Reshape
    followed by ``Expand(., T)`` with ``expand``."""
    x = g.node("Add", ["inp", g.const("shift", np.float32(0.25))], "x")
    if source == "constant":  # a constant target, -1 for the batch
        t = g.const("t", np.array([-1, *(3,) * (leading - 1), 1], np.int64))
    else:
        t = runtime_target(g, "inp" if source == "input" else x, leading, flipped)
    inv = g.const("inv_n", np.float32(1 / H))

    def mean(value: str, out: str) -> str:
        return g.node("Mul", [g.reduce("ReduceSum", value, f"{out}_sum", (-1,), 0), inv], out)

    def back(value: str, out: str) -> str:
        value = g.node("Reshape", [value, t], out if not expand else f"{out}_r")
        return g.node("Expand", [value, t], out) if expand else value

    m = mean(x, "m")
    ex2 = mean(g.node("Mul", [x, x], "xx"), "ex2")
    var = g.node("Sub", [ex2, g.node("Mul", [m, m], "mm")], "var0")
    var = back(g.node("Max", [g.const("zero", np.float32(0)), var], "var1"), "var")
    r = inverse_root(g, var, eps=1e-6)
    scaled = g.node("Mul", [r, affine(g, rng, "scale", (1, H))], "g")
    y = g.node("Mul", [g.node("Sub", [x, back(m, "m_kept")], "c"), scaled], "xg")
    return g.node("Add", [y, affine(g, rng, "bias", (1, H))], "y")


def rows_model(g: Graph, y: str, leading: int = 1):
    """The model of ``g`` built by :func:`jax2tf_rows_layernorm`: input ``inp``, output ``y``,
    both float32 of a symbolic ``batch``, ``leading - 1`` more axes of 3, then ``H``."""
    shape = ("batch", *(3,) * (leading - 1), H)
    return g.model({"inp": (FLOAT, shape)}, {y: (FLOAT, shape)})
