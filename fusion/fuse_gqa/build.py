"""The inputs GroupQueryAttention takes that the model has in other forms: the projections
before their split into heads, and the sequence lengths (:mod:`fusion.fuse_gqa`)."""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, dims, producer, same_shape
from fusion.fuse_gqa import parts


def flat(graph: ir.Graph, heads: parts.Heads, inserted: list[ir.Node]) -> ir.Value:
    """The ``(B, L, n*H)`` value the op takes for ``heads``: the split's own input where it is
    one, else a Reshape of the split (appended to ``inserted``)."""
    split = heads.split
    width = heads.count * heads.size
    reshape = producer(split, "Reshape")
    source = dims(reshape.inputs[0]) if reshape is not None else None
    if source is not None and source[2:] == [width] and same_shape(source[:2], dims(split)[:2]):
        return reshape.inputs[0]
    shape = add_initializer(graph, "gqa_flat_shape", np.array([0, 0, width], np.int64))
    node = ir.node("Reshape", [split, shape])
    inserted.append(node)
    return node.outputs[0]


def lengths(
    graph: ir.Graph, query: ir.Value, inserted: list[ir.Node], shared: dict
) -> tuple[ir.Value, ir.Value]:
    """``(seqlens_k, total_sequence_length)`` for attention with no past: ``S - 1`` for each of
    the ``B`` rows (int32, ``(B,)``) and ``S`` (int32 scalar), from the shape of the
    ``(B, S, .)`` ``query`` (nodes appended to ``inserted``; the constant folder folds them
    where the shape is static). Layers whose queries have the same batch and length (numbers or
    named symbols) share the first one's, kept in ``shared``."""
    shape = dims(query)
    known = shape is not None and all(isinstance(d, int) or d.value is not None for d in shape[:2])
    key = ("lengths", *map(str, shape[:2])) if known else None
    if key in shared:
        return shared[key]
    const = functools.partial(add_initializer, graph)
    shape = ir.node("Shape", [query])
    batch = ir.node("Gather", [shape.outputs[0], const("gqa_batch_axis", np.array([0]))])
    length = ir.node("Gather", [shape.outputs[0], const("gqa_length_axis", np.array(1))])
    total = ir.node("Cast", [length.outputs[0]], {"to": int(ir.DataType.INT32)})
    last = ir.node("Sub", [total.outputs[0], const("gqa_one", np.array(1, np.int32))])
    seqlens = ir.node("Expand", [last.outputs[0], batch.outputs[0]])
    inserted += [shape, batch, length, total, last, seqlens]
    if key is not None:
        shared[key] = seqlens.outputs[0], total.outputs[0]
    return seqlens.outputs[0], total.outputs[0]


def caches(
    graph: ir.Graph, tables: tuple, size: int, inserted: list[ir.Node], shared: dict
) -> list[ir.Value]:
    """The op's ``cos_cache`` and ``sin_cache`` ``(positions, size/2)`` for ``tables``: the
    arrays as initializers, or for the model's run-time ``cos`` and ``sin`` values of one row
    per position (``(..., L, size)``) the first halves of the rows,
    ``Slice(Reshape(cos, (-1, size)), [0, size/2))`` (nodes appended to ``inserted``). Made
    once per pair of tables, kept in ``shared``."""
    cos, sin = tables
    constant = isinstance(cos, np.ndarray)
    key = (cos.tobytes(), sin.tobytes()) if constant else (id(cos), id(sin))
    if key in shared:
        return shared[key]
    if constant:
        shared[key] = [
            add_initializer(graph, f"gqa_{n}_cache", t)
            for n, t in zip(("cos", "sin"), tables, strict=True)
        ]
        return shared[key]
    rows = add_initializer(graph, "gqa_rows", np.array([-1, size], np.int64))
    bounds = [add_initializer(graph, "gqa_half", np.array([v])) for v in (0, size // 2)]
    axis = add_initializer(graph, "gqa_last_axis", np.array([1]))
    out = []
    for table in tables:
        reshape = ir.node("Reshape", [table, rows])
        half = ir.node("Slice", [reshape.outputs[0], *bounds, axis])
        inserted += [reshape, half]
        out.append(half.outputs[0])
    shared[key] = out
    return out


def packed(flat: list[ir.Value], widths: list[int]) -> ir.Value | None:
    """The ``(B, S, (N + 2K) * H)`` tensor the query, key and value were sliced from, in that
    order and back to back along the last axis (Phi-3's ``qkv_proj``), which the op takes as
    its packed ``query`` with no key and value; else None."""
    slices = [producer(v, "Slice") for v in flat]
    if None in slices or len({id(s.inputs[0]) for s in slices}) != 1:
        return None
    source = slices[0].inputs[0]
    shape = dims(source)
    if shape is None or len(shape) != 3 or shape[2] != sum(widths):
        return None
    start = 0
    for node, width in zip(slices, widths, strict=True):
        bounds = parts.slice_last(node, 3)
        if bounds is None or bounds[0] != start or min(bounds[1], shape[2]) != start + width:
            return None
        start += width
    return source
