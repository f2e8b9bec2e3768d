""":class:`PruneRows`: each constant selection of rows moved up through the ops that compute
row by row, so that they compute the selected rows only (docs/fusions/prune_rows.md).
"""

from __future__ import annotations

import enum

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, label, reduce_axes, replace_output
from fusion.base import CannotFuse, FusionPass, Kind
from fusion.prune_rows import rules, shapes
from fusion.prune_rows.rows import Selection, keep_last, read, select


class RowsCode(enum.StrEnum):
    """Why PruneRows left a candidate alone, besides the codes every pass shares
    (:class:`fusion.base.Code`)."""

    #: A mean or sum over the rows of a tail that computes row by row: every row is read,
    #: nothing to prune.
    EVERY_ROW_READ = "every_row_read"


class PruneRows(FusionPass):
    """Compute only the rows the outputs read (:mod:`fusion.prune_rows`), in place.

    Anchored at each constant selection of rows (a Gather or a Slice) of a float tensor of rank
    2 or more whose producer computes row by row (:func:`fusion.prune_rows.rules.plan`),
    repeated until no selection moves; one ``rows_pruned`` per anchor that moved, ``became`` the
    number of nodes now computing the selected rows only. With the policy's ``last_rows``, each
    of those outputs is first kept at its last position only (a Slice, anchored at
    ``NAME_last``). A mean pooling over the rows is refused with ``every_row_read``. When a
    selection moves and where it stops: docs/fusions/prune_rows.md.
    """

    kinds = (
        Kind(
            "rows_pruned",
            "rows",
            norm=False,
            meaning=(
                "selections of rows (a `Gather` of a constant index, a `Slice` of a constant range:"
                " a class token, a pooler's first token) moved up through the ops that compute row "
                "by row, which then compute the selected rows only (`fusion.prune_rows`, "
                "[fusions/prune_rows.md](fusions/prune_rows.md)); one per selection that moved; "
                "both targets"
            ),
        ),
    )
    summary = "a constant selection of rows moved up through the ops that compute row by row"
    codes = RowsCode
    settings = ("last_rows",)
    #: The policy's ``last_rows``: graph outputs kept at their last position only (a Slice
    #: written at each, :func:`fusion.prune_rows.rows.keep_last`, then moved like any).
    last_rows: tuple[str, ...]

    def apply(self, model: ir.Model) -> bool:
        graph = model.graph
        if self.last_rows or any(map(_may_select_rows, graph)):
            shapes.fill(model)  # one more inference: only where a selection may move
        for name in self.last_rows:
            keep_last(graph, name)
            self.outcomes.note(
                f"output {name!r} kept at its last position only (last_rows): its second axis "
                "is now 1"
            )
        anchors = [s for s in map(read, graph) if s is not None and _anchor(s)]
        anchors = [s for s in anchors if label(s.node) not in self.excluded]
        moved = {label(s.node): 0 for s in anchors}
        pending = [(label(s.node), s.node) for s in anchors]
        while pending:
            progress, went = [], False
            for anchor, node in pending:
                made = _move(graph, node) if node.graph is graph else None
                if made is not None:
                    moved[anchor], went = moved[anchor] + 1, True
                    progress += [(anchor, n) for n in made]
            pending = [p for p in pending if p[1].graph is graph] + progress if went else []
        for anchor, count in moved.items():
            if count:
                self.fused(anchor, f"{count} nodes on the selected rows only")
        if any(moved.values()):
            graph.sort()
        for node in graph:
            if (axis := _pooled_rows(node)) is not None:
                detail = f"a {node.op_type} over axis {axis} reads every row: nothing to prune"
                self.refused(node, CannotFuse(RowsCode.EVERY_ROW_READ, detail))
        return any(moved.values()) or bool(self.last_rows)


def _pooled_rows(node: ir.Node) -> int | None:
    """The row axis a ReduceMean or ReduceSum of a float tensor of rank 3 or more pools over,
    where it drops that axis (``keepdims=0``: a pooling; a norm's statistics keep it to
    broadcast back) and the node before it computes row by row along it; else None."""
    source = node.inputs[0] if node.inputs else None
    if node.op_type not in ("ReduceMean", "ReduceSum") or node.domain != "" or source is None:
        return None
    if node.attributes.get_int("keepdims", 1):
        return None
    if source.shape is None or len(source.shape) < 3 or source.producer() is None:
        return None
    rank = len(source.shape)
    axes = [a % rank for a in reduce_axes(node, rank) or ()]
    if len(axes) != 1 or axes[0] == rank - 1 or not _floating(source):
        return None
    try:
        rules.plan(source.producer(), axes[0], None)
    except rules.Stop:
        return None
    return axes[0]


def _floating(value: ir.Value) -> bool:
    """Whether ``value`` is not known to be other than floating point."""
    return value.dtype is None or value.dtype.is_floating_point()


def _may_select_rows(node: ir.Node) -> bool:
    """Whether ``node`` is a Gather or Slice whose data may be a tensor :func:`_anchor` takes
    (its shape unknown, or of rank 2 or more; not known to be other than floating point): the
    selections of shapes' index arithmetic need no inference."""
    if node.op_type not in ("Gather", "Slice") or node.domain != "" or not node.inputs:
        return False
    data = node.inputs[0]
    return data is not None and _floating(data) and (data.shape is None or len(data.shape) >= 2)


def _anchor(selection: Selection) -> bool:
    """Whether a selection reads rows of a tensor of rank 2 or more that is not known to be
    other than floating point (not the index arithmetic of shapes)."""
    value = selection.node.inputs[0]
    return value.shape is not None and len(value.shape) >= 2 and _floating(value)


def _move(graph: ir.Graph, node: ir.Node) -> list[ir.Node] | None:
    """Move the selection ``node`` above the node that makes its input, where that node's
    outputs are read by selections like it only and it computes row by row; return the
    selections made on its inputs (None where it did not move)."""
    selection = read(node)
    if selection is None:
        return None
    source = node.inputs[0]
    producer = source.producer()
    if producer is None or producer.graph is not graph:
        return None
    readers = _readers(producer, selection)
    if readers is None:
        return None
    length = source.shape[selection.axis]
    count = selection.rows.count(length)
    if count is not None and isinstance(length, int) and count >= length:
        return None  # every row: nothing to prune
    try:
        plan = rules.plan(producer, selection.axis, count)
    except rules.Stop:
        return None
    inputs, made = [], []
    for index, (value, axis) in enumerate(zip(producer.inputs, plan.axes, strict=False)):
        if index in plan.constants:
            value = add_initializer(graph, "rows_shape", plan.constants[index])
        elif axis is not None:
            value, new = select(graph, value, selection.rows, axis, producer)
            made += [new] if new is not None else []
        inputs.append(value)
    twin = _twin(producer, inputs, selection, count)
    graph.insert_before(producer, twin)
    for reader, old, new in zip(readers, producer.outputs, twin.outputs, strict=True):
        _rewire(graph, reader, old, new)
    graph.remove(producer, safe=True)
    return made


def _readers(producer: ir.Node, selection: Selection) -> list[ir.Node | None] | None:
    """Per output of ``producer``, the one selection like ``selection`` that reads it (None for
    an output nobody reads), or None where an output is read otherwise (a graph output, another
    node, a selection of other rows)."""
    readers: list[ir.Node | None] = []
    for value in producer.outputs:
        uses = list(value.uses())
        if value.is_graph_output() or len(uses) > 1:
            return None
        if not uses:
            readers.append(None)
            continue
        found = read(uses[0].node) if uses[0].idx == 0 else None
        if found is None or (found.rows, found.axis) != (selection.rows, selection.axis):
            return None
        if found.keeps_rank != selection.keeps_rank and found.node is not selection.node:
            return None
        readers.append(found.node)
    return readers


def _twin(producer: ir.Node, inputs: list, selection: Selection, count: int | None) -> ir.Node:
    """``producer`` made again on ``inputs``, its outputs' shapes with ``count`` rows."""
    twin = ir.Node(
        producer.domain,
        producer.op_type,
        inputs,
        list(producer.attributes.values()),
        num_outputs=len(producer.outputs),
        name=f"{producer.name}_rows" if producer.name else None,
        version=producer.version,
    )
    for old, new in zip(producer.outputs, twin.outputs, strict=True):
        new.type = old.type
        if old.shape is not None:
            dims = list(old.shape)
            dims[selection.axis] = count if count is not None else ir.SymbolicDim(None)
            new.shape = ir.Shape(dims)
        new.name = f"{old.name}_rows" if old.name else None
    twin.metadata_props.update(producer.metadata_props)
    return twin


def _rewire(graph: ir.Graph, reader: ir.Node | None, old: ir.Value, new: ir.Value) -> None:
    """Make the selection ``reader`` of ``old`` read ``new`` (whose rows are the selected
    ones): a selection that keeps the axis goes (its readers read ``new``); a Gather of one
    index, which drops the axis, stays and takes row 0 of ``new``."""
    if reader is None:
        return
    found = read(reader)
    if found is not None and found.keeps_rank:
        replace_output(graph, reader.outputs[0], new)
        graph.remove(reader, safe=True)
        return
    reader.replace_input_with(0, new)
    reader.replace_input_with(1, add_initializer(graph, "row", np.array(0, np.int64)))
