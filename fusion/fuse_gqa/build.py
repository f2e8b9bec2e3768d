"""The inputs GroupQueryAttention takes that the model has in other forms: the projections
before their split into heads, the sequence lengths and the rotary caches
(:mod:`fusion.fuse_gqa`; docs/fusions/fuse_gqa.md).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, const_array, dims, producer, same_shape
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
    node.outputs[0].type = split.type
    node.outputs[0].shape = ir.Shape([*dims(split)[:2], width])
    inserted.append(node)
    return node.outputs[0]


def _key(kind: str, query: ir.Value, past: ir.Value | None) -> tuple | None:
    """``kind`` and the batch, the length (and the past's length) of ``query`` (and ``past``),
    where each is a number or a named symbol: layers with one key share what is made for it;
    None where a dimension has no name."""
    shape = [*dims(query)[:2], *(dims(past)[2:3] if past is not None else ())]
    if any(not isinstance(d, int) and d.value is None for d in shape):
        return None
    return (kind, *map(str, shape))


@dataclasses.dataclass
class Sizes:
    """The sizes of a call, read once from the ``(B, S, .)`` query and the ``(B, K, P, H)``
    past key: ``shape`` the query's shape (int64 ``(3,)``), ``batch`` ``[B]`` (int64 ``(1,)``),
    ``length`` ``S`` and ``total`` ``P + S`` (int64 scalars; ``total`` is ``length`` where
    there is no past), ``past`` ``P`` (int64 scalar, or None)."""

    shape: ir.Value
    batch: ir.Value
    length: ir.Value
    total: ir.Value
    past: ir.Value | None


def sizes(
    graph: ir.Graph, query: ir.Value, past: ir.Value | None, inserted: list[ir.Node], shared: dict
) -> Sizes:
    """:class:`Sizes` for ``query`` and ``past`` (nodes appended to ``inserted``), kept in
    ``shared`` for the layers whose dimensions are the same numbers or named symbols (else per
    pair of values): the lengths, the positions and the guard read them."""
    key = _key("sizes", query, past) or ("sizes", id(query), id(past))
    if key in shared:
        return shared[key]
    const = functools.partial(add_initializer, graph)
    shape = ir.node("Shape", [query])
    batch = ir.node("Gather", [shape.outputs[0], const("gqa_batch_axis", np.array([0]))])
    length = ir.node("Gather", [shape.outputs[0], const("gqa_length_axis", np.array(1))])
    inserted += [shape, batch, length]
    total, past_length = length, None
    if past is not None:
        past_shape = ir.node("Shape", [past])
        past_length = ir.node(
            "Gather", [past_shape.outputs[0], const("gqa_past_axis", np.array(2))]
        )
        total = ir.node("Add", [length.outputs[0], past_length.outputs[0]])
        inserted += [past_shape, past_length, total]
    shared[key] = Sizes(
        shape.outputs[0],
        batch.outputs[0],
        length.outputs[0],
        total.outputs[0],
        past_length.outputs[0] if past_length is not None else None,
    )
    return shared[key]


def batch(graph: ir.Graph, query: ir.Value, inserted: list[ir.Node], shared: dict) -> ir.Value:
    """``[B]`` (int64 ``(1,)``) of the ``(B, S, .)`` ``query``, one ``Shape(start=0, end=1)``
    (opset 15 and above) appended to ``inserted``; kept in ``shared`` for the layers whose batch
    is the same number or named symbol."""
    key = _key("batch", query, None)
    key = ("batch", key[1]) if key is not None else ("batch", id(query))
    if key not in shared:
        node = ir.node("Shape", [query], {"start": 0, "end": 1})
        inserted.append(node)
        shared[key] = node.outputs[0]
    return shared[key]


def lengths(
    graph: ir.Graph,
    query: ir.Value,
    past: ir.Value | None,
    inserted: list[ir.Node],
    shared: dict,
) -> tuple[ir.Value, ir.Value]:
    """``(seqlens_k, total_sequence_length)``: ``T - 1`` for each of the ``B`` rows (int32,
    ``(B,)``) and ``T`` (int32 scalar), where ``T = P + S`` for the ``(B, S, .)`` ``query`` and
    the ``(B, K, P, H)`` ``past`` key (``P = 0`` where there is none): every key is valid to the
    op, the model's mask masks (nodes appended to ``inserted``; the constant folder folds them
    where the shapes are static). Layers whose shapes have the same dimensions (numbers or
    named symbols) share the first one's, kept in ``shared``."""
    key = _key("lengths", query, past)
    if key in shared:
        return shared[key]
    read = sizes(graph, query, past, inserted, shared)
    one = add_initializer(graph, "gqa_one", np.array(1, np.int32))
    total = ir.node("Cast", [read.total], {"to": int(ir.DataType.INT32)})
    last = ir.node("Sub", [total.outputs[0], one])
    seqlens = ir.node("Expand", [last.outputs[0], read.batch])
    inserted += [total, last, seqlens]
    if key is not None:
        shared[key] = seqlens.outputs[0], total.outputs[0]
    return seqlens.outputs[0], total.outputs[0]


def positions(
    graph: ir.Graph,
    caches: list[ir.Value],
    half: int,
    read: Sizes,
    inserted: list[ir.Node],
    shared: dict,
) -> list[ir.Value]:
    """``[cos_cache, sin_cache, position_ids]`` for a call with a past: ``caches`` hold one
    ``(S, half)`` row per position of the call, so the ``(B, S)`` ``position_ids`` are
    ``0 .. S-1`` in every row, and the caches get ``T`` (``read.total``) rows of zeros below,
    never read (the CPU kernel wants at least ``T`` rows:
    docs/fusions/fuse_gqa.md). Nodes appended to ``inserted``; kept in
    ``shared`` per caches and sizes."""
    key = ("positions", *map(id, caches), id(read))
    if key in shared:
        return shared[key]
    ids = position_ids(graph, read, inserted, shared)
    const = functools.partial(add_initializer, graph)
    row_shape = ir.node("Reshape", [read.total, const("gqa_one_axis", np.array([1]))])
    padding_shape = ir.node(
        "Concat", [row_shape.outputs[0], const("gqa_half_width", np.array([half]))], {"axis": 0}
    )
    zero = ir.tensor(np.zeros(1, caches[0].dtype.numpy()))
    zeros = ir.node("ConstantOfShape", [padding_shape.outputs[0]], {"value": zero})
    padded = [ir.node("Concat", [c, zeros.outputs[0]], {"axis": 0}) for c in caches]
    inserted += [row_shape, padding_shape, zeros, *padded]
    shared[key] = [*(p.outputs[0] for p in padded), ids]
    return shared[key]


def position_ids(graph: ir.Graph, read: Sizes, inserted: list[ir.Node], shared: dict) -> ir.Value:
    """``0 .. S-1`` in each of the ``B`` rows (int64 ``(B, S)``) for the sizes ``read``: the
    positions of the call in caches of one row per position of the call. Nodes appended to
    ``inserted``; kept in ``shared`` per sizes."""
    key = ("position_ids", id(read))
    if key in shared:
        return shared[key]
    const = functools.partial(add_initializer, graph)
    size = ir.node(
        "Slice", [read.shape, const("gqa_zero", np.array([0])), const("gqa_two", np.array([2]))]
    )
    steps = ir.node(
        "Range", [const("gqa_start", np.array(0)), read.length, const("gqa_step", np.array(1))]
    )
    expand = ir.node("Expand", [steps.outputs[0], size.outputs[0]])
    inserted += [size, steps, expand]
    shared[key] = expand.outputs[0]
    return shared[key]


def caches(
    graph: ir.Graph,
    tables: tuple,
    size: int,
    inserted: list[ir.Node],
    shared: dict,
    batch: ir.Value | None = None,
) -> list[ir.Value]:
    """The op's ``cos_cache`` and ``sin_cache`` for ``tables``: the ``(positions, size/2)``
    arrays as initializers, or for the model's run-time ``cos`` and ``sin`` of one row per
    position, ``cat(f, f)`` put through elementwise ops (:func:`.parts.runtime_chain`), those
    ops applied to ``f``: the first halves of the rows, ``(S, size/2)``, or ``(B, S, size/2)``
    where ``batch`` (``[B]``, int64 ``(1,)``) is given (``RotaryEmbedding`` without
    ``position_ids``; the only form for tables of one row per batch row and position).
    Nodes appended to ``inserted``; made once per pair of tables (and batch), kept in
    ``shared``."""
    cos, sin = tables
    constant = isinstance(cos, np.ndarray)
    key = (cos.tobytes(), sin.tobytes()) if constant else (id(cos), id(sin), id(batch))
    if key in shared:
        return shared[key]
    if constant:
        shared[key] = [
            add_initializer(graph, f"gqa_{n}_cache", t)
            for n, t in zip(("cos", "sin"), tables, strict=True)
        ]
        return shared[key]
    out = []
    for table in tables:
        f, ops = parts.runtime_chain(table)
        rows = _rows(graph, f, size // 2, batch, inserted, shared)
        for node, index in ops:
            rows = _reapply(graph, node, index, rows, inserted)
        out.append(rows)
    shared[key] = out
    return out


def _rows(
    graph: ir.Graph,
    f: ir.Value,
    half: int,
    batch: ir.Value | None,
    inserted: list[ir.Node],
    shared: dict,
) -> ir.Value:
    """``f`` (``(1, .., 1, S, half)``) as ``(S, half)``, or expanded to ``(B, S, half)`` for
    ``batch``; an ``f`` of one row per batch row and position (``(B, 1, .., S, half)``) as
    ``(B, S, half)``. Made once per ``f`` and batch, kept in ``shared``."""
    key = ("rotary_rows", id(f), id(batch))
    if key in shared:
        return shared[key]
    shape = dims(f) or []
    per_batch = batch is not None and len(shape) > 2 and shape[0] != 1
    if per_batch:
        target = [0, -1, half]  # Reshape's 0: the batch as it is
    elif batch is None or len(shape) > 3:
        target = [-1, half]
    else:
        target = shape  # (S, half) or (1, S, half): Expand takes it as it is
    rows = f
    if len(target) != len(shape):
        value = add_initializer(graph, "gqa_rows", np.array(target, np.int64))
        reshape = ir.node("Reshape", [rows, value])
        inserted.append(reshape)
        rows = reshape.outputs[0]
    if batch is not None and not per_batch:
        ones = add_initializer(graph, "gqa_row_ones", np.array([1, 1], np.int64))
        target = ir.node("Concat", [batch, ones], {"axis": 0})
        expand = ir.node("Expand", [rows, target.outputs[0]])
        inserted += [target, expand]
        rows = expand.outputs[0]
    rows.type = f.type
    shared[key] = rows
    return rows


def _reapply(
    graph: ir.Graph, node: ir.Node, index: int, value: ir.Value, inserted: list[ir.Node]
) -> ir.Value:
    """A copy of the elementwise ``node`` with ``value`` as its input ``index`` (a scalar
    factor becomes a rank-0 initializer, so that it broadcasts to no new axis)."""
    inputs = list(node.inputs)
    inputs[index] = value
    other = inputs[1 - index] if node.op_type == "Mul" else None
    if other is not None and other.shape is not None and len(other.shape) > 0:
        scalar = const_array(other).reshape(())
        inputs[1 - index] = add_initializer(graph, "gqa_rotary_factor", scalar)
    attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
    copy = ir.Node("", node.op_type, inputs, attributes)
    copy.outputs[0].type = node.outputs[0].type
    inserted.append(copy)
    return copy.outputs[0]


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


def projected(
    graph: ir.Graph, flat: list[ir.Value], inserted: list[ir.Node], opset: int
) -> tuple[ir.Value, list[ir.Value]] | None:
    """One MatMul for the query, key and value projections ``x @ Wq``, ``x @ Wk``, ``x @ Wv``
    of one ``x`` by constant 2-D weights: ``x @ [Wq | Wk | Wv]`` (GroupQueryAttention's packed
    query, as onnxruntime-genai's builder writes it), then ``+ [bq | bk | bv]`` where each
    projection adds a constant bias over its columns (Qwen2's); returned with the three
    projections read back by one Split of it, which replace ``flat`` for every reader; or None
    (also below ai.onnx ``opset`` 13, whose Split takes no sizes as an input). The old MatMuls,
    Adds and weights are left unread for the clean-up. Appended to ``inserted``: the MatMul, the
    Add and the Split."""
    linears = [_linear(v) for v in flat]
    if opset < 13 or None in linears or len({id(m.inputs[0]) for m, _ in linears}) != 1:
        return None
    weights = [const_array(m.inputs[1]) for m, _ in linears]
    biases = [b for _, b in linears]
    if any(w is None or w.ndim != 2 for w in weights):
        return None
    if len({(w.shape[0], w.dtype) for w in weights}) != 1:
        return None
    if any(b is not None for b in biases) and not all(
        b is not None and b.shape == w.shape[1:] and b.dtype == w.dtype
        for b, w in zip(biases, weights, strict=True)
    ):
        return None
    packed = add_initializer(graph, "gqa_qkv_weight", np.concatenate(weights, axis=1))
    matmul = ir.node("MatMul", [linears[0][0].inputs[0], packed])
    nodes = [matmul]
    if biases[0] is not None:
        bias = add_initializer(graph, "gqa_qkv_bias", np.concatenate(biases))
        nodes.append(ir.node("Add", [matmul.outputs[0], bias]))
    shape = dims(flat[0])
    for node in nodes:
        node.outputs[0].type = flat[0].type
        node.outputs[0].shape = ir.Shape([*shape[:-1], packed.shape[1]])
    inserted += nodes
    qkv = nodes[-1].outputs[0]
    widths = add_initializer(graph, "gqa_qkv_widths", np.array([w.shape[1] for w in weights]))
    split = ir.node("Split", [qkv, widths], {"axis": -1}, num_outputs=3)
    for value, part in zip(flat, split.outputs, strict=True):
        part.type, part.shape = value.type, value.shape
        value.replace_all_uses_with(part)
    inserted.append(split)
    return qkv, list(split.outputs)


def _linear(value: ir.Value) -> tuple[ir.Node, np.ndarray | None] | None:
    """The MatMul of ``value = x @ W``, or of ``value = x @ W + b`` with ``b`` a constant
    (either operand order), with ``b`` (None without one); None for anything else."""
    add = producer(value, "Add")
    if add is None:
        matmul = producer(value, "MatMul")
        return None if matmul is None else (matmul, None)
    for product, bias in (add.inputs, add.inputs[::-1]):
        matmul, array = producer(product, "MatMul"), const_array(bias)
        if matmul is not None and array is not None:
            return matmul, array
    return None
