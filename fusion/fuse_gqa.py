"""Fuse a decoder's attention, with its rotary embedding, into ONNX Runtime's
``GroupQueryAttention`` (com.microsoft, ContribOperators.md).

The math
--------
Scaled dot-product attention (Vaswani et al., 2017, eq. 1) over ``N`` query heads that share
``K`` key/value heads, each ``N / K`` times (Ainslie et al., 2023, "GQA"), with the rotary
position embedding of RoFormer (Su et al., 2021) applied to the queries and keys::

    out = softmax(scale * rope(q) @ rope(k)^T + mask) @ v

``GroupQueryAttention`` computes this from the projections before they are split into heads
(``query (B, S, N*H)``, ``key`` and ``value (B, T, K*H)``): it splits them, rotates ``q`` and
``k`` with rows of its ``cos_cache`` / ``sin_cache`` (``do_rotary=1``), repeats the key/value
heads itself, and masks causally (``causal=1``) or adds ``attention_bias``.

What is fused, as transformers' ``LlamaAttention`` is exported by ``torch.onnx.export`` (dynamo
and TorchScript) and copied by Qwen2/3, Mistral and others (:mod:`fusion.gqa_match` for each
piece): ``Softmax(scale * Q @ K^T [+ mask])`` anchored at the Softmax, the NaN guard of the
dynamo export (``Where(IsNaN(p), 0, p)``: no row of the masks fused here is all masked, so no
NaN arises), ``@ V``, and the merge of the heads back into ``(B, S, N*H)``; ``Q`` a split into
heads, maybe rotated; ``K`` the same with its heads repeated; ``V`` likewise. The op runs in
float32 on ONNX Runtime's CPU provider; its CUDA kernel takes float16 and bfloat16 only, so the
pass is off for float32 CUDA runs (:func:`fusion.registry.provider_options`).

Exactness. The rotation is the op's own exactly when the model's ``cos`` and ``sin`` are
constant tables of one row per position, alike for every batch and head, whose two halves are
equal (``cat(freqs, freqs)``, as transformers builds them): then the op's caches are the first
halves, and a query at position ``i`` (there is no past: the positions are ``0 .. S-1``) reads
row ``i``, as the model does. The mask must be a constant (the exporters write a causal mask
of a fixed-size prompt as one): where it is 0 on and below the diagonal and masked above it
(``-inf``, or a value at most ``-1e30``: ``exp`` of it is 0 in float32 beside any score a model
makes, as transformers' ``finfo.min`` is), ``causal=1``; where it is all zeros, ``causal=0``;
another mask with no row all masked is passed as ``attention_bias`` with ``causal=0``. The
scale is the product of every scalar factor on ``Q``, ``K`` and the scores.

Left intact, with the reason in the report: a mask computed from the model's inputs (an
``attention_mask`` input, a KV cache: ``GroupQueryAttention`` masks by sequence lengths, not by
a tensor whose rows may be all masked), ``cos``/``sin`` computed at run time or not of that
form, only one of ``Q`` and ``K`` rotated, a rotated key read elsewhere (a ``present`` output),
a value head size other than the key's, and head counts that do not divide.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion import gqa_match
from fusion._ir import (
    add_initializer,
    const_array,
    escaping_value,
    label,
    opset_version,
    producer,
    remove_nodes,
    replace_output,
    scalar_const,
    sole_consumer,
)
from fusion.base import MS_DOMAIN, CannotFuse, Code, Kind, NodeFusionPass, Op

#: A mask entry at most this is "masked": ``exp(score + mask - max)`` is 0 in float32.
MASKED = -1e30


@dataclasses.dataclass
class GQAMatch:
    """One attention to fuse (see the module docstring).

    Attributes:
        query, key, value: the heads, traced back to their split (:class:`gqa_match.Heads`).
        scale: the factor on ``Q @ K^T``.
        tables: the op's ``(cos_cache, sin_cache)``, or None where nothing is rotated.
        causal: the op's ``causal``.
        bias: the op's ``attention_bias``, or None.
        output: the ``(B, S, N*H)`` value the op's output replaces.
        nodes: the nodes it replaces.
    """

    query: gqa_match.Heads
    key: gqa_match.Heads
    value: gqa_match.Heads
    scale: float
    tables: tuple[np.ndarray, np.ndarray] | None
    causal: bool
    bias: np.ndarray | None
    output: ir.Value
    nodes: list[ir.Node]


def _scores(softmax: ir.Node) -> tuple[ir.Node, ir.Value | None, float, list[ir.Node]] | None:
    """``(Q @ K^T MatMul, mask or None, factor, nodes)`` of the Softmax's input."""
    if softmax.attributes.get_int("axis", -1) not in (-1, 3):
        return None
    scores, mask, nodes = softmax.inputs[0], None, []
    add = producer(scores, "Add")
    if add is not None:
        sides = [i for i in (0, 1) if producer(gqa_match.scaled(add.inputs[i])[0], "MatMul")]
        if not sides:
            return None
        scores, mask, nodes = add.inputs[sides[0]], add.inputs[1 - sides[0]], [add]
    inner, factor, scaling = gqa_match.scaled(scores)
    matmul = producer(inner, "MatMul")
    if matmul is None:
        return None
    return matmul, mask, factor, [*nodes, *scaling, matmul]


def _weights_reader(softmax: ir.Node) -> tuple[ir.Node, list[ir.Node]] | None:
    """``(P @ V MatMul, guard nodes)``: the MatMul reading the Softmax's output, maybe through
    the dynamo exporter's ``Where(IsNaN(p), 0, p)``."""
    p = softmax.outputs[0]
    if p.is_graph_output():
        return None
    readers = {use.node.op_type: use.node for use in p.uses()}
    guard: list[ir.Node] = []
    if set(readers) == {"IsNaN", "Where"} and len(list(p.uses())) == 2:
        isnan, where = readers["IsNaN"], readers["Where"]
        if list(where.inputs) != [isnan.outputs[0], where.inputs[1], p]:
            return None
        if scalar_const(where.inputs[1]) != 0.0 or sole_consumer(isnan.outputs[0]) is not where:
            return None
        guard, p = [isnan, where], where.outputs[0]
    reader = sole_consumer(p)
    if reader is None or reader.op_type != "MatMul" or reader.inputs[0] is not p:
        return None
    return reader, guard


def _merged(attention: ir.Node, size: int) -> tuple[ir.Value, list[ir.Node]] | None:
    """The ``(B, S, size)`` value that merges the heads of ``attention``'s output back, and the
    Transpose and Reshape that do it (after a Reshape to the same shape, as Phi-3's export
    has)."""
    nodes: list[ir.Node] = []
    transpose = sole_consumer(attention.outputs[0])
    if transpose is not None and transpose.op_type == "Reshape":  # a view to the same shape
        shape = gqa_match.dims(transpose.outputs[0])
        if shape is None or shape != gqa_match.dims(attention.outputs[0]):
            return None
        nodes.append(transpose)
        transpose = sole_consumer(transpose.outputs[0])
    if transpose is None or transpose.op_type != "Transpose":
        return None
    if list(transpose.attributes.get_ints("perm", ())) != [0, 2, 1, 3]:
        return None
    reshape = sole_consumer(transpose.outputs[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    out = reshape.outputs[0]
    if out.shape is None or len(out.shape) != 3 or out.shape[2] != size:
        return None
    return out, [*nodes, transpose, reshape]


def _side(value: ir.Value, rotated: bool) -> tuple[gqa_match.Heads, gqa_match.Rotary | None]:
    """The heads behind ``value`` (rotated first when ``rotated``).

    Raises:
        CannotFuse: ``value`` is not a split into heads of known size.
    """
    rank4 = value.shape is not None and len(value.shape) == 4
    size = value.shape[3] if rank4 else None
    rotation = gqa_match.rotary(value, size) if rotated and isinstance(size, int) else None
    found = gqa_match.heads(rotation.x if rotation else value)
    if found is None:
        raise CannotFuse(Code.UNKNOWN_SHAPE, "a query, key or value that is no split into heads")
    if rotation is not None:
        found.nodes += rotation.nodes
    return found, rotation


def _repeated(value: ir.Value) -> tuple[ir.Value, int, list[ir.Node]]:
    """``repeat_kv``'s input, its repeat count and nodes; ``(value, 1, [])`` where there is
    none."""
    found = gqa_match.repeat_kv(value)
    return found if found is not None else (value, 1, [])


def _tables(q: gqa_match.Rotary | None, k: gqa_match.Rotary | None, size: int):
    """The op's ``(cos_cache, sin_cache)`` for the rotations of ``q`` and ``k``, None where
    neither is rotated.

    Raises:
        CannotFuse: one is rotated and the other is not, their tables differ, or the tables
            are not constants of the form the op computes.
    """
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise CannotFuse(Code.NOT_CONSTANT, "only one of the query and the key is rotated")
    arrays = [const_array(v) for v in (q.cos, q.sin, k.cos, k.sin)]
    if any(a is None for a in arrays):
        raise CannotFuse(
            Code.NOT_CONSTANT,
            "the rotary cos/sin are computed at run time (export with a fixed sequence length "
            "to make them constants)",
        )
    if not (np.array_equal(arrays[0], arrays[2]) and np.array_equal(arrays[1], arrays[3])):
        raise CannotFuse(Code.NOT_CONSTANT, "the query and the key are rotated by other tables")
    tables = gqa_match.rotary_tables(arrays[0], arrays[1], size)
    if tables is None:
        raise CannotFuse(
            Code.NOT_PER_CHANNEL,
            "the rotary tables differ between batches or heads, or their two halves differ: "
            "not the rotation GroupQueryAttention computes",
        )
    return tables


def _mask(mask: ir.Value | None, opset: int) -> tuple[bool, np.ndarray | None]:
    """``(causal, attention_bias)`` of the op for the model's additive ``mask``.

    Raises:
        CannotFuse: the mask is not a constant, or a row of it is all masked.
    """
    if mask is None:
        return False, None
    array = gqa_match.evaluate(mask, opset)
    if array is not None and 2 <= array.ndim <= 4:  # broadcast to the op's (B|1, N|1, S, T)
        array = array.reshape((1,) * (4 - array.ndim) + array.shape)
    if array is None or array.ndim != 4 or array.dtype != np.float32:
        raise CannotFuse(
            Code.NOT_CONSTANT,
            "the attention mask is computed from the model's inputs (an attention_mask input or "
            "a KV cache): GroupQueryAttention masks by sequence lengths",
        )
    masked = array <= MASKED
    if masked.all(axis=-1).any():
        raise CannotFuse(Code.SHAPE_MISMATCH, "a row of the attention mask is all masked")
    if not (masked | (array == 0)).all():
        return False, array
    rows, cols = array.shape[-2:]
    causal = np.triu(np.ones((rows, cols), bool), k=1 + cols - rows)
    if (masked == causal).all():
        return True, None
    return (False, None) if not masked.any() else (False, array)


class FuseGroupQueryAttention(NodeFusionPass):
    """Replace each decoder attention of the main graph by one ``GroupQueryAttention`` (see the
    module docstring); counted as ``"gqa_fused"``, refusals under ``"gqa"``.

    Runs for ``target="ort"``, by default or when ``optimize(gqa=True)``.
    """

    kinds = (Kind("gqa_fused", "gqa", (Op("GroupQueryAttention", MS_DOMAIN),), norm=False),)
    targets = ("ort",)
    option = "gqa"
    on_by_default = ("ort",)

    def match(self, model: ir.Model, node: ir.Node) -> GQAMatch | None:
        """The attention whose Softmax is ``node``, or None.

        Raises:
            CannotFuse: see the module docstring.
        """
        if node.op_type != "Softmax" or node.domain != "":
            return None
        scores, after = _scores(node), _weights_reader(node)
        if scores is None or after is None:
            return None
        qk, mask, factor, nodes = scores
        pv, guard = after
        q_value, q_factor, q_nodes = gqa_match.scaled(qk.inputs[0])
        k_value, k_factor, k_nodes = gqa_match.scaled(qk.inputs[1])
        transposed = gqa_match.transposed_key(k_value)
        if transposed is None:
            return None
        key4, key_nodes = transposed
        key4, k_repeats, repeat_k = _repeated(key4)
        value4, v_repeats, repeat_v = _repeated(pv.inputs[1])
        query, q_rot = _side(q_value, True)
        key, k_rot = _side(key4, True)
        value, _ = _side(value4, False)
        heads = (query.count, key.count, value.count)
        if key.count * k_repeats != query.count or (k_repeats, key.count) != (
            v_repeats,
            value.count,
        ):
            raise CannotFuse(Code.SHAPE_MISMATCH, f"head counts {heads} do not group")
        if not query.size == key.size == value.size:
            raise CannotFuse(Code.SHAPE_MISMATCH, "value heads of another size than the key's")
        merged = _merged(pv, query.count * query.size)
        if merged is None:
            return None
        output, merge = merged
        tables = _tables(q_rot, k_rot, query.size)
        causal, bias = _mask(mask, opset_version(model))
        matched = [node, *nodes, *q_nodes, *k_nodes, *key_nodes, *repeat_k, *repeat_v, *guard, pv]
        matched += [*query.nodes, *key.nodes, *value.nodes, *merge]
        if escaping_value(matched, output) is not None:
            raise CannotFuse(Code.SHARED_OUTPUT, "a value inside the attention is read elsewhere")
        scale = factor * q_factor * k_factor
        return GQAMatch(query, key, value, scale, tables, causal, bias, output, matched)

    def rewrite(self, model: ir.Model, match: GQAMatch) -> str:
        """Insert the op before the heads' merge, move the readers over, drop the old nodes."""
        graph = model.graph
        anchor = match.nodes[-1]
        name = label(match.nodes[0])
        inserted: list[ir.Node] = []
        flat = [_flat(graph, h, inserted) for h in (match.query, match.key, match.value)]
        seqlens, total = _lengths(graph, flat[0], inserted)
        inputs: list[ir.Value | None] = [*flat, None, None, seqlens, total]
        attributes = {
            "num_heads": match.query.count,
            "kv_num_heads": match.key.count,
            "scale": match.scale,
            "causal": int(match.causal),
        }
        if match.tables is not None:
            caches = [
                add_initializer(graph, f"{name}_{c}_cache", t)
                for c, t in zip(("cos", "sin"), match.tables, strict=True)
            ]
            inputs += caches
            attributes["do_rotary"] = 1
        if match.bias is not None:
            inputs += [None] * (10 - len(inputs)) + [
                add_initializer(graph, f"{name}_bias", match.bias)
            ]
        fused = ir.node(
            "GroupQueryAttention",
            inputs,
            attributes,
            domain=MS_DOMAIN,
            name=f"{name}_GroupQueryAttention",
        )
        graph.insert_before(anchor, [*inserted, fused])
        replace_output(graph, match.output, fused.outputs[0])
        fused.outputs[0].type = match.output.type
        remove_nodes(graph, match.nodes[::-1])
        return "GroupQueryAttention" + (" (rotary inside)" if match.tables is not None else "")


def _flat(graph: ir.Graph, heads: gqa_match.Heads, inserted: list[ir.Node]) -> ir.Value:
    """The ``(B, L, n*H)`` value the op takes for ``heads``: the split's own input where it is
    one, else a Reshape of the split (appended to ``inserted``)."""
    split = heads.split
    width = heads.count * heads.size
    reshape = producer(split, "Reshape")
    source = gqa_match.dims(reshape.inputs[0]) if reshape is not None else None
    if source is not None and source[2:] == [width] and source[:2] == gqa_match.dims(split)[:2]:
        return reshape.inputs[0]
    shape = add_initializer(graph, "gqa_flat_shape", np.array([0, 0, width], np.int64))
    node = ir.node("Reshape", [split, shape])
    inserted.append(node)
    return node.outputs[0]


def _lengths(
    graph: ir.Graph, query: ir.Value, inserted: list[ir.Node]
) -> tuple[ir.Value, ir.Value]:
    """``(seqlens_k, total_sequence_length)`` for attention with no past: ``S - 1`` for each of
    the ``B`` rows (int32, ``(B,)``) and ``S`` (int32 scalar), from the shape of the
    ``(B, S, .)`` ``query`` (nodes appended to ``inserted``; the constant folder folds them
    where the shape is static)."""

    def const(hint: str, array: np.ndarray) -> ir.Value:
        return add_initializer(graph, hint, array)

    shape = ir.node("Shape", [query])
    batch = ir.node("Gather", [shape.outputs[0], const("gqa_batch_axis", np.array([0]))])
    length = ir.node("Gather", [shape.outputs[0], const("gqa_length_axis", np.array(1))])
    total = ir.node("Cast", [length.outputs[0]], {"to": int(ir.DataType.INT32)})
    last = ir.node("Sub", [total.outputs[0], const("gqa_one", np.array(1, np.int32))])
    seqlens = ir.node("Expand", [last.outputs[0], batch.outputs[0]])
    inserted += [shape, batch, length, total, last, seqlens]
    return seqlens.outputs[0], total.outputs[0]
