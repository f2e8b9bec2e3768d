"""Exact simplifications of the index arithmetic the exporters write, run by the clean-up
(:func:`fusion.cleanup.cleanup`). A decoder's attention mask is made of it: on ONNX Runtime's
CPU provider each small node costs a kernel launch, which a decode step of a small model feels
(``benchmarks/results/decoders_cpu.json``).

* :func:`merge_unsqueezes`: ``Unsqueeze(Unsqueeze(x, a), b)`` as one Unsqueeze of the composed
  axes (Operators.md, Unsqueeze-13: the axes count in the output's rank).
* :func:`slice_index_grids`: torch's advanced indexing ``x[i_0, .., i_k-1]`` by aranges
  ``i_j = arange(n_j)`` placed on increasing axes of a grid by Unsqueeze or ``view``
  (transformers' mask reads ``attention_mask[batch_arange, kv_arange]``), as torchlib's
  ``aten_index`` writes it
  (``GatherND(x, Concat(Unsqueeze(Expand(i_j, Shape(Max(i_0, ..))), -1), axis=-1))``), is the
  block ``x[:n_0, .., :n_k-1]`` with unit axes inserted: a Slice and an Unsqueeze. Where an
  ``n_j`` is larger than ``x``'s axis, GatherND fails (index out of bounds) and the Slice
  clamps; everywhere else the two are the same elements.
* :func:`drop_neutral_logic`: ``And(x, True)`` and ``Or(x, False)`` as ``x`` (transformers'
  mask starts from ``ones & causal``).
* :func:`split_slices`: Slices of one tensor that tile an axis (Phi-3's ``qkv_proj`` read as
  the query, key and value) as one Split. Run after the fusion passes only: their matchers read
  the Slices (the rotary embedding's halves, a packed projection).

All need opset 13 or above (Unsqueeze's axes and Split's sizes as inputs).

Once the values carry the shapes inference gives them (:class:`fusion.FillShapes`),
:func:`with_shapes` also folds the sizes of those shapes that are numbers
(:func:`fold_known_sizes`) and drops the Slices that provably keep a whole tensor
(:func:`drop_whole_slices`): the TorchScript exporter's shape arithmetic.
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
    same_shape,
)


def simplify(graph: ir.Graph, final: bool = False) -> int:
    """Apply :func:`merge_unsqueezes`, :func:`slice_index_grids`, :func:`drop_neutral_logic`
    (and with ``final``, :func:`split_slices`) to ``graph``, the main graph of a model of opset
    13 or above, in place; return how many rewrites were made."""
    done = merge_unsqueezes(graph) + slice_index_grids(graph) + drop_neutral_logic(graph)
    return done + (split_slices(graph) if final else 0)


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
    """Replace each GatherND over a grid of aranges (module docstring, :func:`_grid`) by
    ``Unsqueeze(Slice(x, 0, [n_0, ..], [0, ..]), other axes)``; return how many."""
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


def drop_neutral_logic(graph: ir.Graph) -> int:
    """Read ``x`` for each ``And(x, True)`` and ``Or(x, False)`` whose constant is one element
    of rank at most ``x``'s (so it adds no axis) and whose result is no graph output; return
    how many."""
    dropped = 0
    for node in list(graph):
        if node.op_type not in ("And", "Or") or node.domain != "" or node.graph is not graph:
            continue
        for index in (0, 1):
            constant, x = const_array(node.inputs[index]), node.inputs[1 - index]
            if constant is None or constant.size != 1 or node.outputs[0].is_graph_output():
                continue
            rank = rank_of(x)
            if rank is None or constant.ndim > rank:
                continue
            if bool(constant.reshape(-1)[0]) == (node.op_type == "And"):
                node.outputs[0].replace_all_uses_with(x)
                graph.remove(node, safe=True)
                dropped += 1
                break
    return dropped


def _interval(node: ir.Node) -> tuple[int, int, int] | None:
    """``(axis, start, end)`` of a Slice ``node`` of step 1 on one axis with constant bounds,
    normalized to the axis' static size (``0 <= start <= end <= size``, ``axis`` non-negative),
    or None."""
    if node.op_type != "Slice" or node.domain != "" or len(node.inputs) < 4:
        return None
    bounds = [const_array(v) for v in node.inputs[1:]]
    if any(b is None or b.size != 1 for b in bounds):
        return None
    start, end, axis, *step = (int(b.reshape(-1)[0]) for b in bounds)
    shape = dims(node.inputs[0])
    if step not in ([], [1]) or shape is None or not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    size = shape[axis]
    if not isinstance(size, int):
        return None
    start, end = (min(max(b + size if b < 0 else b, 0), size) for b in (start, end))
    return axis, start, end


def split_slices(graph: ir.Graph) -> int:
    """Replace the Slices of one tensor whose intervals (:func:`_interval`) tile one axis, each
    non-empty, by one Split of that axis (Operators.md, Split-13: sizes as an input); return
    how many Splits were made."""
    groups: dict[tuple, list] = {}
    for node in graph:
        found = _interval(node)
        if found is not None:
            groups.setdefault((id(node.inputs[0]), found[0]), []).append((*found[1:], node))
    made = 0
    for (_, axis), members in groups.items():
        members.sort(key=lambda m: m[:2])
        ends = [end for _, end, _ in members]
        starts = [start for start, _, _ in members]
        size = dims(members[0][2].inputs[0])[axis]
        if len(members) < 2 or starts != [0, *ends[:-1]] or ends[-1] != size:
            continue
        if any(start == end for start, end, _ in members):
            continue
        widths = np.array([end - start for start, end, _ in members], np.int64)
        nodes = [node for _, _, node in members]
        sizes = add_initializer(graph, "split_sizes", widths)
        split = ir.node(
            "Split", [nodes[0].inputs[0], sizes], {"axis": axis}, num_outputs=len(nodes)
        )
        graph.insert_before(min(nodes, key=list(graph).index), split)
        for node, out in zip(nodes, split.outputs, strict=True):
            out.type, out.shape = node.outputs[0].type, node.outputs[0].shape
            replace_output(graph, node.outputs[0], out)
            graph.remove(node, safe=True)
        made += 1
    return made


def with_shapes(graph: ir.Graph) -> int:
    """Apply :func:`fold_known_sizes` and :func:`drop_whole_slices` to ``graph`` in place, once
    its values carry the shapes inference gives (:class:`fusion.FillShapes`); return how many
    rewrites were made. Exact wherever those shapes are (the named symbols of the model's inputs
    are taken as their values, as everywhere in the passes)."""
    return fold_known_sizes(graph) + drop_whole_slices(graph)


def fold_known_sizes(graph: ir.Graph) -> int:
    """Replace each ``Gather(Shape(x), i)`` (constant ``i``, a scalar or a vector; ``Shape``'s
    ``start``/``end`` honoured) whose dimensions of ``x`` are numbers by a constant: the
    TorchScript exporter's ``x.shape[-1] // 2`` of the rotary embedding, which onnxscript's
    folder leaves (it folds vector indices only); return how many."""
    folded = 0
    for node in list(graph):
        if node.op_type != "Gather" or node.domain != "" or node.graph is not graph:
            continue
        shape = producer(node.inputs[0], "Shape")
        index = const_array(node.inputs[1])
        sizes = dims(shape.inputs[0]) if shape is not None else None
        if sizes is None or index is None or index.ndim > 1 or node.attributes.get_int("axis", 0):
            continue
        start = shape.attributes.get_int("start", 0)
        sizes = sizes[start : shape.attributes.get_int("end", len(sizes))]
        if not all(-len(sizes) <= i < len(sizes) for i in index.reshape(-1)):
            continue
        picked = [sizes[int(i)] for i in index.reshape(-1)]
        if not all(isinstance(d, int) for d in picked) or node.outputs[0].is_graph_output():
            continue
        array = np.array(picked, np.int64).reshape(index.shape)
        node.outputs[0].replace_all_uses_with(add_initializer(graph, "known_size", array))
        graph.remove(node, safe=True)
        folded += 1
    return folded


def drop_whole_slices(graph: ir.Graph) -> int:
    """Read ``x`` for each Slice of ``x`` with steps of 1 whose result has ``x``'s shape
    (provably, :func:`fusion._ir.same_shape`): with step 1 a slice as long as its axis starts at
    0 and ends at its end (Operators.md, Slice-13, the bounds clamped), whatever its bounds
    compute to (transformers' ``causal_mask[:, :, :, : key.shape[-2]]`` of a mask as long as the
    keys); return how many."""
    dropped = 0
    for node in list(graph):
        if node.op_type != "Slice" or node.domain != "" or node.graph is not graph:
            continue
        steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
        if len(node.inputs) > 4 and node.inputs[4] is not None and steps is None:
            continue
        whole = dims(node.inputs[0]), dims(node.outputs[0])
        if steps is not None and (steps != 1).any() or None in whole:
            continue
        if not same_shape(*whole) or node.outputs[0].is_graph_output():
            continue
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)
        dropped += 1
    return dropped
