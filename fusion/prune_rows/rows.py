"""The selections :class:`fusion.prune_rows.PruneRows` moves: a constant choice of rows along
one axis of a tensor (:class:`Rows`), read from the node that makes it (:func:`read`) and
applied to another value (:func:`select`); and the last position of an output
(:func:`keep_last`). See docs/fusions/prune_rows.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, const_array, unused_name


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows a selection keeps along its axis, the same on every value of the same length
    along that axis (negative positions count from the end, as Gather and Slice read them).

    Attributes:
        op: ``"Gather"`` (``indices``, a 1-D constant) or ``"Slice"`` (``start``, ``end``,
            ``step``; Operators.md, Slice-13: clamped to the axis).
        indices: the positions a Gather keeps, in order.
        start, end, step: the Slice's range.
    """

    op: str
    indices: tuple[int, ...] = ()
    start: int = 0
    end: int = 0
    step: int = 1

    def count(self, length: int | ir.SymbolicDim | None) -> int | None:
        """How many rows of an axis of ``length`` the selection keeps (None where that depends
        on a length not known)."""
        if self.op == "Gather":
            return len(self.indices)
        if isinstance(length, int):
            return len(range(length)[slice(self.start, self.end, self.step)])
        return None

    def constants(self, graph: ir.Graph, axis: int) -> list[ir.Value]:
        """The constant inputs of a node making this selection along ``axis`` (added to
        ``graph`` as initializers)."""
        if self.op == "Gather":
            return [add_initializer(graph, "rows", np.array(self.indices, np.int64))]
        arrays = ([self.start], [self.end], [axis], [self.step])
        names = ("rows_start", "rows_end", "rows_axis", "rows_step")
        pairs = zip(names, arrays, strict=True)
        return [add_initializer(graph, n, np.array(a, np.int64)) for n, a in pairs]


@dataclasses.dataclass(frozen=True)
class Selection:
    """A node that selects rows: what it keeps, along which axis of its input, and whether it
    keeps that axis (a Gather of a scalar index drops it)."""

    node: ir.Node
    rows: Rows
    axis: int
    keeps_rank: bool


def read(node: ir.Node) -> Selection | None:
    """The selection ``node`` makes, or None where it is none: ``Gather(x, i, axis)`` with ``i``
    a constant scalar or 1-D array, or ``Slice(x, starts, ends, axes, steps)`` of constants
    along one axis (Operators.md, Gather-13, Slice-13); the axis made non-negative from the
    input's rank, which must be known."""
    if node.domain != "" or not node.inputs or node.inputs[0] is None:
        return None
    rank = None if node.inputs[0].shape is None else len(node.inputs[0].shape)
    if rank is None:
        return None
    if node.op_type == "Gather":
        indices = const_array(node.inputs[1])
        if indices is None or indices.ndim > 1 or indices.size == 0:
            return None
        axis = _axis(node.attributes.get_int("axis", 0), rank)
        rows = Rows("Gather", tuple(int(i) for i in indices.reshape(-1)))
        return None if axis is None else Selection(node, rows, axis, indices.ndim == 1)
    if node.op_type == "Slice":
        return _slice(node, rank)
    return None


def _slice(node: ir.Node, rank: int) -> Selection | None:
    """:func:`read` for a Slice."""
    arrays = [const_array(v) if v is not None else None for v in node.inputs[1:5]]
    if len(arrays) < 2 or arrays[0] is None or arrays[1] is None or arrays[0].size != 1:
        return None
    axes = arrays[2] if len(arrays) > 2 and node.inputs[3] is not None else np.array([0])
    steps = arrays[3] if len(arrays) > 3 and node.inputs[4] is not None else np.array([1])
    if axes is None or steps is None or axes.size != 1 or steps.size != 1 or steps[0] == 0:
        return None
    axis = _axis(int(axes[0]), rank)
    rows = Rows("Slice", start=int(arrays[0][0]), end=int(arrays[1][0]), step=int(steps[0]))
    return None if axis is None else Selection(node, rows, axis, True)


def _axis(axis: int, rank: int) -> int | None:
    """``axis`` of a tensor of ``rank`` made non-negative, or None out of range."""
    axis = axis + rank if axis < 0 else axis
    return axis if 0 <= axis < rank else None


def select(
    graph: ir.Graph, value: ir.Value, rows: Rows, axis: int, before: ir.Node
) -> tuple[ir.Value, ir.Node | None]:
    """``value``'s ``rows`` along ``axis``, keeping the axis: the output of a selection that
    already reads it, or of a new Gather or Slice inserted before ``before``.

    Returns:
        The selected value, and the node made (None where one was there).
    """
    for use in value.uses():
        found = read(use.node)
        same = found and found.keeps_rank and (found.rows, found.axis) == (rows, axis)
        if same and use.idx == 0:
            return use.node.outputs[0], None
    inputs = [value, *rows.constants(graph, axis)]
    attributes = [ir.AttrInt64("axis", axis)] if rows.op == "Gather" else []
    name = unused_name(graph, f"{value.name}_rows")
    node = ir.Node("", rows.op, inputs, attributes, name=name)
    out = node.outputs[0]
    out.name = name
    out.type = value.type
    if value.shape is not None:
        dims = list(value.shape)
        dims[axis] = rows.count(dims[axis]) or ir.SymbolicDim(None)
        out.shape = ir.Shape(dims)
    graph.insert_before(before, node)
    return out, node


#: A Slice's ``end`` for "to the end of the axis" (INT64_MAX; Operators.md, Slice-13: clamped).
TO_THE_END = 2**63 - 1


def keep_last(graph: ir.Graph, name: str) -> ir.Node:
    """Make the graph output ``name`` (rank 2 or more) its last position along axis 1 only: a
    ``Slice(x, [-1], [end], [1])`` whose output takes the output's name (``x`` renamed
    ``NAME_all``); the Slice is named ``NAME_last``.

    Raises:
        ValueError: ``graph`` has no output ``name``, or its rank is unknown or below 2.
    """
    found = [v for v in graph.outputs if v.name == name]
    if not found or found[0].shape is None or len(found[0].shape) < 2:
        raise ValueError(f"no graph output {name!r} of rank 2 or more to keep the last row of")
    value = found[0]
    node = ir.Node(
        "", "Slice", [value, *Rows("Slice", start=-1, end=TO_THE_END).constants(graph, 1)],
        name=f"{name}_last",
    )  # fmt: skip
    out = node.outputs[0]
    out.type = value.type
    out.shape = ir.Shape([*list(value.shape)[:1], 1, *list(value.shape)[2:]])
    graph.append(node)
    value.name = unused_name(graph, f"{name}_all")
    value.replace_all_uses_with(out, replace_graph_outputs=True)
    node.replace_input_with(0, value)
    out.name = name
    return node
