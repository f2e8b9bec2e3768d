"""The pieces of a decoder's attention as the exporters write them, traced back from the
attention's Softmax: what :mod:`fusion.fuse_gqa` fuses. Each function takes a value of the graph
and returns what it is made of, or None when it is not that piece: :func:`heads`,
:func:`rotary`, :func:`repeat_kv`, :func:`with_past`, :func:`transposed_key`, and the rotary
tables (:func:`tables`). Shapes are named as transformers' attention names them: ``B`` batch,
``S`` query length, ``T`` key length, ``N`` query heads, ``K`` key/value heads, ``H`` head size.

Each piece's form and its math: see docs/fusions/fuse_gqa.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    const_array,
    dims,
    other_input,
    producer,
    same_dim,
    same_shape,
    scalar_const,
)
from fusion.base import CannotFuse, Code


@dataclasses.dataclass
class Heads:
    """A ``(B, n, L, H)`` tensor of heads and where it comes from.

    Attributes:
        split: ``y``, the ``(B, L, n, H)`` value transposed into heads.
        count: ``n``, the number of heads.
        size: ``H``, the head size.
        nodes: the nodes between ``y`` and the heads (the Transpose, and the rotary embedding or
            the repetition when traced through them).
    """

    split: ir.Value
    count: int
    size: int
    nodes: list[ir.Node]


def heads(value: ir.Value) -> Heads | None:
    """``value`` as ``Transpose(y, perm=[0, 2, 1, 3])`` of a rank-4 ``y`` whose head count and
    head size (axes 2 and 3) are known numbers, or None."""
    transpose = producer(value, "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", ())) != [0, 2, 1, 3]:
        return None
    split = dims(transpose.inputs[0])
    if split is None or len(split) != 4 or not all(isinstance(d, int) for d in split[2:]):
        return None
    return Heads(transpose.inputs[0], split[2], split[3], [transpose])


@dataclasses.dataclass
class Rotary:
    """A rotary embedding ``x * cos + rotate_half(x) * sin``
    (docs/fusions/fuse_gqa.md).

    Attributes:
        x: the heads rotated, ``(B, n, L, H)``.
        cos, sin: the values multiplied (broadcast to ``x``).
        nodes: the embedding's nodes (Mul, Mul, Add, Concat, Neg, Slice, Slice).
    """

    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    nodes: list[ir.Node]


def slice_last(node: ir.Node | None, rank: int) -> tuple[int, int] | None:
    """``(start, end)`` of a Slice of step 1 along the last of ``rank`` axes, or None."""
    if node is None or node.op_type != "Slice" or len(node.inputs) < 4:
        return None
    parts = [const_array(v) for v in node.inputs[1:]]
    if any(p is None or p.size != 1 for p in parts):
        return None
    start, end, axis = (int(p.reshape(-1)[0]) for p in parts[:3])
    step = int(parts[3].reshape(-1)[0]) if len(parts) > 3 else 1
    return (start, end) if step == 1 and axis in (-1, rank - 1) else None


def _rotate_half(value: ir.Value, x: ir.Value, head_size: int) -> list[ir.Node] | None:
    """The nodes of ``Concat(Neg(x[..., H/2:]), x[..., :H/2], axis=-1)`` when ``value`` is that
    of ``x``, else None."""
    concat = producer(value, "Concat")
    if (
        concat is None
        or len(concat.inputs) != 2
        or concat.attributes.get_int("axis")
        not in (
            -1,
            3,
        )
    ):
        return None
    neg = producer(concat.inputs[0], "Neg")
    upper = neg.inputs[0].producer() if neg is not None else None
    lower = concat.inputs[1].producer()
    half = head_size // 2
    if head_size % 2 or upper is None or lower is None:
        return None
    if upper.inputs[0] is not x or lower.inputs[0] is not x:
        return None
    up, low = slice_last(upper, 4), slice_last(lower, 4)
    if up is None or low is None or up[0] != half or up[1] < head_size or low != (0, half):
        return None
    return [concat, neg, upper, lower]


def rotary(value: ir.Value, head_size: int) -> Rotary | None:
    """``value`` as a rotary embedding of a ``(B, n, L, head_size)`` tensor, or None."""
    add = producer(value, "Add")
    if add is None:
        return None
    products = [producer(v, "Mul") for v in add.inputs]
    if None in products:
        return None
    for plain, rotated in (products, products[::-1]):
        for x, cos in (plain.inputs, plain.inputs[::-1]):
            for half, sin in (rotated.inputs, rotated.inputs[::-1]):
                nodes = _rotate_half(half, x, head_size)
                if nodes is not None:
                    return Rotary(x, cos, sin, [add, plain, rotated, *nodes])
    return None


def repeat_kv(value: ir.Value) -> tuple[ir.Value, int, list[ir.Node]] | None:
    """``(x, r, nodes)`` when ``value`` is ``x`` of shape ``(B, K, T, H)`` with each head
    repeated ``r`` times (see docs/fusions/fuse_gqa.md): ``(B, K * r, T, H)``, or the
    ``(B, K, r, T, H)`` Expand before its Reshape (which the dynamo exporter merges into the
    Reshape of :func:`transposed_key`); else None."""
    reshape = producer(value, "Reshape")
    expand = producer(reshape.inputs[0] if reshape is not None else value, "Expand")
    if expand is None:
        return None
    expanded_input, slices = whole_slices(expand.inputs[0])
    unsqueeze = producer(expanded_input, "Unsqueeze")
    if unsqueeze is None or len(unsqueeze.inputs) < 2:
        return None
    axes = const_array(unsqueeze.inputs[1])
    x, more = whole_slices(unsqueeze.inputs[0])
    slices += more
    source, expanded = dims(x), dims(expand.outputs[0])
    if axes is None or axes.reshape(-1).tolist() != [2] or None in (source, expanded):
        return None
    if (
        len(source) != 4
        or len(expanded) != 5
        or not same_shape(expanded[:2] + expanded[3:], source)
    ):
        return None
    repeats = expanded[2]
    if not isinstance(repeats, int) or not isinstance(source[1], int):
        return None
    if reshape is None:
        return x, repeats, [expand, unsqueeze, *slices]
    out = dims(value)
    if out is None or not same_shape(out, [source[0], source[1] * repeats, *source[2:]]):
        return None
    return x, repeats, [reshape, expand, unsqueeze, *slices]


#: A Slice end at least this takes every element to the end of its axis (torch writes
#: ``x[:, :]`` with INT64_MAX).
_TO_THE_END = 2**62


def whole_slices(value: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """``(x, slices)``: ``value`` traced back through Slices of step 1 from 0 to the end of their
    axes (no-ops, which the dynamo exporter writes around ``repeat_kv`` of a symbolic-length
    model); ``(value, [])`` where there are none."""
    slices: list[ir.Node] = []
    while (node := producer(value, "Slice")) is not None and len(node.inputs) >= 3:
        parts = [const_array(v) for v in node.inputs[1:]]
        if any(p is None for p in parts):
            break
        starts, ends = parts[0].reshape(-1), parts[1].reshape(-1)
        steps = parts[3].reshape(-1) if len(parts) > 3 else np.ones_like(starts)
        if (starts != 0).any() or (ends < _TO_THE_END).any() or (steps != 1).any():
            break
        slices.append(node)
        value = node.inputs[0]
    return value, slices


def with_past(value: ir.Value) -> tuple[ir.Value, ir.Value | None, list[ir.Node]]:
    """``(new, past, [concat])`` when ``value`` is ``Concat(past, new)`` along axis 2 of two
    rank-4 values (a layer's KV cache and the new heads); ``(value, None, [])`` otherwise."""
    concat = producer(value, "Concat")
    if (
        concat is None
        or len(concat.inputs) != 2
        or concat.attributes.get_int("axis") not in (2, -2)
    ):
        return value, None, []
    past, new = concat.inputs
    if any(v is None or v.shape is None or len(v.shape) != 4 for v in (past, new)):
        return value, None, []
    return new, past, [concat]


def transposed_key(value: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(k, nodes)`` when ``value`` is ``k`` with its last two axes swapped: a rank-4 ``k``
    transposed, or the dynamo exporter's Reshape-Transpose-Reshape of a rank-4 ``k`` or of a
    rank-5 ``(B, K, r, T, H)`` one (:func:`repeat_kv`), its axes 1 and 2 merged."""
    transpose = producer(value, "Transpose")
    if transpose is not None:
        if list(transpose.attributes.get_ints("perm", ())) == [0, 1, 3, 2]:
            return transpose.inputs[0], [transpose]
        return None
    outer = producer(value, "Reshape")
    transpose = producer(outer.inputs[0], "Transpose") if outer is not None else None
    inner = producer(transpose.inputs[0], "Reshape") if transpose is not None else None
    if inner is None or list(transpose.attributes.get_ints("perm", ())) != [0, 2, 1]:
        return None
    key, folded, out = dims(inner.inputs[0]), dims(inner.outputs[0]), dims(value)
    if key is None or folded is None or out is None or len(folded) != 3 or len(out) != 4:
        return None
    if len(key) == 5 and all(isinstance(d, int) for d in key[1:3]):
        key = [key[0], key[1] * key[2], *key[3:]]
    if len(key) != 4 or not same_shape(out, [key[0], key[1], key[3], key[2]]):
        return None
    if not same_shape(folded[1:], key[2:]):
        return None
    return inner.inputs[0], [outer, transpose, inner]


def scaled(value: ir.Value) -> tuple[ir.Value, float, list[ir.Node]]:
    """``(x, c, nodes)`` for ``value = x * c`` or ``x / (1 / c)`` with ``c`` a scalar constant
    (repeatedly), ``(value, 1.0, [])`` when it is neither."""
    factor, nodes = 1.0, []
    while True:
        node = value.producer()
        if node is None or node.domain != "" or node.op_type not in ("Mul", "Div"):
            return value, factor, nodes
        consts = [scalar_const(v) for v in node.inputs]
        if node.op_type == "Mul" and any(c is not None for c in consts):
            index = 0 if consts[0] is not None else 1
            factor *= consts[index]
            value = other_input(node, node.inputs[index])
        elif node.op_type == "Div" and consts[1] is not None and consts[1] != 0:
            factor /= consts[1]
            value = node.inputs[0]
        else:
            return value, factor, nodes
        nodes.append(node)


def rotary_tables(cos: np.ndarray, sin: np.ndarray, head_size: int) -> tuple | None:
    """The ``(max_positions, H/2)`` cos and sin caches of GroupQueryAttention's rotary
    embedding that compute ``x * cos + rotate_half(x) * sin`` for the constant tables ``cos``,
    ``sin`` (broadcast ``(..., L, H)``, row ``i`` for position ``i``), or None where they
    cannot: a table that differs between batches or heads, or whose two halves differ
    (docs/fusions/fuse_gqa.md)."""
    tables = []
    for table in (cos, sin):
        if table.ndim < 2 or table.shape[-1] != head_size:
            return None
        rows = table.reshape(-1, *table.shape[-2:])
        if not (rows == rows[:1]).all():
            return None
        row = rows[0]
        half = head_size // 2
        if not np.array_equal(row[:, :half], row[:, half:]):
            return None
        tables.append(np.ascontiguousarray(row[:, :half], dtype=table.dtype))
    return tuple(tables)


#: Ops that map each element to one element and keep the axes: the way from ``cat(f, f)`` to
#: ``cos`` (transformers scales it by ``attention_scaling`` and casts it).
_ELEMENTWISE = ("Cos", "Sin", "Cast", "Neg", "Identity")


def runtime_chain(value: ir.Value) -> tuple[ir.Value, list[tuple[ir.Node, int]]] | None:
    """``(f, ops)`` where the run-time rotary ``cos`` or ``sin`` ``value`` is ``cat(f, f)`` on
    the last axis put through ``ops`` (elementwise ops and scalar factors, each with the index
    of its input on the way, in order from ``f``) and Unsqueezes of other axes (transformers'
    ``LlamaRotaryEmbedding``); None where it is not. So ``ops`` applied to ``f`` is the first
    half of ``value``'s rows."""
    ops: list[tuple[ir.Node, int]] = []
    while (node := value.producer()) is not None and node.domain == "":
        if node.op_type == "Concat":
            axis = node.attributes.get_int("axis")
            last = axis in (-1, len(dims(value) or ()) - 1)
            pair = len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]
            return (node.inputs[0], ops[::-1]) if last and pair else None
        if node.op_type in _ELEMENTWISE:
            ops.append((node, 0))
        elif node.op_type == "Mul" and any(scalar_const(v) is not None for v in node.inputs):
            ops.append((node, 0 if scalar_const(node.inputs[1]) is not None else 1))
        elif node.op_type == "Unsqueeze" and len(node.inputs) == 2:
            axes = const_array(node.inputs[1])
            rank = len(dims(node.outputs[0]) or ())
            if axes is None or rank == 0 or (axes.reshape(-1) % rank == rank - 1).any():
                return None
        else:
            return None
        value = node.inputs[0] if node.op_type != "Mul" else node.inputs[ops[-1][1]]
    return None


def runtime_table(value: ir.Value, heads: Heads) -> str | None:
    """How ``value``, a rotary ``cos`` or ``sin`` computed at run time, gives the rotation of
    each position of the ``(B, L, n, H)`` split ``heads``: ``"shared"``, one row per position
    alike for every batch row and head (its leading axes are 1); ``"per_batch"``, one row per
    position of each batch row (its first axis ``B``, the others 1: the model's
    ``position_ids``); None otherwise. Either way with equal halves (:func:`runtime_chain`)."""
    shape = dims(value)
    if shape is None or len(shape) < 2 or shape[-1] != heads.size:
        return None
    if not same_dim(shape[-2], dims(heads.split)[1]) or runtime_chain(value) is None:
        return None
    if all(d == 1 for d in shape[:-2]):
        return "shared"
    batch = len(shape) > 2 and shape[0] != 1 and same_dim(shape[0], dims(heads.split)[0])
    return "per_batch" if batch and all(d == 1 for d in shape[1:-2]) else None


def tables(q: Rotary | None, k: Rotary | None, heads: Heads):
    """The op's ``(cos_cache, sin_cache)`` for the rotations of ``q`` and ``k`` (arrays where
    the tables are constants; the model's own ``cos`` and ``sin`` values where they are computed
    at run time), None where neither is rotated.

    Raises:
        CannotFuse: one is rotated and the other is not, their tables differ, or the tables
            are not of the form the op computes.
    """
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise CannotFuse(Code.NOT_CONSTANT, "only one of the query and the key is rotated")
    arrays = [const_array(v) for v in (q.cos, q.sin, k.cos, k.sin)]
    runtime = all(a is None for a in arrays) and (q.cos, q.sin) == (k.cos, k.sin)
    if runtime and all(runtime_table(v, heads) for v in (q.cos, q.sin)):
        return q.cos, q.sin
    if any(a is None for a in arrays):
        raise CannotFuse(
            Code.NOT_CONSTANT,
            "the rotary cos/sin are computed at run time, other than as one row per position "
            "alike for every batch with equal halves",
        )
    if not (np.array_equal(arrays[0], arrays[2]) and np.array_equal(arrays[1], arrays[3])):
        raise CannotFuse(Code.NOT_CONSTANT, "the query and the key are rotated by other tables")
    tables = rotary_tables(arrays[0], arrays[1], heads.size)
    if tables is None:
        raise CannotFuse(
            Code.NOT_PER_CHANNEL,
            "the rotary tables differ between batches or heads, or their two halves differ: "
            "not the rotation GroupQueryAttention computes",
        )
    return tables
