"""Which ops compute each row of their output from the same row of their inputs alone, and which
rows of which inputs a selection of output rows reads (:func:`plan`): the rules
:class:`fusion.prune_rows.PruneRows` moves a selection up by; :class:`Stop` where it cannot.
The rules and their sources: see docs/fusions/prune_rows.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array, same_dim
from fusion.base import MS_DOMAIN, Op

#: Elementwise ops (multidirectional broadcasting, Operators.md "Broadcasting in ONNX"), and
#: ONNX Runtime's contrib GELU ops, whose bias is a vector over the last axis.
ELEMENTWISE = frozenset(
    [Op(t) for t in (
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Relu", "Gelu", "Erf", "Tanh",
        "Sigmoid", "Sqrt", "Neg", "Abs", "Exp", "Log", "Cast", "Softplus", "HardSigmoid",
        "HardSwish", "LeakyRelu", "Clip", "PRelu", "Identity", "Reciprocal", "Mish", "Elu",
        "Selu", "Sin", "Cos",
    )]
    + [Op(t, MS_DOMAIN) for t in ("Gelu", "FastGelu", "BiasGelu", "QuickGelu")]
)  # fmt: skip

#: Norms over the trailing axes from their ``axis`` attribute (default -1): LayerNormalization
#: (ai.onnx 17), RMSNormalization (ai.onnx 23), ONNX Runtime's SimplifiedLayerNormalization
#: (default domain) and its Skip ops (the last axis; input and skip read row by row).
NORMS = frozenset(
    [Op("LayerNormalization"), Op("RMSNormalization"), Op("SimplifiedLayerNormalization")]
    + [Op(t, MS_DOMAIN) for t in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")]
)

#: The views whose axes :func:`plan` maps from output to input.
VIEWS = frozenset(Op(t) for t in ("Transpose", "Reshape", "Squeeze", "Unsqueeze"))

#: ONNX's attention (ai.onnx 23) and ONNX Runtime's MultiHeadAttention: a query row's output
#: reads that row of the query and every key and value.
ATTENTION = frozenset([Op("Attention"), Op("MultiHeadAttention", MS_DOMAIN)])


class Stop(Exception):
    """The node reads more than the selected rows of some input (or it cannot be proven that
    it does not): the selection stays below it."""


@dataclasses.dataclass
class Plan:
    """How to compute the selected rows of a node's outputs.

    Attributes:
        axes: per input, the axis of it to select along (None: read whole).
        constants: per input index, a constant to put in place of the node's (a Reshape's shape
            with the selected axis's length changed).
    """

    axes: list[int | None]
    constants: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)


def plan(node: ir.Node, axis: int, count: int | None) -> Plan:
    """How ``node`` computes the rows of its outputs along ``axis`` (non-negative, in the rank
    of its first output) that a selection of ``count`` rows (None: not known) keeps.

    Raises:
        Stop: ``node`` reads more than those rows of an input, or shapes that would prove it
            does not are unknown.
    """
    op = Op(node.op_type, node.domain)
    rank = _rank(node.outputs[0])
    if op in ELEMENTWISE or op == Op("Concat"):
        if op == Op("Concat") and _positive(node.attributes.get_int("axis", 0), rank) == axis:
            raise Stop
        return Plan(_broadcast(node.inputs, axis, node.outputs[0]))
    if op in NORMS:
        start = _positive(node.attributes.get_int("axis", -1), rank)
        if axis >= start:
            raise Stop
        return Plan(_broadcast(node.inputs, axis, node.outputs[0]))
    if op == Op("MatMul"):
        return Plan(_matmul(node, axis, rank))
    if op == Op("Gemm"):
        return Plan(_gemm(node, axis))
    if op in VIEWS:
        return _view(node, axis, rank, count)
    if op in ATTENTION:
        return Plan(_attention(node, axis, rank))
    raise Stop


def _rank(value: ir.Value | None) -> int:
    """The rank of ``value``. Raises Stop where it is not known."""
    if value is None or value.shape is None:
        raise Stop
    return len(value.shape)


def _positive(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _broadcast(inputs, axis: int, output: ir.Value) -> list[int | None]:
    """Per input, the axis that broadcasts to ``output``'s ``axis`` (right-aligned), None where
    the input has no such axis or a length 1 there."""
    rank, length = len(output.shape), output.shape[axis]
    axes: list[int | None] = []
    for value in inputs:
        if value is None:
            axes.append(None)
            continue
        own = axis - (rank - _rank(value))
        if own < 0 or value.shape[own] == 1:
            axes.append(None)
        elif same_dim(value.shape[own], length):
            axes.append(own)
        else:
            raise Stop
    return axes


def _matmul(node: ir.Node, axis: int, rank: int) -> list[int | None]:
    """MatMul (numpy.matmul semantics): a row of A gives that row of the product; a batch axis
    broadcasts as elementwise; a column reads every row of A."""
    a, b = node.inputs
    if rank < 2 or _rank(a) < 2 or axis == rank - 1:
        raise Stop
    if axis == rank - 2:
        return [_rank(a) - 2, None]
    if _rank(b) < 2:
        raise Stop
    batch = ir.Value(shape=ir.Shape(list(node.outputs[0].shape)[:-2]))
    ab = [ir.Value(shape=ir.Shape(list(v.shape)[:-2])) for v in (a, b)]
    return _broadcast(ab, axis, batch)


def _gemm(node: ir.Node, axis: int) -> list[int | None]:
    """Gemm: ``alpha * A' B' + beta * C``; the output's row ``m`` reads row ``m`` of ``A'``
    (a column of A where ``transA``) and of C where C has rows."""
    if axis != 0:
        raise Stop
    a_axis = 1 if node.attributes.get_int("transA", 0) else 0
    c = node.inputs[2] if len(node.inputs) > 2 else None
    return [a_axis, None, None if c is None else _broadcast([c], 0, node.outputs[0])[0]]


def _view(node: ir.Node, axis: int, rank: int, count: int | None) -> Plan:
    """Transpose, Squeeze, Unsqueeze: the input axis the output's ``axis`` is; Reshape: the same
    axis where the axes up to it keep their lengths (its shape rewritten for ``count`` rows)."""
    source = node.inputs[0]
    if node.op_type == "Transpose":
        perm = node.attributes.get_ints("perm", list(range(rank))[::-1])
        return Plan([perm[axis]])
    if node.op_type in ("Squeeze", "Unsqueeze"):
        axes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None:
            raise Stop
        wide = rank if node.op_type == "Unsqueeze" else _rank(source)
        changed = sorted(_positive(int(a), wide) for a in axes.reshape(-1))
        kept = [i for i in range(wide) if i not in changed]
        if node.op_type == "Unsqueeze":
            if axis in changed:
                raise Stop
            return Plan([kept.index(axis), None])
        return Plan([kept[axis], None])
    return _reshape(node, axis, count)


def _reshape(node: ir.Node, axis: int, count: int | None) -> Plan:
    """Reshape whose input and output agree on every length up to and including ``axis``: the
    rows stay whole blocks of elements, so the selection moves through with its shape's length
    at ``axis`` made ``count``."""
    source, out = node.inputs[0], node.outputs[0]
    shape = const_array(node.inputs[1])
    if shape is None or source.shape is None or out.shape is None or axis >= len(source.shape):
        raise Stop
    prefix = zip(list(source.shape)[: axis + 1], list(out.shape)[: axis + 1], strict=True)
    if not all(same_dim(i, o) for i, o in prefix):
        raise Stop
    shape = shape.copy()
    if shape[axis] == 0 and not node.attributes.get_int("allowzero", 0):
        return Plan([axis, None])
    if shape[axis] != -1:
        if count is None:
            raise Stop
        shape[axis] = count
    return Plan([axis, None], {1: shape})


def _attention(node: ir.Node, axis: int, rank: int) -> list[int | None]:
    """ONNX's Attention (Operators.md, Attention-23) and ONNX Runtime's MultiHeadAttention
    (ContribOperators.md): a query row's output reads that query row, every key and value, and
    that row of the mask or bias over the scores. Not where the mask is causal (its rows are
    positions), a KV cache goes in or out, or the query packs the keys and values too."""
    onnx = node.domain == ""
    causal = node.attributes.get_int("is_causal" if onnx else "unidirectional", 0)
    past = node.inputs[4:6] if onnx else node.inputs[6:]
    packed = not onnx and (len(node.inputs) < 3 or node.inputs[1] is None)
    extra = any(v.uses() or v.is_graph_output() for v in node.outputs[1:])
    seq = {3: 1, 4: 2}.get(rank)
    if causal or packed or extra or any(v is not None for v in past) or axis != seq:
        raise Stop
    query = node.inputs[0]
    axes: list[int | None] = [{3: 1, 4: 2}.get(_rank(query))]
    if axes[0] is None:
        raise Stop
    axes += [None] * (len(node.inputs) - 1)
    bias = 3 if onnx else 5
    if len(node.inputs) > bias and node.inputs[bias] is not None:
        mask = node.inputs[bias]
        length = node.outputs[0].shape[axis]
        rows = _rank(mask) - 2
        if rows >= 0 and mask.shape[rows] != 1:
            if not same_dim(mask.shape[rows], length):
                raise Stop
            axes[bias] = rows
    return axes
