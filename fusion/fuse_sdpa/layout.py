"""``Attention``'s 3-D form where the heads are a view: the tensors before the split into heads
(:func:`of`, :func:`source`) and the Reshapes that read the output's heads merged back
(:func:`merged_readers`). The views recognized and why the 3-D form is the same numbers with
fewer copies: see docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._dense import Dense, columns, dense
from fusion._ir import add_initializer, const_array, dims, producer, same_dim
from fusion.simplify.split import interval


@dataclasses.dataclass
class Heads:
    """A 4-D ``(B, N, S, H)`` tensor as a view of ``source``, 3-D ``(B, S, N*H)`` (or, where
    ``shape`` is set, ``Reshape(source, shape)`` is; where ``packed`` is set, columns
    ``packed[1]`` to ``packed[2]`` of that dense layer are), by ``nodes``."""

    source: ir.Value
    heads: int
    nodes: list[ir.Node]
    shape: tuple[int, ...] | None = None
    packed: tuple[Dense, int, int] | None = None


def of(value: ir.Value) -> Heads | None:
    """``value`` (4-D) as a view of the tensor before its split into heads, or None."""
    out = dims(value)
    if out is None or len(out) != 4 or not all(isinstance(d, int) for d in out[1::2]):
        return None
    heads, size = out[1], out[3]
    transpose = producer(value, "Transpose")
    if transpose is not None:
        split = producer(transpose.inputs[0], "Reshape")
        if split is None or tuple(transpose.attributes.get_ints("perm", ())) != (0, 2, 1, 3):
            return None
        x = dims(split.inputs[0])
        if x is None or len(x) != 3 or not (same_dim(x[0], out[0]) and same_dim(x[1], out[2])):
            return None
        return Heads(split.inputs[0], heads, [transpose, split]) if x[2] == heads * size else None
    return _sequence_first(value, out) or _packed(value, out)


def _sequence_first(value: ir.Value, out: list) -> Heads | None:
    """The sequence-first view at batch 1 (see docs/fusions/fuse_sdpa.md), or None."""
    back = producer(value, "Reshape")
    transpose = producer(back.inputs[0], "Transpose") if back is not None else None
    split = producer(transpose.inputs[0], "Reshape") if transpose is not None else None
    if split is None or tuple(transpose.attributes.get_ints("perm", ())) != (1, 0, 2):
        return None
    x, heads, size = dims(split.inputs[0]), out[1], out[3]
    if x is None or len(x) != 3 or x[1] != 1 or x[2] != heads * size:
        return None
    parts = dims(split.outputs[0])
    if parts is None or not same_dim(parts[0], out[2]) or list(parts[1:]) != [heads, size]:
        return None
    return Heads(split.inputs[0], heads, [back, transpose, split], (1, -1, heads * size))


def _packed(value: ir.Value, out: list) -> Heads | None:
    """Part ``i`` of a packed projection (see docs/fusions/fuse_sdpa.md), or None."""
    part, nodes = _part(value)
    transpose = producer(part, "Transpose")
    split = producer(transpose.inputs[0], "Reshape") if transpose is not None else None
    if split is None or tuple(transpose.attributes.get_ints("perm", ())) != (2, 0, 3, 1, 4):
        return None
    layer, x, five = dense(split.inputs[0]), dims(split.inputs[0]), dims(split.outputs[0])
    if layer is None or x is None or five is None or len(five) != 5 or len(x) != 3:
        return None
    width = out[1] * out[3]
    if list(five[3:]) != [out[1], out[3]] or x[2] != five[2] * width or nodes[-1] >= five[2]:
        return None
    if not (same_dim(x[0], out[0]) and same_dim(x[1], out[2])):
        return None
    start = nodes.pop() * width
    nodes += [transpose, split, *layer.nodes]
    return Heads(layer.x, out[1], nodes, packed=(layer, start, start + width))


def _part(value: ir.Value) -> tuple[ir.Value | None, list]:
    """``value`` as ``Gather(T, i, axis=0)`` or ``Squeeze(p, [0])`` of a part ``p`` of ``T``
    along axis 0: ``Slice(T, [i], [i + 1], [0])`` (the exporters' ``unbind``) or output ``i`` of
    a ``Split`` into parts of size 1. Returns ``T``, and the nodes then ``i``; ``(None, [])``
    otherwise."""
    gather = producer(value, "Gather")
    if gather is not None and gather.attributes.get_int("axis", 0) == 0:
        index = const_array(gather.inputs[1])
        if index is not None and index.ndim == 0 and index >= 0:
            return gather.inputs[0], [gather, int(index)]
    squeeze = producer(value, "Squeeze")
    if squeeze is None or len(squeeze.inputs) < 2 or _ints(squeeze.inputs[1]) != [0]:
        return None, []
    part = squeeze.inputs[0]
    node = part.producer()
    sliced = interval(node) if node is not None else None  # (axis, start, end), normalized
    if sliced is not None and sliced[0] == 0 and sliced[2] == sliced[1] + 1:
        return node.inputs[0], [squeeze, node, sliced[1]]
    if node is None or node.op_type != "Split" or node.attributes.get_int("axis", 0) != 0:
        return None, []
    every = node.attributes.get_int("num_outputs", 0) == len(node.outputs)
    sizes = _ints(node.inputs[1]) if len(node.inputs) > 1 else None
    if every and (dims(node.inputs[0]) or [None])[0] != len(node.outputs):
        return None, []
    if not every and sizes != [1] * len(node.outputs):
        return None, []
    return node.inputs[0], [squeeze, node, node.outputs.index(part)]


def _ints(value: ir.Value | None) -> list[int] | None:
    """The constant integers of ``value`` as a list, or None."""
    array = const_array(value)
    return None if array is None else array.reshape(-1).tolist()


def merged_readers(value: ir.Value) -> list[ir.Node] | None:
    """The Reshapes that read ``value``'s heads merged back (see docs/fusions/fuse_sdpa.md), or
    None where anything else reads it."""
    out = dims(value)
    if out is None or len(out) != 4 or value.is_graph_output():
        return None
    readers = [use.node for use in value.uses()]
    reshapes = []
    for node in readers:
        if node.op_type != "Transpose" or node.domain != "" or node.outputs[0].is_graph_output():
            return None
        perm = tuple(node.attributes.get_ints("perm", ()))
        if not _same_order(perm, out):
            return None
        after = list(node.outputs[0].uses())
        if not after or not all(_reshaped(use) for use in after):
            return None
        reshapes += [use.node for use in after]
    return reshapes or None


def _reshaped(use) -> bool:
    """Whether ``use`` (a value's use) is the data input of an ONNX Reshape whose shape means
    the same of the 3-D output: no 0 that copies an axis of its input (``allowzero`` 0), which
    would copy another axis of the 3-D output than of the 4-D one."""
    node = use.node
    if node.op_type != "Reshape" or node.domain != "" or use.idx != 0:
        return False
    if node.attributes.get_int("allowzero", 0) == 1:
        return True
    shape = const_array(node.inputs[1])
    return shape is not None and not (shape == 0).any()


def _same_order(perm: tuple[int, ...], shape: list) -> bool:
    """Whether ``Transpose(x, perm)`` of ``x`` of ``shape`` ``(B, N, S, H)`` lays out its
    elements as ``(B, S, N, H)`` does: the axes not of static size 1 in the same order."""
    if sorted(perm) != [0, 1, 2, 3]:
        return False
    moved = [axis for axis in perm if shape[axis] != 1]
    return moved == [axis for axis in (0, 2, 1, 3) if shape[axis] != 1]


def source(heads: Heads, graph: ir.Graph, inserted: list[ir.Node]) -> ir.Value:
    """The 3-D tensor of ``heads``: its source, or a new Reshape of it (appended to
    ``inserted``)."""
    if heads.packed is not None:
        return columns(graph, heads.packed[0], heads.packed[1], heads.packed[2], inserted)
    if heads.shape is None:
        return heads.source
    shape = add_initializer(graph, "attn_bsd_shape", np.array(heads.shape, np.int64))
    reshape = ir.node("Reshape", [heads.source, shape])
    x = dims(heads.source)
    out = reshape.outputs[0]
    out.shape, out.dtype = ir.Shape([1, x[0], x[2]]), heads.source.dtype
    inserted.append(reshape)
    return out
