"""Slices that tile an axis as one Split (:mod:`fusion.simplify`). See
docs/fusions/cleanup.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, const_array, dims, replace_output


def interval(node: ir.Node) -> tuple[int, int, int] | None:
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
    """Replace the Slices of one tensor whose intervals (:func:`interval`) tile one axis, each
    non-empty, by one Split of that axis (sizes as an input, opset 13); return how many Splits
    were made."""
    groups: dict[tuple, list] = {}
    for node in graph:
        found = interval(node)
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
