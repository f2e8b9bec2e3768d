"""The check that nothing is left unlisted: in an optimized model, in its main graph and every
subgraph, what still looks like a norm, a BatchNorm or an attention (:func:`lookalikes`) is
found either among the rewrites or among the candidates left alone of the run's
:class:`fusion.base.FusionReport`; :func:`unlisted` gives those that are in neither, what no
pass matched and no report says (docs/fusions.md#nothing-left-unlisted)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import onnx_ir as ir

from fusion._ir import label, scalar_const
from fusion._scopes import path_of, scopes
from fusion.base import FusionReport
from fusion.base.outcomes import where_in

#: The ops a hand-written norm computes its variance and normalizes with, around the ReduceMean
#: of its (centered) square: walked forward from that ReduceMean to its square root, and back
#: from it to the input.
_NORM_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Cast", "Max", "ReduceMean"}
)
#: How many nodes a norm's walks go at most (the ReduceMean to the root: Add, Sqrt, maybe a
#: Cast and a Max; from the root to the division: an inverse, a Mul by 1).
_STEPS = 6
#: The ops between an attention's two MatMuls and its Softmax: scale, mask, casts, views.
_ATTENTION_OPS = frozenset(
    {"Add", "Mul", "Div", "Where", "Cast", "Reshape", "Transpose", "Dropout", "IsNaN", "Slice"}
)


@dataclasses.dataclass(frozen=True)
class Lookalike:
    """A subgraph of an optimized model that looks like a norm, a BatchNorm or an attention.

    Attributes:
        family: ``norm`` (a ReduceMean whose result reaches a square root and a division:
            a LayerNorm's or an RMSNorm's variance), ``batchnorm`` (a BatchNormalization node)
            or ``attention`` (a Softmax between two MatMuls).
        node: the anchor's name (:func:`fusion.graph.label`): the ReduceMean, the
            BatchNormalization, the Softmax.
        path: the subgraph it is in (:attr:`fusion.base.Refused.path`), None in the main graph.
        listed: where the report has it: ``fused``, or ``left alone: CODE`` (the refusal's
            code); None when it has it nowhere.
    """

    family: str
    node: str
    path: str | None
    listed: str | None

    @property
    def where(self) -> str:
        """The anchor for a reader, after its subgraph's path where it has one."""
        return where_in(self.node, self.path)


def lookalikes(model: ir.Model, report: FusionReport) -> list[Lookalike]:
    """Every norm, BatchNorm and attention look-alike in ``model`` (optimized, in its main
    graph and every subgraph), in graph order, each with where ``report`` (the run's) has it:
    a rewrite or a refusal whose anchor, in the same graph, is one of the look-alike's nodes.

    Args:
        model: the model as the passes left it.
        report: what :func:`fusion.optimize` returned for it.
    """
    found = []
    for scope in (model, *scopes(model)):
        path = path_of(scope)
        fused = {f.node for f in report.fused if f.path == path}
        refused = {r.node: r.code for r in report.refused if r.path == path}
        for family, anchor, nodes in _candidates(scope.graph):
            labels = {label(n) for n in nodes}
            code = next((refused[n] for n in labels if n in refused), None)
            listed = f"left alone: {code}" if code else "fused" if labels & fused else None
            found.append(Lookalike(family, label(anchor), path, listed))
    return found


def unlisted(model: ir.Model, report: FusionReport) -> list[Lookalike]:
    """The :func:`lookalikes` of ``model`` that ``report`` has nowhere (empty when every one
    is listed)."""
    return [found for found in lookalikes(model, report) if found.listed is None]


def _candidates(graph: ir.Graph) -> Iterator[tuple[str, ir.Node, set[ir.Node]]]:
    """``(family, anchor, nodes)`` of each look-alike of ``graph`` itself, in node order."""
    for node in graph:
        if node.domain != "":
            continue
        if node.op_type == "BatchNormalization":
            yield "batchnorm", node, {node}
        elif node.op_type == "ReduceMean":  # the variance's: a root after it, no other mean
            after = _forward(node, _NORM_OPS - {"ReduceMean"})
            if any(_is_root(n) for n in after):
                yield "norm", node, {node, *after, *_backward(node, _NORM_OPS)}
        elif node.op_type == "Softmax":
            before, after = _backward(node, _ATTENTION_OPS), _forward(node, _ATTENTION_OPS)
            if _reaches_matmul(before, node, inputs=True) and _reaches_matmul(after, node):
                yield "attention", node, {node, *before, *after}


def _is_root(node: ir.Node) -> bool:
    """Whether ``node`` takes a square root: Sqrt, or Pow by 0.5 or -0.5."""
    if node.op_type == "Sqrt":
        return True
    return node.op_type == "Pow" and scalar_const(node.inputs[1]) in (0.5, -0.5)


def _forward(node: ir.Node, ops: frozenset[str]) -> set[ir.Node]:
    """The nodes of ``ops`` that read ``node``'s outputs, directly or through others of them,
    at most :data:`_STEPS` away."""
    seen: set[ir.Node] = set()
    frontier = [node]
    for _ in range(_STEPS):
        frontier = [
            use.node
            for n in frontier
            for value in n.outputs
            for use in value.uses()
            if use.node.op_type in ops and use.node not in seen and use.node.graph is node.graph
        ]
        seen.update(frontier)
    return seen


def _backward(node: ir.Node, ops: frozenset[str]) -> set[ir.Node]:
    """The nodes of ``ops`` whose outputs ``node`` reads, directly or through others of them,
    at most :data:`_STEPS` away."""
    seen: set[ir.Node] = set()
    frontier = [node]
    for _ in range(_STEPS):
        producers = (v.producer() for n in frontier for v in n.inputs if v is not None)
        frontier = [p for p in producers if p is not None and p.op_type in ops and p not in seen]
        seen.update(frontier)
    return seen


def _reaches_matmul(nodes: set[ir.Node], softmax: ir.Node, inputs: bool = False) -> bool:
    """Whether a MatMul produces (``inputs``) or reads the Softmax ``softmax`` or one of
    ``nodes`` (the ops between them)."""
    for node in (softmax, *nodes):
        if inputs:
            near = (v.producer() for v in node.inputs if v is not None)
        else:
            near = (use.node for v in node.outputs for use in v.uses())
        if any(n is not None and n.op_type == "MatMul" for n in near):
            return True
    return False
