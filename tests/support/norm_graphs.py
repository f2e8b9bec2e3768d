"""Hand-written norms as ONNX graphs, for the fast LayerNorm / RMSNorm / Skip pass tests.

No PyTorch: every graph is written node by node (:mod:`graphs`), so each test shows the exact
pattern a pass sees, and the whole module runs in seconds. The numerics check compares ONNX
Runtime on the graph before and after the pass (graph optimizations off), on random inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

import fusion
from fusion import Code
from fusion.base import FusionPass, FusionReport
from tests.support.graphs import NodeSpec, assert_close, make_model, run

#: (batch, rows, hidden): the input of every norm here.
SHAPE = (2, 3, 16)

#: ai.onnx opset -> the lowest IR version that carries it (ONNX's versioning table).
_IR_VERSION = {23: 11}


class Graph:
    """A graph under construction: nodes, constants and the opset they are written for.

    Args:
        opset: the ai.onnx opset; below 18 ReduceMean and ReduceL2 take ``axes`` as an
            attribute, from 18 as an input.
    """

    def __init__(self, opset: int = 18):
        self.opset = opset
        self.nodes: list[NodeSpec] = []
        self.constants: dict[str, np.ndarray] = {}

    def const(self, name: str, array) -> str:
        """Add the constant ``array`` (an initializer) as ``name``; return the name."""
        self.constants[name] = np.asarray(array)
        return name

    def node(self, op_type: str, inputs: Sequence[str], output: str, **attributes) -> str:
        """Append a node with one output; return the output's name."""
        self.nodes.append((op_type, list(inputs), [output], attributes))
        return output

    def reduce(self, op_type: str, x: str, out: str, axes: Sequence[int], keepdims=1) -> str:
        """``op_type`` (ReduceMean, ReduceL2) of ``x`` over ``axes``, spelled for the opset."""
        if self.opset >= 18:
            axes_name = self.const(f"{out}_axes", np.array(axes, np.int64))
            return self.node(op_type, [x, axes_name], out, keepdims=keepdims)
        return self.node(op_type, [x], out, axes=list(axes), keepdims=keepdims)

    def model(
        self,
        inputs: Mapping[str, tuple[int, Sequence[int]]],
        outputs: Mapping[str, tuple[int, Sequence[int] | None]],
    ) -> ir.Model:
        """The onnx_ir model of this graph (shape-inferred)."""
        ir_version = _IR_VERSION.get(self.opset, 10)
        return make_model(
            self.nodes, inputs, outputs, self.constants, opset=self.opset, ir_version=ir_version
        )


def layernorm(
    g: Graph,
    x: str,
    *,
    axes: Sequence[int] = (-1,),
    var_axes: Sequence[int] | None = None,
    eps: float | np.ndarray | str = 1e-5,
    reciprocal: bool = False,
    eps_outside: bool = False,
    numerator: str | None = None,
) -> str:
    """The textbook LayerNorm ``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)`` (Ba et al.
    2016), written with Pow, Sqrt and Div (or ``Mul(., Reciprocal(.))``); return its output.

    ``eps`` (float32) may be an array (a constant that is no scalar) or a name (a graph input);
    ``eps_outside`` writes ``sqrt(var) + eps``; ``numerator`` divides another tensor.
    """
    d = g.node("Sub", [x, g.reduce("ReduceMean", x, "mean", axes)], "d")
    sq = g.node("Pow", [d, g.const("two", np.float32(2))], "sq")
    var = g.reduce("ReduceMean", sq, "var", var_axes or axes)
    eps_name = eps if isinstance(eps, str) else g.const("eps", np.asarray(eps, np.float32))
    if eps_outside:
        den = g.node("Add", [g.node("Sqrt", [var], "std"), eps_name], "den")
    else:
        den = g.node("Sqrt", [g.node("Add", [var, eps_name], "var_eps")], "den")
    if reciprocal:
        return g.node("Mul", [numerator or d, g.node("Reciprocal", [den], "inv")], "normed")
    return g.node("Div", [numerator or d, den], "normed")


def rmsnorm(
    g: Graph, x: str, *, axes: Sequence[int] = (-1,), eps: float = 1e-6, eps_outside=False
) -> str:
    """The LLaMA RMSNorm ``x * Reciprocal(sqrt(mean(x^2) + eps))`` (Zhang & Sennrich 2019) as
    the dynamo exporter writes it; return its output."""
    ms = g.reduce("ReduceMean", g.node("Pow", [x, g.const("two", np.float32(2))], "sq"), "ms", axes)
    eps_name = g.const("eps", np.float32(eps))
    if eps_outside:
        den = g.node("Add", [g.node("Sqrt", [ms], "rms"), eps_name], "den")
    else:
        den = g.node("Sqrt", [g.node("Add", [ms, eps_name], "ms_eps")], "den")
    return g.node("Mul", [x, g.node("Reciprocal", [den], "inv")], "normed")


def inputs(rng: np.random.Generator, model: ir.Model) -> dict[str, np.ndarray]:
    """Random normal feeds (mean 0.5, std 2) for every graph input, of its shape and type."""
    feeds = {}
    for value in model.graph.inputs:
        dims = [d if isinstance(d, int) else 1 for d in value.shape]
        array = 0.5 + 2.0 * rng.standard_normal(dims)
        feeds[value.name] = array.astype(value.dtype.numpy())
    return feeds


def fuse_and_compare(
    model: ir.Model,
    fusion_pass: FusionPass,
    rng: np.random.Generator,
    *,
    rtol: float = 1e-5,
    check: bool = True,
) -> FusionReport:
    """Run ``fusion_pass`` on ``model`` and return its outcomes, after checking that ONNX
    Runtime gives the same outputs before and after (on random inputs, within ``rtol`` of
    the largest output), that the model passes :func:`fusion.check` (unless ``check`` is
    False), and that a second run of the pass changes nothing."""
    feeds = inputs(rng, model)
    before = run(model, feeds)
    assert fusion_pass(model).modified
    report = fusion_pass.outcomes
    if check:
        fusion.check(model)
    assert_close(run(model, feeds), before, rtol=rtol)
    assert not fusion_pass(model).modified
    return report


def assert_refused(model: ir.Model, fusion_pass: FusionPass, code: Code) -> FusionReport:
    """The pass refuses one candidate with ``code`` and leaves ``model`` byte for byte alone."""
    before = ir.to_proto(model).SerializeToString()
    assert not fusion_pass(model).modified
    report = fusion_pass.outcomes
    assert not report.fused
    assert report.codes() == [code], report.refused
    assert ir.to_proto(model).SerializeToString() == before
    return report
