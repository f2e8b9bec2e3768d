"""The shapes :mod:`fusion.prune_rows` reads where inference leaves them out, filled forward in
graph order (:func:`fill`). Why they are missing and for which ops they are filled: see
docs/fusions/prune_rows.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import KnownShapes, const_array, same_dim
from fusion.base import Op
from fusion.prune_rows.rules import ELEMENTWISE


def fill(model: ir.Model) -> None:
    """Give each main-graph value that carries no shape the one inference finds
    (:class:`fusion._ir.KnownShapes`), else the one :func:`_forward` computes from its node's
    inputs, where its element type is known too (its own, inference's, or for the ops above
    their first input's: a value is written with both or neither), in place."""
    shapes = KnownShapes(model)
    for node in model.graph:
        for index, value in enumerate(node.outputs):
            if value.shape is not None:
                continue
            shape = shapes(value) or (_forward(node) if index == 0 else None)
            dtype = value.dtype or shapes.dtype(value) or _kept_type(node)
            if shape is not None and dtype is not None:
                value.shape, value.dtype = shape, dtype


def _kept_type(node: ir.Node) -> ir.DataType | None:
    """The element type of the first input, for an op of :func:`_forward` that keeps it."""
    kept = Op(node.op_type, node.domain) in ELEMENTWISE and node.op_type != "Cast"
    kept |= node.op_type in ("MultiHeadAttention", "Transpose", "Reshape", "MatMul")
    return node.inputs[0].dtype if kept and node.inputs and node.inputs[0] is not None else None


def _dims(value: ir.Value | None) -> list | None:
    return None if value is None or value.shape is None else list(value.shape)


def _forward(node: ir.Node) -> ir.Shape | None:
    """The first output's shape from its inputs' (Operators.md; ContribOperators.md for
    MultiHeadAttention: ``(B, S, v_hidden)``), or None where it cannot be told."""
    source = _dims(node.inputs[0]) if node.inputs else None
    if source is None:
        return None
    if node.op_type == "MultiHeadAttention" and len(node.inputs) > 2 and len(source) == 3:
        value = _dims(node.inputs[2])
        width = None if value is None else (value[-1] if len(value) == 3 else value[1] * value[3])
        return None if width is None else ir.Shape([*source[:2], width])
    if node.op_type == "Transpose" and node.domain == "":
        perm = node.attributes.get_ints("perm", list(range(len(source)))[::-1])
        return ir.Shape([source[p] for p in perm])
    if node.op_type == "Reshape" and node.domain == "":
        return _reshaped(node, source)
    if node.op_type == "MatMul" and node.domain == "" and len(source) >= 2:
        weight = _dims(node.inputs[1])
        return None if weight is None or len(weight) != 2 else ir.Shape([*source[:-1], weight[1]])
    if Op(node.op_type, node.domain) in ELEMENTWISE:
        others = [_dims(v) for v in node.inputs[1:] if v is not None]
        return ir.Shape(source) if all(_into(o, source) for o in others) else None
    return None


def _into(other: list | None, source: list) -> bool:
    """Whether a tensor of dimensions ``other`` broadcasts to ``source``'s (right-aligned, each
    length 1 or the same), leaving ``source``'s shape the result's."""
    if other is None or len(other) > len(source):
        return False
    tail = source[len(source) - len(other) :]
    return all(o == 1 or same_dim(o, d) for o, d in zip(other, tail, strict=True))


def _reshaped(node: ir.Node, source: list) -> ir.Shape | None:
    """Reshape's output of a known constant shape (0 copies the input's length unless
    ``allowzero``, -1 the rest), where the lengths are numbers."""
    shape = const_array(node.inputs[1])
    if shape is None or not all(isinstance(d, int) for d in source):
        return None
    copy = not node.attributes.get_int("allowzero", 0)
    dims = [source[i] if d == 0 and copy else int(d) for i, d in enumerate(shape)]
    if dims.count(-1) == 1:
        known = int(np.prod([d for d in dims if d != -1]))
        dims[dims.index(-1)] = int(np.prod(source)) // known if known else 0
    return ir.Shape(dims)
