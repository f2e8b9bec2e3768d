"""FuseGelu on hand-written graphs (no PyTorch): each GELU spelling the exporters write, in its
erf and tanh forms, fused and run on ONNX Runtime before and after (random inputs); the bias
before it taken in for ONNX Runtime; look-alikes with other constants refused by their code."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

from fusion import Code
from fusion.fuse_gelu import FuseGelu
from tests.support.graphs import assert_close, run
from tests.support.norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare
from tests.support.spellings import erf_part, gelu_product, tanh_part

FLOAT = TensorProto.FLOAT
H = SHAPE[-1]


def _model(g: Graph, y: str):
    return g.model({"x": (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE)})


ASSOCIATIONS = ["x_times_half_t", "half_x_times_t", "x_t_times_half", "x_t_over_two"]


@pytest.mark.parametrize("association", ASSOCIATIONS)
@pytest.mark.parametrize("form", ["erf_div", "erf_mul", "tanh_pow", "tanh_mul", "tanh_jax"])
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_every_spelling_is_one_op(rng, association, form, target):
    g = Graph(opset=20)
    kind, how = form.split("_")
    f = erf_part(g, "x", how == "div") if kind == "erf" else tanh_part(g, "x", how)
    model = _model(g, gelu_product(g, "x", f, association))
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
    f = erf_part(g, x) if kind == "erf" else tanh_part(g, x)
    model = g.model(
        {"v": (FLOAT, SHAPE)}, {(y := gelu_product(g, x, f, "half_x_times_t")): (FLOAT, SHAPE)}
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
        lambda g: erf_part(g, "x", True, constant=2.0),
        lambda g: tanh_part(g, "x", cubic=0.0447),
    ],
    ids=["x_over_2", "cubic_0.0447"],
)
def test_another_constant_is_another_function(build):
    g = Graph(opset=20)
    model = _model(g, gelu_product(g, "x", build(g), "half_x_times_t"))
    assert_refused(model, FuseGelu("ort"), Code.GELU_CONSTANT)


def test_an_intermediate_read_elsewhere_blocks_it():
    g = Graph(opset=20)
    f = erf_part(g, "x")
    y = gelu_product(g, "x", f, "half_x_times_t")
    model = g.model({"x": (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE), f: (FLOAT, SHAPE)})
    assert_refused(model, FuseGelu("ort"), Code.SHARED_OUTPUT)


def test_below_opset_20_the_portable_target_refuses():
    g = Graph(opset=18)
    model = _model(g, gelu_product(g, "x", erf_part(g, "x"), "half_x_times_t"))
    assert_refused(model, FuseGelu("onnx"), Code.OPSET_TOO_LOW)


def _cubic(g: Graph, x: str, spelling: str, c: float = 0.044715) -> str:
    """The cubic term ``c * x^3`` as a product tree of three ``x`` and ``c``: ``spelling``
    names the association (a refused one has four ``x`` or a second constant)."""
    k = g.const("cubic", np.float32(c))
    count = iter(range(10))

    def mul(a: str, b: str) -> str:
        return g.node("Mul", [a, b], f"cube_{next(count)}")

    if spelling == "jax":
        return mul(x, mul(x, mul(k, x)))
    if spelling == "pairs":
        return mul(mul(x, x), mul(x, k))
    if spelling == "square_pow":
        return mul(mul(k, x), g.node("Pow", [x, g.const("two", np.float32(2))], "square"))
    if spelling == "four_x":
        return mul(x, mul(x, mul(x, mul(k, x))))
    return mul(mul(x, g.const("two", np.float32(2))), mul(mul(x, x), k))  # two constants


def _tanh_gelu(g: Graph, spelling: str, c: float = 0.044715) -> str:
    """jax's tanh GELU of ``x`` as jax2tf then tf2onnx write it, the cubic term :func:`_cubic`."""
    inner = g.node("Add", ["x", _cubic(g, "x", spelling, c)], "inner")
    arg = g.node("Mul", [g.const("c", np.float32(np.sqrt(2 / np.pi))), inner], "arg")
    return gelu_product(g, "x", g.node("Tanh", [arg], "f"), "x_times_half_t")


@pytest.mark.parametrize("spelling", ["jax", "pairs", "square_pow"])
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_the_cubic_term_in_any_association_over_a_symbolic_batch(rng, spelling, target):
    """``0.044715 * x^3`` as any product tree of three ``x`` and the constant (jax2tf:
    ``Mul(x, Mul(x, Mul(c, x)))``), over a batch of unknown size: fused, and the same on ONNX
    Runtime at two batch sizes."""
    g = Graph(opset=20)
    shape = ("batch", 5, H)
    model = g.model({"x": (FLOAT, shape)}, {_tanh_gelu(g, spelling): (FLOAT, shape)})
    feeds = [{"x": (2 * rng.standard_normal((b, 5, H))).astype(np.float32)} for b in (1, 7)]
    before = [run(model, f) for f in feeds]
    fusion_pass = FuseGelu(target)
    assert fusion_pass(model).modified and fusion_pass.outcomes.counts["gelu_fused"] == 1
    assert [n.op_type for n in model.graph] == ["FastGelu" if target == "ort" else "Gelu"]
    for f, want in zip(feeds, before, strict=True):
        assert_close(run(model, f), want, rtol=1e-5)


def test_the_coefficient_in_the_jax_association_is_checked():
    g = Graph(opset=20)
    model = _model(g, _tanh_gelu(g, "jax", c=0.0447))
    assert_refused(model, FuseGelu("ort"), Code.GELU_CONSTANT)


@pytest.mark.parametrize("spelling", ["four_x", "two_constants"])
def test_a_product_with_another_factor_is_no_gelu(spelling):
    """``c * x^4`` or ``2 * c * x^3``: not the cubic term, no candidate (left as it was)."""
    g = Graph(opset=20)
    model = _model(g, _tanh_gelu(g, spelling))
    before = ir.to_proto(model).SerializeToString()
    fusion_pass = FuseGelu("ort")
    assert not fusion_pass(model).modified and not fusion_pass.outcomes.refused
    assert ir.to_proto(model).SerializeToString() == before


def test_a_constant_of_more_axes_than_x_is_refused(rng):
    """The 1 written as ``[1, 1, 1]`` to a 2-D ``x``: the subgraph's output has three axes, the
    fused op's would have two (``gelu_constant``); to a 3-D ``x`` it is the formula's 1."""
    for shape, fused in (((2, H), False), ((1, 2, H), True)):
        g = Graph(opset=20)
        f = tanh_part(g, "x")
        t = g.node("Add", [g.const("one", np.ones((1, 1, 1), np.float32)), f], "t")
        y = g.node("Mul", ["x", g.node("Mul", [g.const("half", np.float32(0.5)), t], "ht")], "y")
        model = g.model({"x": (FLOAT, shape)}, {y: (FLOAT, (1, 2, H))})
        if fused:
            fuse_and_compare(model, FuseGelu("ort"), rng)
        else:
            assert_refused(model, FuseGelu("ort"), Code.GELU_CONSTANT)
