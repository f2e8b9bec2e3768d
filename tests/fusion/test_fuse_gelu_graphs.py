"""FuseGelu on hand-written graphs (no PyTorch): each GELU spelling the exporters write, in its
erf and tanh forms, fused and run on ONNX Runtime before and after (random inputs); the bias
before it taken in for ONNX Runtime; look-alikes with other constants refused by their code."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto

from fusion import Code
from fusion.fuse_gelu import FuseGelu
from tests.support.norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare

FLOAT = TensorProto.FLOAT
H = SHAPE[-1]


def _erf(g: Graph, x: str, divide: bool = True, constant: float | None = None) -> str:
    """``erf(x / sqrt 2)``, as a Div (PyTorch, Paddle) or a Mul by ``1/sqrt 2`` (tf2onnx)."""
    if divide:
        c = g.const("sqrt2", np.float32(constant or math.sqrt(2)))
        return g.node("Erf", [g.node("Div", [x, c], "u")], "f")
    c = g.const("inv_sqrt2", np.float32(constant or 1 / math.sqrt(2)))
    return g.node("Erf", [g.node("Mul", [x, c], "u")], "f")


def _tanh(g: Graph, x: str, pow_cube: bool = True, cubic: float = 0.044715) -> str:
    """``tanh(sqrt(2/pi) * (x + 0.044715 x^3))``, the cube as Pow or as products."""
    if pow_cube:
        cube = g.node("Pow", [x, g.const("three", np.float32(3))], "cube")
    else:
        cube = g.node("Mul", [g.node("Mul", [x, x], "sq"), x], "cube")
    term = g.node("Mul", [g.const("cubic", np.float32(cubic)), cube], "term")
    inner = g.node("Add", [x, term], "inner")
    c = g.const("c", np.float32(math.sqrt(2 / math.pi)))
    return g.node("Tanh", [g.node("Mul", [c, inner], "arg")], "f")


def _gelu(g: Graph, x: str, f: str, association: str) -> str:
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


def _model(g: Graph, y: str):
    return g.model({"x": (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE)})


ASSOCIATIONS = ["x_times_half_t", "half_x_times_t", "x_t_times_half", "x_t_over_two"]


@pytest.mark.parametrize("association", ASSOCIATIONS)
@pytest.mark.parametrize("form", ["erf_div", "erf_mul", "tanh_pow", "tanh_mul"])
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_every_spelling_is_one_op(rng, association, form, target):
    g = Graph(opset=20)
    kind, how = form.split("_")
    f = _erf(g, "x", how == "div") if kind == "erf" else _tanh(g, "x", how == "pow")
    model = _model(g, _gelu(g, "x", f, association))
    report = fuse_and_compare(model, FuseGelu(target), rng)
    assert report.counts["gelu_fused"] == 1 and not report.refused
    (node,) = model.graph
    if target == "ort":
        assert (node.domain, node.op_type) == (
            "com.microsoft",
            "FastGelu" if kind == "tanh" else "Gelu",
        )
    else:
        assert (node.domain, node.op_type) == ("", "Gelu")
        assert node.attributes.get_string("approximate") == ("tanh" if kind == "tanh" else "none")


@pytest.mark.parametrize("kind", ["erf", "tanh"])
def test_the_bias_before_is_taken_in_for_onnx_runtime(rng, kind):
    """``x = v + b`` (a projection's bias, 1-D) read only by the GELU: BiasGelu / FastGelu
    with the bias as its second input."""
    g = Graph(opset=20)
    x = g.node("Add", ["v", g.const("b", rng.standard_normal(H).astype(np.float32))], "x")
    f = _erf(g, x) if kind == "erf" else _tanh(g, x)
    model = g.model(
        {"v": (FLOAT, SHAPE)}, {(y := _gelu(g, x, f, "half_x_times_t")): (FLOAT, SHAPE)}
    )
    fuse_and_compare(model, FuseGelu("ort"), rng)
    (node,) = model.graph
    assert node.op_type == ("FastGelu" if kind == "tanh" else "BiasGelu") and len(node.inputs) == 2
    assert y == node.outputs[0].name


def test_a_gelu_op_of_the_file_takes_its_bias_in(rng):
    """ONNX's Gelu after a bias Add (PyTorch's dynamo export at opset 20): BiasGelu, counted."""
    g = Graph(opset=20)
    x = g.node("Add", ["v", g.const("b", rng.standard_normal(H).astype(np.float32))], "x")
    model = g.model({"v": (FLOAT, SHAPE)}, {g.node("Gelu", [x], "y"): (FLOAT, SHAPE)})
    report = fuse_and_compare(model, FuseGelu("ort"), rng)
    assert report.counts["gelu_fused"] == 1
    (node,) = model.graph
    assert node.op_type == "BiasGelu"


@pytest.mark.parametrize(
    "build",
    [
        lambda g: _erf(g, "x", True, constant=2.0),
        lambda g: _tanh(g, "x", cubic=0.0447),
    ],
    ids=["x_over_2", "cubic_0.0447"],
)
def test_another_constant_is_another_function(build):
    g = Graph(opset=20)
    model = _model(g, _gelu(g, "x", build(g), "half_x_times_t"))
    assert_refused(model, FuseGelu("ort"), Code.GELU_CONSTANT)


def test_an_intermediate_read_elsewhere_blocks_it():
    g = Graph(opset=20)
    f = _erf(g, "x")
    y = _gelu(g, "x", f, "half_x_times_t")
    model = g.model({"x": (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE), f: (FLOAT, SHAPE)})
    assert_refused(model, FuseGelu("ort"), Code.SHARED_OUTPUT)


def test_below_opset_20_the_portable_target_refuses():
    g = Graph(opset=18)
    model = _model(g, _gelu(g, "x", _erf(g, "x"), "half_x_times_t"))
    assert_refused(model, FuseGelu("onnx"), Code.OPSET_TOO_LOW)
