"""torch's index arithmetic written with fewer nodes (:mod:`fusion.simplify`): chained
Unsqueezes, and advanced indexing by aranges. See docs/fusions/cleanup.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    add_initializer,
    const_array,
    dims,
    producer,
    rank_of,
    replace_output,
    same_dim,
)


def _axes(node: ir.Node) -> list[int] | None:
    """The constant ``axes`` input of the Unsqueeze ``node``, or None."""
    if node.op_type != "Unsqueeze" or node.domain != "" or len(node.inputs) != 2:
        return None
    axes = const_array(node.inputs[1])
    return None if axes is None else [int(a) for a in axes.reshape(-1)]


def composed_axes(rank: int, first: list[int], second: list[int]) -> list[int] | None:
    """The axes of one Unsqueeze that does ``Unsqueeze(Unsqueeze(x, first), second)`` for ``x``
    of ``rank``: sorted, non-negative; None where an axis is out of range or repeated."""
    middle, last = rank + len(first), rank + len(first) + len(second)
    inner = {a % middle for a in first if -middle <= a < middle}
    outer = sorted({a % last for a in second if -last <= a < last})
    if len(inner) != len(first) or len(outer) != len(second):
        return None
    kept = [p for p in range(last) if p not in outer]  # where the middle's axes end up
    return sorted(outer + [kept[a] for a in inner])


def merge_unsqueezes(graph: ir.Graph) -> int:
    """Write each ``Unsqueeze(Unsqueeze(x, a), b)`` whose inner result has no other reader as
    one Unsqueeze of :func:`composed_axes` (``x``'s rank known); return how many."""
    merged = 0
    for node in list(graph):
        second = _axes(node) if node.graph is graph else None
        inner = node.inputs[0].producer() if second is not None else None
        first = _axes(inner) if inner is not None else None
        if first is None or len(inner.outputs[0].uses()) != 1:
            continue
        if inner.outputs[0].is_graph_output() or inner.graph is not graph:
            continue
        rank = rank_of(inner.inputs[0])
        axes = composed_axes(rank, first, second) if rank is not None else None
        if axes is None:
            continue
        value = add_initializer(graph, "unsqueeze_axes", np.array(axes, np.int64))
        node.replace_input_with(0, inner.inputs[0])
        node.replace_input_with(1, value)
        graph.remove(inner, safe=True)
        merged += 1
    return merged


def _placement(node: ir.Node | None) -> tuple[int, int] | None:
    """``(axis, rank)`` where ``node`` puts a 1-D tensor on ``axis`` of a tensor of ``rank``
    whose other axes are 1: an Unsqueeze of constant axes, or a Reshape to a constant shape of
    ones and one -1 (torch's ``view(1, -1, 1)``); None otherwise."""
    if node is None or node.domain != "" or len(node.inputs) != 2:
        return None
    if node.op_type == "Reshape":
        shape = const_array(node.inputs[1])
        if shape is None or sorted(shape.reshape(-1).tolist())[1:] != [1] * (shape.size - 1):
            return None
        return (shape.reshape(-1).tolist().index(-1), shape.size) if -1 in shape else None
    axes = _axes(node)
    if axes is None:
        return None
    rank = 1 + len(axes)
    inserted = {a % rank for a in axes if -rank <= a < rank}
    if len(inserted) != len(axes):
        return None
    (axis,) = set(range(rank)) - inserted
    return axis, rank


def _arange(value: ir.Value) -> tuple[ir.Value, int, int] | None:
    """``(n, axis, rank)`` where ``value`` is ``arange(n)`` (``Range(0, n, 1)``, int64) placed
    on ``axis`` of a tensor of ``rank`` with every other axis 1 (:func:`_placement`); None
    otherwise."""
    node = value.producer()
    placed = _placement(node)
    arange = producer(node.inputs[0], "Range") if placed is not None else None
    if arange is None or arange.outputs[0].dtype != ir.DataType.INT64:
        return None
    start, delta = (const_array(v) for v in (arange.inputs[0], arange.inputs[2]))
    if start is None or delta is None or start.size != 1 or delta.size != 1:
        return None
    if start.reshape(-1)[0] != 0 or delta.reshape(-1)[0] != 1:
        return None
    return arange.inputs[1], *placed


def _grid(node: ir.Node) -> list[tuple[ir.Value, int, int]] | None:
    """For a GatherND ``node`` (batch_dims 0) whose indices are torchlib's broadcast of index
    tensors that are aranges on increasing axes of one grid: ``(n_j, axis_j, rank)`` for each
    index tensor in order; None otherwise."""
    if node.op_type != "GatherND" or node.domain != "" or len(node.inputs) != 2:
        return None
    concat = producer(node.inputs[1], "Concat")
    if node.attributes.get_int("batch_dims", 0) != 0 or concat is None:
        return None
    rank = rank_of(concat.outputs[0])
    if concat.attributes.get_int("axis") not in (-1, rank - 1 if rank else -1):
        return None
    grids, expanded = [], set()
    for value in concat.inputs:
        unsqueeze = value.producer()
        axes = _axes(unsqueeze) if unsqueeze is not None else None
        expand = producer(unsqueeze.inputs[0], "Expand") if axes is not None else None
        if expand is None or axes not in ([-1], [rank_of(unsqueeze.inputs[0])]):
            return None
        shape = producer(expand.inputs[1], "Shape")
        broadcast = producer(shape.inputs[0], "Max") if shape is not None else None
        if broadcast is None or grids and broadcast is not grids[0][0]:
            return None
        if shape.attributes.get_int("start", 0) != 0 or "end" in shape.attributes:
            return None
        grids.append((broadcast, expand.inputs[0]))
        expanded.add(expand.inputs[0])
    broadcast = grids[0][0]
    if len(broadcast.inputs) != len(grids) or set(broadcast.inputs) != expanded:
        return None
    found = [_arange(index) for _, index in grids]
    if any(f is None for f in found) or len({f[2] for f in found}) != 1:
        return None
    axes = [f[1] for f in found]
    return found if axes == sorted(set(axes)) else None


def _as_vector(graph: ir.Graph, scalar: ir.Value, nodes: list[ir.Node]) -> ir.Value:
    """The int64 ``scalar`` as a ``(1,)`` vector: the ``x`` of ``Squeeze(x)`` where ``x`` is one
    (torch's symbolic sizes), an existing ``Reshape(scalar, [-1])``, or a new one appended to
    ``nodes``."""
    squeeze = producer(scalar, "Squeeze")
    if squeeze is not None and len(squeeze.inputs) == 1 and dims(squeeze.inputs[0]) == [1]:
        return squeeze.inputs[0]
    for user, _ in scalar.uses():
        if user.op_type == "Reshape" and user.domain == "" and user.graph is graph:
            shape = const_array(user.inputs[1])
            if user.inputs[0] is scalar and shape is not None and shape.tolist() in ([1], [-1]):
                return user.outputs[0]
    vector = add_initializer(graph, "grid_vector", np.array([-1], np.int64))
    nodes.append(ir.node("Reshape", [scalar, vector]))
    return nodes[-1].outputs[0]


def slice_index_grids(graph: ir.Graph) -> int:
    """Replace each GatherND over a grid of aranges (:func:`_grid`) by
    ``Unsqueeze(Slice(x, 0, [n_0, ..], [0, ..]), other axes)`` (docs/fusions/cleanup.md);
    return how many."""
    replaced = 0
    for node in list(graph):
        found = _grid(node)
        if found is None:
            continue
        k, rank = len(found), found[0][2]
        nodes: list[ir.Node] = []
        ends = [_as_vector(graph, n, nodes) for n, _, _ in found]
        concat = ir.node("Concat", ends, {"axis": 0})
        starts = add_initializer(graph, "grid_starts", np.zeros(k, np.int64))
        axes = add_initializer(graph, "grid_axes", np.arange(k, dtype=np.int64))
        block = ir.node("Slice", [node.inputs[0], starts, concat.outputs[0], axes])
        nodes += [concat, block]
        others = [p for p in range(rank) if p not in {a for _, a, _ in found}]
        if others:
            unit = add_initializer(graph, "grid_unit_axes", np.array(others, np.int64))
            nodes.append(ir.node("Unsqueeze", [block.outputs[0], unit]))
        out = nodes[-1].outputs[0]
        out.type, out.shape = node.outputs[0].type, node.outputs[0].shape
        graph.insert_before(node, nodes)
        replace_output(graph, node.outputs[0], out)
        graph.remove(node, safe=True)
        replaced += 1
    return replaced


def _is_size(value: ir.Value, x: ir.Value, axis: int) -> bool:
    """Whether ``value`` is the size of ``x``'s ``axis`` (one element): ``Gather(Shape(x),
    axis)``, or a constant equal to that size where it is a number."""
    constant = const_array(value)
    size = (dims(x) or [None] * (axis + 1))[axis]
    if constant is not None:
        return constant.size == 1 and isinstance(size, int) and constant.reshape(-1)[0] == size
    gather = producer(value, "Gather")
    shape = producer(gather.inputs[0], "Shape") if gather is not None else None
    index = const_array(gather.inputs[1]) if shape is not None else None
    if index is None or index.size != 1 or index.reshape(-1)[0] != axis:
        return False
    return (
        shape.inputs[0] is x and not shape.attributes and not gather.attributes.get_int("axis", 0)
    )


def _full_arange(value: ir.Value, size) -> tuple[int, int] | None:
    """``(axis, rank)`` of :func:`_arange` ``value`` where its length is provably ``size``
    (inferred shapes), else None."""
    found = _arange(value)
    length = dims(value.producer().inputs[0]) if found is not None else None
    if length is None or len(length) != 1 or not same_dim(length[0], size):
        return None
    return found[1:]


def _flat_grid(node: ir.Node) -> tuple[ir.Value, list[int]] | None:
    """``(x, axes)`` where the Reshape ``node`` ends torch's TorchScript indexing
    ``x[rows, cols]`` of a 2-D ``x`` by whole aranges on increasing axes of a grid
    (:func:`flat_index_grids`), ``axes`` the grid's other axes; None otherwise."""
    if node.op_type != "Reshape" or len(node.inputs) != 2:
        return None
    shape, flat = producer(node.inputs[1], "Shape"), producer(node.inputs[0], "Reshape")
    gather = producer(node.inputs[0] if flat is None else flat.inputs[0], "Gather")
    if shape is None or gather is None or gather.attributes.get_int("axis", 0) or shape.attributes:
        return None
    target = const_array(flat.inputs[1]) if flat is not None else np.array([-1])
    flatten = producer(gather.inputs[0], "Flatten")
    if target is None or target.tolist() != [-1] or flatten is None:
        return None
    x, index = flatten.inputs[0], gather.inputs[1]
    sizes, add = dims(x), producer(index, "Add")
    if shape.inputs[0] is not index or add is None or sizes is None or len(sizes) != 2:
        return None
    if flatten.attributes.get_int("axis", 1) != 2:
        return None
    for offsets, cols in (add.inputs, add.inputs[::-1]):
        mul = producer(offsets, "Mul")
        for rows, stride in (mul.inputs, mul.inputs[::-1]) if mul is not None else ():
            placed = [_full_arange(rows, sizes[0]), _full_arange(cols, sizes[1])]
            if None in placed or not _is_size(stride, x, 1):
                continue
            (row_axis, rank), (col_axis, other_rank) = placed
            if rank == other_rank and row_axis < col_axis:
                return x, [a for a in range(rank) if a not in (row_axis, col_axis)]
    return None


def flat_index_grids(graph: ir.Graph) -> int:
    """Replace torch's TorchScript indexing of a 2-D ``x`` by whole aranges,
    ``Reshape(Gather(Flatten(x, 2), rows * x.shape[1] + cols), Shape(index))``, by ``x`` with
    the grid's other axes inserted (docs/fusions/cleanup.md). Needs the inferred shapes (the
    aranges' lengths); return how many."""
    replaced = 0
    for node in list(graph):
        found = _flat_grid(node) if node.domain == "" and node.graph is graph else None
        if found is None or node.outputs[0].is_graph_output():
            continue
        x, axes = found
        unit = add_initializer(graph, "grid_unit_axes", np.array(axes, np.int64))
        unsqueeze = ir.node("Unsqueeze", [x, unit])
        graph.insert_before(node, unsqueeze)
        replace_output(graph, node.outputs[0], unsqueeze.outputs[0])
        replaced += 1
    return replaced
