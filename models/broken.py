"""Deliberately broken optimizers: what the parity verdict must catch.

Each breaks :func:`fusion.optimize` in one way while inside :func:`broken`, so that the whole
pipeline (export, optimize, check, parity) runs as usual around the fault. A break inside a
rewrite (a BatchNorm folded with the wrong variance, a fused norm's eps dropped) goes with it
when the rollback (:mod:`normexport.verdict.rollback`) leaves that rewrite out, and is undone there
(``changed_the_function``); a break outside every rewrite (a layer's weight scaled, a
LayerNormalization the exporter wrote made an RMSNorm) is in the model with no rewrite too, and
fails the verdict. Either way it is caught (:func:`caught`); a run that passes with nothing
undone missed it. ``tests/normexport/test_verdict.py`` runs them on small models and
``benchmarks/verdict.py`` on the demo models.

- ``scale``: one output channel of the first linear layer's weight (Conv, Gemm, or MatMul with
  a constant weight) times ``factor``; 1.01 by default.
- ``eps_dropped``: the first fused norm's epsilon set to 0 (NaN on a constant row), and every
  BatchNorm folded without its epsilon.
- ``layernorm_as_rmsnorm``: the first LayerNormalization made an RMSNorm (no mean
  subtracted) followed by its bias.
- ``bn_wrong_variance``: BatchNorm folded with the standard deviation where the variance
  belongs.

And one that is exact but slow, what the latency verdict (:mod:`normexport.latency.verdict`) must
catch: :func:`slowed`, every rewrite of one kind followed by a Loop that does nothing, slowly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

import numpy as np
import onnx_ir as ir

import fusion
from fusion.fold_batchnorm import algebra, before

BREAKS = ("scale", "eps_dropped", "layernorm_as_rmsnorm", "bn_wrong_variance")

#: Fused norm ops whose ``epsilon`` attribute ``eps_dropped`` sets to 0, in order of preference.
EPS_OPS = (
    "LayerNormalization",
    "SkipLayerNormalization",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "InstanceNormalization",
)


def caught(report: dict, strict: bool = False) -> bool:
    """Whether a run (its JSON report) caught a break: the verdict failed, or the rollback
    undid a rewrite for changing the function; with ``strict``, also an output warned of
    (``--strict`` fails it)."""
    parity, rollback = report["parity"], report["rollback"] or {"undone": []}
    undone = any(u["code"] == "changed_the_function" for u in rollback["undone"])
    return not parity["passed"] or undone or (strict and bool(parity["warnings"]))


class NothingToBreak(LookupError):
    """The optimized model has nothing this break applies to (e.g. no LayerNormalization)."""


@contextlib.contextmanager
def broken(kind: str, factor: float = 1.01) -> Iterator[None]:
    """:func:`fusion.optimize` (and the BatchNorm algebra) broken one way while inside.

    Args:
        kind: one of :data:`BREAKS`.
        factor: the ``scale`` break's factor.

    Raises:
        ValueError: an unknown ``kind``.
        NothingToBreak: from the pipeline's call of ``fusion.optimize``, where the optimized
            model has nothing ``kind`` applies to (no linear layer, no fused norm, no
            LayerNormalization, no folded BatchNorm).
    """
    if kind not in BREAKS:
        raise ValueError(f"unknown break {kind!r}; choose from {', '.join(BREAKS)}")
    with contextlib.ExitStack() as stack:
        if kind in ("bn_wrong_variance", "eps_dropped"):
            wrong = (lambda var, eps: var) if kind == "eps_dropped" else _std_for_var
            stack.enter_context(_batchnorm_algebra(wrong))
        stack.enter_context(mock.patch.object(fusion, "optimize", _after(kind, factor)))
        yield


#: Steps of :func:`slowed`'s Loop: about 1 ms a run on ONNX Runtime 1.31's CPU provider (the
#: graph of tests/normexport/test_speed.py takes a tenth of one).
SLOW_STEPS = 2000


@contextlib.contextmanager
def slowed(kind: str, steps: int = SLOW_STEPS) -> Iterator[None]:
    """:func:`fusion.optimize` with every rewrite of ``kind`` (a :class:`fusion.Fused` kind,
    e.g. ``"layernorm_fused"``) made slow and kept exact: the input of each node of the op
    type it became goes through a Loop of ``steps`` Identity steps first (ONNX Runtime runs a
    Loop as written). A model built without those rewrites (the rollback's builds) has no
    Loop. The op type must be one the raw model does not hold."""
    real = fusion.optimize

    def optimize(model, *args, **kwargs):
        report = real(model, *args, **kwargs)
        became = {f.became for f in report.fused if f.kind == kind}
        for node in [n for n in model.graph if n.op_type in became]:
            _loop_before(model, node, steps)
        return report

    with mock.patch.object(fusion, "optimize", optimize):
        yield


def _loop_before(model: ir.Model, node: ir.Node, steps: int) -> None:
    """``node``'s first input carried through a Loop of ``steps`` Identity steps."""
    x = node.inputs[0]
    step = ir.Value(name="slow_step", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    go = ir.Value(name="slow_go", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    value = ir.Value(name="slow_value", type=x.type, shape=x.shape)
    keep, carry = ir.node("Identity", [go]), ir.node("Identity", [value])
    body = ir.Graph(
        [step, go, value], [keep.outputs[0], carry.outputs[0]], nodes=[keep, carry], name="slow"
    )
    trips = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(steps, np.int64))})
    loop = ir.node("Loop", [trips.outputs[0], None, x], attributes={"body": body})
    for made, name in ((keep, "kept"), (carry, "carried"), (trips, "steps"), (loop, "out")):
        made.outputs[0].name = f"{node.name}_slow_{name}"
    model.graph.insert_before(node, [trips, loop])
    node.replace_input_with(0, loop.outputs[0])


def _std_for_var(var: np.ndarray, eps: float) -> np.ndarray:
    return np.sqrt(var) + eps


def _after(kind: str, factor: float) -> Callable:
    """:func:`fusion.optimize`, then the break ``kind`` applied to the optimized model.

    The first call (the pipeline's own) picks the node the break applies to; the calls after
    it (the rollback's builds, :mod:`normexport.verdict.rollback`) break the node of that name,
    where the build has one: a break in a rewrite the rollback leaves out goes with it, a break
    after the passes stays in every build."""
    real = fusion.optimize
    target: list[str] = []

    def optimize(model, *args, **kwargs):
        report = real(model, *args, **kwargs)
        first = not target
        if kind == "bn_wrong_variance":  # the BatchNorm algebra is broken: nothing else to do
            if first and not report.counts["batchnorm_folded"]:
                raise NothingToBreak("no BatchNorm folded")
            target.append("")
            return report
        node = _node(model, target[0]) if target else TARGETS[kind](model)
        if node is None and first:
            if kind == "eps_dropped" and report.counts["batchnorm_folded"]:
                target.append("")  # the BatchNorm algebra is broken: nothing else to do
                return report
            raise NothingToBreak(NOTHING[kind])
        if first:
            target.append(node.name)
        if node is not None:
            BREAK[kind](model, node, factor)
        return report

    return optimize


def _node(model: ir.Model, name: str) -> ir.Node | None:
    return next((n for n in model.graph if n.name and n.name == name), None)


@contextlib.contextmanager
def _batchnorm_algebra(denominator: Callable[[np.ndarray, float], np.ndarray]) -> Iterator[None]:
    """Fold BatchNorm with ``sqrt(denominator(var, eps))`` in place of ``sqrt(var + eps)``."""
    real = algebra.batchnorm_affine

    def wrong(node):
        real(node)  # its refusals stand
        scale, bias, mean, var = (
            node.inputs[i].const_value.numpy().astype(np.float64) for i in (1, 2, 3, 4)
        )
        s = scale / np.sqrt(denominator(var, node.attributes.get_float("epsilon", 1e-5)))
        return s, bias - mean * s

    # Where it is looked up: the fold into the layer before (algebra.step) and after (before).
    with (
        mock.patch.object(algebra, "batchnorm_affine", wrong),
        mock.patch.object(before, "batchnorm_affine", wrong),
    ):
        yield


def _first(model: ir.Model, op_types: tuple[str, ...]) -> ir.Node | None:
    """The first named node of the first of ``op_types`` (in that order) the graph holds."""
    for op_type in op_types:
        for node in model.graph:
            if node.op_type == op_type and node.name:
                return node
    return None


def _first_linear(model: ir.Model) -> ir.Node | None:
    """The first named Conv, Gemm or MatMul with a constant weight, in graph order."""
    for node in model.graph:
        weight = node.inputs[1] if node.op_type in ("Conv", "Gemm", "MatMul") else None
        if node.name and weight is not None and weight.const_value is not None:
            return node
    return None


def _scale_one_channel(model: ir.Model, node: ir.Node, factor: float) -> None:
    """One output channel of linear layer ``node``'s weight times ``factor``: a Conv's output
    channel 0 (axis 0), a MatMul's or Gemm's output feature 0."""
    weight = node.inputs[1]
    array = weight.const_value.numpy().copy()
    if node.op_type == "Conv" or (node.op_type == "Gemm" and node.attributes.get_int("transB", 0)):
        array[0] *= factor
    else:
        array[..., 0] *= factor
    weight.const_value = ir.tensor(array, name=weight.const_value.name)


def _drop_eps(model: ir.Model, node: ir.Node, factor: float) -> None:
    """Fused norm ``node``'s epsilon set to 0."""
    node.attributes["epsilon"] = ir.AttrFloat32("epsilon", 0.0)


def _layernorm_to_rmsnorm(model: ir.Model, ln: ir.Node, factor: float) -> None:
    """LayerNormalization ``ln`` turned into an RMSNorm (no mean subtracted), then its bias."""
    x, scale, *bias = ln.inputs
    attrs = {"axis": ln.attributes.get_int("axis", -1), "epsilon": 1e-5}
    rms = ir.node("SimplifiedLayerNormalization", [x, scale], attributes=attrs)
    new = [rms, ir.node("Add", [rms.outputs[0], bias[0]])] if bias and bias[0] else [rms]
    model.graph.insert_before(ln, new)
    old, out = ln.outputs[0], new[-1].outputs[0]
    if old.is_graph_output():  # the new value takes its place and its name first
        model.graph.outputs[model.graph.outputs.index(old)] = out
        name, old.name = old.name, f"{old.name}_replaced"
        out.name, out.type, out.shape = name, old.type, old.shape
    ir.convenience.replace_all_uses_with(old, out)
    model.graph.remove(ln, safe=True)


#: Each break's node in the optimized model, and what it does to it.
TARGETS: dict[str, Callable[[ir.Model], ir.Node | None]] = {
    "scale": _first_linear,
    "eps_dropped": lambda model: _first(model, EPS_OPS),
    "layernorm_as_rmsnorm": lambda model: _first(model, ("LayerNormalization",)),
}
BREAK = {
    "scale": _scale_one_channel,
    "eps_dropped": _drop_eps,
    "layernorm_as_rmsnorm": _layernorm_to_rmsnorm,
}
#: Why a break has nothing to apply to.
NOTHING = {
    "scale": "no Conv, Gemm or MatMul with a constant weight",
    "eps_dropped": "no fused norm and no folded BatchNorm: no epsilon to drop",
    "layernorm_as_rmsnorm": "no LayerNormalization",
}
