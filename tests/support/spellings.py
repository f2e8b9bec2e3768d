"""The spellings the passes' docs list, each built as an ONNX graph node by node (no PyTorch).

Each pass's doc (docs/fusions/<module>.md) ends with "Spellings held by a test": a table whose rows
name a builder of this module as a call with literal keywords (``layernorm(square="mul")``). A
builder takes a seeded generator and returns the model of one candidate of that spelling, float32,
every weight, bias and BatchNorm statistic random; ``tests/fusion/test_spellings_listed.py`` calls
it with the row's keywords, runs :func:`fusion.optimize` for the row's target and checks that the
pass fused it, with the same outputs on ONNX Runtime. The pieces other frameworks' exporters write
are in :mod:`tests.support.exporter_norms`, the re-parameterizable blocks in
:mod:`tests.support.reparam_graphs`; GELU's pieces are here (``erf_part``, ``tanh_part``,
``gelu_product``), shared with FuseGelu's tests.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from tests.support import exporter_norms as exporters
from tests.support import norm_graphs
from tests.support.attention_graphs import yolo_attention
from tests.support.graphs import make_model
from tests.support.norm_graphs import SHAPE, Graph
from tests.support.reparam_graphs import MERGED, Block, C

FLOAT = TensorProto.FLOAT
#: A feature map (N, C, H, W): the input of the per-channel and per-group norms.
MAP = (2, 6, 4, 5)
#: The groups of :func:`groupnorm`.
GROUPS = 3


def _random(rng: np.random.Generator, shape, centre: float = 0.0) -> np.ndarray:
    """``centre + 0.5 N(0, 1)`` of ``shape``, float32: a weight (centre 1) or a bias (0)."""
    return (centre + 0.5 * rng.standard_normal(shape)).astype(np.float32)


def _scale_and_shift(g: Graph, rng: np.random.Generator, y: str, shape) -> str:
    """``y * w + b``, ``w`` and ``b`` random of ``shape``; the output's name."""
    w = g.const("w", _random(rng, shape, 1.0))
    return g.node("Add", [g.node("Mul", [y, w], "scaled"), g.const("b", _random(rng, shape))], "y")


def _divide(g: Graph, n: str, den: str, divide: str) -> str:
    """``n / den`` as ``divide`` says: ``"div"`` (Div), ``"reciprocal"`` (Mul by Reciprocal),
    ``"one_over"`` (Mul by Div(1, den))."""
    if divide == "div":
        return g.node("Div", [n, den], "normed")
    if divide == "reciprocal":
        return g.node("Mul", [n, g.node("Reciprocal", [den], "inv")], "normed")
    inverse = g.node("Div", [g.const("one", np.float32(1)), den], "inv")
    return g.node("Mul", [n, inverse], "normed")


def _square(g: Graph, x: str, square: str) -> str:
    """``x^2`` as ``Pow(x, 2)`` (``"pow"``) or ``Mul(x, x)`` (``"mul"``)."""
    if square == "pow":
        return g.node("Pow", [x, g.const("two", np.float32(2))], "sq")
    return g.node("Mul", [x, x], "sq")


def layernorm(
    rng: np.random.Generator,
    *,
    axes=(-1,),
    square: str = "pow",
    variance: str = "mean",
    divide: str = "div",
    weight_first: bool = False,
) -> ir.Model:
    """``(x - m) / sqrt(var + 1e-5) * w + b`` over ``axes`` of ``x`` :data:`SHAPE`: the square
    ``"pow"`` or ``"mul"``; the variance ``"mean"`` (ReduceMean), ``"unbiased"`` (times
    ``N / (N - 1)``, torch's ``x.var()``) or ``"sum"`` (ReduceSum over N); ``divide`` as
    :func:`_divide`; ``weight_first``: ``w * (x - m) / sqrt(var + eps) + b``."""
    g = Graph()
    d = g.node("Sub", ["x", g.reduce("ReduceMean", "x", "mean", axes)], "d")
    n = int(np.prod([SHAPE[a] for a in axes]))
    if variance == "sum":
        total = g.reduce("ReduceSum", _square(g, d, square), "total", axes)
        var = g.node("Div", [total, g.const("count", np.float32(n))], "var")
    else:
        var = g.reduce("ReduceMean", _square(g, d, square), "var", axes)
    if variance == "unbiased":
        var = g.node("Mul", [var, g.const("bessel", np.float32(n / (n - 1)))], "var_u")
    eps = g.const("eps", np.float32(1e-5))
    den = g.node("Sqrt", [g.node("Add", [var, eps], "var_eps")], "den")
    shape = SHAPE[len(SHAPE) + min(axes) :]
    if weight_first:
        w = g.const("w", _random(rng, shape, 1.0))
        normed = _divide(g, g.node("Mul", [w, d], "wd"), den, divide)
        y = g.node("Add", [normed, g.const("b", _random(rng, shape))], "y")
    else:
        y = _scale_and_shift(g, rng, _divide(g, d, den, divide), shape)
    return g.model({"x": (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE)})


def keras_layernorm(rng: np.random.Generator, **form) -> ir.Model:
    """Keras' LayerNormalization as tf2onnx writes it (:func:`exporter_norms.tf_layernorm`,
    ``form`` its keywords)."""
    g = Graph()
    return exporters.as_model(g, exporters.tf_layernorm(g, rng, **form))


def flax_layernorm(rng: np.random.Generator, clip: str | None = "Max") -> ir.Model:
    """Flax's LayerNorm from the moments as jax2onnx writes it, the clamp at 0 ``clip``."""
    g = Graph()
    return exporters.as_model(g, exporters.flax_layernorm(g, rng, clip))


def jax2tf_layernorm(rng: np.random.Generator, **form) -> ir.Model:
    """Flax's LayerNorm through jax2tf and tf2onnx, each mean a sum over the count
    (:func:`exporter_norms.jax2tf_layernorm`, ``form`` its keywords)."""
    g = Graph()
    return exporters.as_model(g, exporters.jax2tf_layernorm(g, rng, **form))


def jax2tf_rows_layernorm(rng: np.random.Generator, **form) -> ir.Model:
    """Flax's LayerNorm through jax2tf and tf2onnx over a batch of unknown size, each statistic
    put back by a Reshape to a target computed at run time
    (:func:`exporter_norms.jax2tf_rows_layernorm`, ``form`` its keywords)."""
    g = Graph()
    leading = form.get("leading", 1)
    return exporters.rows_model(g, exporters.jax2tf_rows_layernorm(g, rng, **form), leading)


def rmsnorm(
    rng: np.random.Generator,
    *,
    square: str = "pow",
    divide: str = "reciprocal",
    weight: bool = True,
    opset: int = 18,
) -> ir.Model:
    """LLaMA's RMSNorm ``x / sqrt(mean(x^2) + 1e-6) * w`` over the last axis of ``x``
    :data:`SHAPE`: the square ``"pow"`` or ``"mul"``; ``divide`` as :func:`_divide`, or
    ``"rsqrt"`` (Mul by ``Pow(., -0.5)``); no weight where ``weight`` is False."""
    g = Graph(opset)
    ms = g.reduce("ReduceMean", _square(g, "x", square), "ms", (-1,))
    ms_eps = g.node("Add", [ms, g.const("eps", np.float32(1e-6))], "ms_eps")
    if divide == "rsqrt":
        r = g.node("Pow", [ms_eps, g.const("minus_half", np.float32(-0.5))], "r")
        y = g.node("Mul", ["x", r], "normed")
    else:
        y = _divide(g, "x", g.node("Sqrt", [ms_eps], "den"), divide)
    if weight:
        y = g.node("Mul", [y, g.const("w", _random(rng, SHAPE[-1:], 1.0))], "y")
    return g.model({"x": (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE)})


def keras_rmsnorm(rng: np.random.Generator) -> ir.Model:
    """Keras' RMSNormalization through tf2onnx: ``x * (Reciprocal(Sqrt(GAP(x * x) + eps)) *
    scale)``."""
    g = Graph()
    ms = g.node("GlobalAveragePool", [g.node("Mul", ["x", "x"], "sq")], "ms")
    r = exporters.inverse_root(g, ms, eps=1e-6)
    scaled = g.node("Mul", [r, exporters.affine(g, rng, "scale")], "g")
    return exporters.as_model(g, g.node("Mul", ["x", scaled], "y"))


def instancenorm(rng: np.random.Generator, *, bias: bool = True) -> ir.Model:
    """The "CNN LayerNorm": a norm over the spatial axes of ``x`` :data:`MAP`, then a
    per-channel weight (1, C, 1, 1) and, with ``bias``, a per-channel bias."""
    g = Graph()
    normed = norm_graphs.layernorm(g, "x", axes=(2, 3))
    shape = (1, MAP[1], 1, 1)
    if bias:
        y = _scale_and_shift(g, rng, normed, shape)
    else:
        y = g.node("Mul", [normed, g.const("w", _random(rng, shape, 1.0))], "y")
    return g.model({"x": (FLOAT, MAP)}, {y: (FLOAT, MAP)})


def groupnorm(rng: np.random.Generator, *, view=(0, GROUPS, -1)) -> ir.Model:
    """A hand-written GroupNorm of ``x`` :data:`MAP`: ``x.reshape(view)``, a norm over the axes
    after the group axis, the reshape back, a weight and bias per channel (C, 1, 1)."""
    g = Graph()
    v = g.node("Reshape", ["x", g.const("groups", np.array(view, np.int64))], "view")
    normed = norm_graphs.layernorm(g, v, axes=tuple(range(2, len(view))))
    back = g.node("Reshape", [normed, g.const("shape", np.array(MAP, np.int64))], "back")
    y = _scale_and_shift(g, rng, back, (MAP[1], 1, 1))
    return g.model({"x": (FLOAT, MAP)}, {y: (FLOAT, MAP)})


def groupnormalization(rng: np.random.Generator) -> ir.Model:
    """ONNX's GroupNormalization-21 (scale and bias per channel), as the dynamo exporter
    writes ``nn.GroupNorm`` from opset 21, of ``x`` :data:`MAP`."""
    g = Graph(21)
    names = [g.const("scale", _random(rng, MAP[1], 1.0)), g.const("bias", _random(rng, MAP[1]))]
    g.node("GroupNormalization", ["x", *names], "y", num_groups=GROUPS, epsilon=1e-5)
    return g.model({"x": (FLOAT, MAP)}, {"y": (FLOAT, MAP)})


def layernorm_cf(rng: np.random.Generator, *, batch: int = 1, to_last: bool = False) -> ir.Model:
    """ConvNeXt's channels-first LayerNorm of ``x`` (``batch``, C, H, W): the norm over axis 1,
    a weight and bias per channel (C, 1, 1); ``to_last``: its result moved channels-last by a
    Transpose."""
    g = Graph()
    shape = (batch, *MAP[1:])
    y = _scale_and_shift(g, rng, norm_graphs.layernorm(g, "x", axes=(1,)), (MAP[1], 1, 1))
    if to_last:
        y = g.node("Transpose", [y], "y_last", perm=[0, 2, 3, 1])
        return g.model({"x": (FLOAT, shape)}, {y: (FLOAT, (batch, *MAP[2:], MAP[1]))})
    return g.model({"x": (FLOAT, shape)}, {y: (FLOAT, shape)})


def erf_part(g: Graph, x: str, divide: bool = True, constant: float | None = None) -> str:
    """``erf(x / sqrt 2)``, as a Div (PyTorch, Paddle) or a Mul by ``1/sqrt 2`` (tf2onnx)."""
    if divide:
        c = g.const("sqrt2", np.float32(constant or math.sqrt(2)))
        return g.node("Erf", [g.node("Div", [x, c], "u")], "f")
    c = g.const("inv_sqrt2", np.float32(constant or 1 / math.sqrt(2)))
    return g.node("Erf", [g.node("Mul", [x, c], "u")], "f")


def tanh_part(g: Graph, x: str, cube: str = "pow", cubic: float = 0.044715) -> str:
    """``tanh(sqrt(2/pi) * (x + 0.044715 x^3))``, the cubic term ``cube``: ``"pow"``
    (``Mul(c, Pow(x, 3))``), ``"mul"`` (``Mul(c, Mul(Mul(x, x), x))``) or ``"jax"`` (jax2tf then
    tf2onnx: ``Mul(x, Mul(x, Mul(c, x)))``, the coefficient multiplied into ``x`` first)."""
    c3 = g.const("cubic", np.float32(cubic))
    if cube == "jax":
        term = g.node("Mul", [x, g.node("Mul", [x, g.node("Mul", [c3, x], "cx")], "cxx")], "term")
    else:
        if cube == "pow":
            cubed = g.node("Pow", [x, g.const("three", np.float32(3))], "cube")
        else:
            cubed = g.node("Mul", [g.node("Mul", [x, x], "sq"), x], "cube")
        term = g.node("Mul", [c3, cubed], "term")
    inner = g.node("Add", [x, term], "inner")
    c = g.const("c", np.float32(math.sqrt(2 / math.pi)))
    return g.node("Tanh", [g.node("Mul", [c, inner], "arg")], "f")


def gelu_product(g: Graph, x: str, f: str, association: str) -> str:
    """``0.5 * x * (1 + f)`` in one of the associations the exporters write."""
    t = g.node("Add", [g.const("one", np.float32(1)), f], "t")
    half = g.const("half", np.float32(0.5))
    if association == "x_times_half_t":  # PyTorch's dynamo export, onnxscript's patterns
        return g.node("Mul", ["x" if x == "x" else x, g.node("Mul", [half, t], "ht")], "y")
    if association == "half_x_times_t":  # tf2onnx
        return g.node("Mul", [g.node("Mul", [half, x], "hx"), t], "y")
    if association == "x_t_times_half":
        return g.node("Mul", [g.node("Mul", [x, t], "xt"), half], "y")
    two = g.const("two", np.float32(2))  # Paddle: (x * (1 + f)) / 2
    return g.node("Div", [g.node("Mul", [x, t], "xt"), two], "y")


def gelu(
    rng: np.random.Generator,
    *,
    form: str = "erf_div",
    association: str = "x_times_half_t",
    bias: bool = False,
) -> ir.Model:
    """GELU of ``x`` :data:`SHAPE`, opset 20: ``form`` ``"erf_div"``, ``"erf_mul"`` (the erf
    of ``x`` divided by or times a constant), ``"tanh_pow"``, ``"tanh_mul"`` or ``"tanh_jax"``
    (the tanh form, the cubic term as :func:`tanh_part`'s ``cube``), times ``x`` and one half
    in ``association`` (:func:`gelu_product`); with ``bias``, ``x`` is ``v + b``, a
    projection's 1-D bias."""
    g = Graph(opset=20)
    x, inputs = "x", "x"
    if bias:
        b = g.const("bias", _random(rng, SHAPE[-1:]))
        x, inputs = g.node("Add", ["v", b], "x"), "v"
    kind, how = form.split("_")
    f = erf_part(g, x, how == "div") if kind == "erf" else tanh_part(g, x, how)
    y = gelu_product(g, x, f, association)
    return g.model({inputs: (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE)})


def _per_channel(b: Block, centre: float = 0.0) -> str:
    """A random per-channel constant (C, 1, 1) of ``b``: ``centre + 0.5 N(0, 1)``."""
    return b.const(centre + 0.5 * b.rng.standard_normal((C, 1, 1)))


def conv_batchnorm(rng: np.random.Generator, *, layer: str = "Conv", bn: str = "op") -> ir.Model:
    """A layer of the feature map ``x`` (2, C, 7, 7) then a BatchNorm: ``layer`` ``"Conv"``
    (3x3) or ``"ConvTranspose"`` (3x3, stride 1); ``bn`` ``"op"`` (BatchNormalization),
    ``"hand"`` (``(y - mean) / sqrt(var + eps) * gamma + beta``, each a constant op) or
    ``"frozen"`` (torchvision's FrozenBatchNorm2d, ``y * scale + shift``)."""
    b = Block(rng)
    if layer == "Conv":
        y = b.conv("x", 3)
    else:
        w = b.const(rng.standard_normal((C, C, 3, 3)) / 3)
        y = b.op("ConvTranspose", "x", w, b.const(rng.standard_normal(C)), pads=[1] * 4)
    if bn == "op":
        return b.model(b.bn(y))
    if bn == "hand":
        var_eps = b.const(rng.uniform(0.5, 2, (C, 1, 1)) + 1e-5)
        y = b.op("Div", b.op("Sub", y, _per_channel(b)), b.op("Sqrt", var_eps))
    y = b.op("Add", b.op("Mul", y, _per_channel(b, 1.0)), _per_channel(b))
    return b.model(y)


def batchnorm_conv(rng: np.random.Generator) -> ir.Model:
    """A BatchNorm of ``x`` (2, C, 7, 7) before an unpadded 1x1 Conv: folded into the layer
    after it."""
    b = Block(rng)
    return b.model(b.conv(b.bn("x"), 1))


def gemm_batchnorm(rng: np.random.Generator) -> ir.Model:
    """A Linear layer as Gemm (``transB=1``) of ``x`` (2, 8), then a BatchNorm1d over its C
    outputs."""
    b = Block(rng)
    w, bias = b.const(rng.standard_normal((C, 8))), b.const(rng.standard_normal(C))
    return b.model(b.bn(b.op("Gemm", "x", w, bias, transB=1)), shape=(2, 8))


def reparam_block(rng: np.random.Generator, *, block: str = "repvgg") -> ir.Model:
    """A re-parameterizable block of :data:`tests.support.reparam_graphs.MERGED` by name, on
    ``x`` (2, C, 7, 7), in its train form."""
    b = Block(rng)
    return b.model(MERGED[block][0](b))


def sdpa(rng: np.random.Generator, *, transposed: bool = False) -> ir.Model:
    """Scaled dot-product attention of q, k (2, 3, 5, 8) and v (2, 3, 5, 6), opset 20:
    ``Softmax(q @ Transpose(k) * 1/sqrt(8)) @ v``; ``transposed``: YOLO11's C2PSA form
    instead, ``v @ Transpose(Softmax(Transpose(q) @ k * scale))``
    (:func:`tests.support.attention_graphs.yolo_attention`)."""
    if transposed:
        return yolo_attention()
    nodes = [
        ("Transpose", ["k"], ["kt"], {"perm": [0, 1, 3, 2]}),
        ("MatMul", ["q", "kt"], ["raw"], {}),
        ("Mul", ["raw", "scale"], ["scores"], {}),
        ("Softmax", ["scores"], ["p"], {"axis": -1}),
        ("MatMul", ["p", "v"], ["y"], {}),
    ]
    inputs = {"q": (FLOAT, (2, 3, 5, 8)), "k": (FLOAT, (2, 3, 5, 8)), "v": (FLOAT, (2, 3, 5, 6))}
    scale = {"scale": np.float32(1 / math.sqrt(8))}
    return make_model(nodes, inputs, {"y": (FLOAT, None)}, scale, opset=20)


def row_selection(rng: np.random.Generator) -> ir.Model:
    """A class token's row selected after a row-wise block: ``Gather(Relu(x @ W + b), 0,
    axis=1)`` of ``x`` (2, 5, 8), ``W`` (8, 8) and ``b`` random."""
    g = Graph()
    w, b = g.const("w", _random(rng, (8, 8), 0.0)), g.const("b", _random(rng, (8,)))
    h = g.node("Relu", [g.node("Add", [g.node("MatMul", ["x", w], "xw"), b], "h0")], "h")
    y = g.node("Gather", [h, g.const("first", np.array(0, np.int64))], "y", axis=1)
    return g.model({"x": (FLOAT, (2, 5, 8))}, {y: (FLOAT, (2, 8))})
