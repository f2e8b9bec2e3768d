"""The query, key and value of a decoder's attention traced back from its two MatMuls to their
splits into heads, through the rotary embedding, ``repeat_kv`` and the KV cache's Concat
(:mod:`fusion.fuse_gqa`; the pieces are :mod:`.parts`; docs/fusions/fuse_gqa.md).
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import dims, same_dim
from fusion.base import CannotFuse, Code
from fusion.fuse_gqa import masks, parts


def _rotation(value: ir.Value) -> parts.Rotary | None:
    """``value`` as a rotary embedding of ``(B, n, L, H)`` heads of known ``H``, or None."""
    rank4 = value.shape is not None and len(value.shape) == 4
    size = value.shape[3] if rank4 else None
    return parts.rotary(value, size) if isinstance(size, int) else None


def _side(value: ir.Value, rotation: parts.Rotary | None) -> parts.Heads:
    """The heads behind ``value`` (behind its ``rotation`` where it has one).

    Raises:
        CannotFuse: ``value`` is not a split into heads of known size.
    """
    found = parts.heads(rotation.x if rotation else value)
    if found is None:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE, "the query, key or value is no split into heads of known count"
        )
    if rotation is not None:
        found.nodes += rotation.nodes
    return found


def _repeated(value: ir.Value) -> tuple[ir.Value, int, list[ir.Node]]:
    """``repeat_kv``'s input, its repeat count and nodes; ``(value, 1, [])`` where there is
    none."""
    found = parts.repeat_kv(value)
    return found if found is not None else (value, 1, [])


def heads_of(qk: ir.Node, pv: ir.Node, mask: ir.Value | None, opset: int):
    """The heads of ``Q @ K^T`` (``qk``) and of ``P @ V`` (``pv``) traced back to their splits:
    ``((query, key, value), (query's rotation, key's), other nodes, factor on Q @ K^T, past)``
    (``past`` from :func:`past_of`), or None where the key is not transposed.

    Heads that do not fit are refused only in a decoder's attention, the pass's candidate: one
    rotated, with a past, or whose additive ``mask`` (None: none; ``opset`` the model's) is
    causal (:func:`masks.causal`). Elsewhere (an encoder's cross-attention, whose keys are of
    another length) it is None: :mod:`fusion.fuse_attention`'s, and nothing to say here.

    Raises:
        CannotFuse: a decoder's attention with a split of unknown size, head counts that do not
            group, or a past not of the op's layout.
    """
    q_value, q_factor, q_nodes = parts.scaled(qk.inputs[0])
    k_value, k_factor, k_nodes = parts.scaled(qk.inputs[1])
    transposed = parts.transposed_key(k_value)
    if transposed is None:
        return None
    key4, key_nodes = transposed
    key4, k_repeats, repeat_k = _repeated(key4)
    value4, v_repeats, repeat_v = _repeated(pv.inputs[1])
    key4, past_key, concat_k = parts.with_past(key4)
    value4, past_value, concat_v = parts.with_past(value4)
    q_rot, k_rot = _rotation(q_value), _rotation(key4)
    try:
        query, key, value = _side(q_value, q_rot), _side(key4, k_rot), _side(value4, None)
        _check_heads(query, key, value, k_repeats, v_repeats)
        past = past_of(key, value, past_key, past_value, concat_k + concat_v)
    except CannotFuse:
        pasts = (past_key, past_value)
        if q_rot or k_rot or any(p is not None for p in pasts) or masks.causal(mask, opset):
            raise
        return None
    nodes = [*q_nodes, *k_nodes, *key_nodes, *repeat_k, *repeat_v, *concat_k, *concat_v]
    return (query, key, value), (q_rot, k_rot), nodes, q_factor * k_factor, past


def _check_heads(
    query: parts.Heads, key: parts.Heads, value: parts.Heads, k_repeats: int, v_repeats: int
) -> None:
    """Refuse heads that one op cannot take: the key's and the value's heads (each repeated
    ``k_repeats`` / ``v_repeats`` times by ``repeat_kv``) not grouping the query's, heads of
    other sizes, or keys or values not provably as many as the queries.

    Raises:
        CannotFuse: ``shape_mismatch``.
    """
    counts = (query.count, key.count, value.count)
    if key.count * k_repeats != query.count or (k_repeats, key.count) != (v_repeats, value.count):
        raise CannotFuse(Code.SHAPE_MISMATCH, f"head counts {counts} do not group")
    if not query.size == key.size == value.size:
        raise CannotFuse(Code.SHAPE_MISMATCH, "value heads of another size than the key's")
    lengths = [dims(h.split)[1] for h in (query, key, value)]
    if not all(same_dim(lengths[0], n) for n in lengths[1:]):
        raise CannotFuse(
            Code.SHAPE_MISMATCH,
            "keys or values not provably as many as the queries (a past, or cross-attention): "
            "the op without a past takes one length",
        )


def past_of(key: parts.Heads, value: parts.Heads, past_key, past_value, concats):
    """``(past key, past value, present key, present value)`` of a layer's KV cache
    (:func:`parts.with_past`), or None where it has none.

    Raises:
        CannotFuse: only one of the key and the value has a past, or a past not of the
            ``(B, K, P, H)`` layout the op takes.
    """
    if past_key is None and past_value is None:
        return None
    if past_key is None or past_value is None:
        raise CannotFuse(Code.SHAPE_MISMATCH, "only one of the key and the value has a past")
    for past, heads in ((past_key, key), (past_value, value)):
        shape, split = dims(past), dims(heads.split)
        if not (
            same_dim(shape[0], split[0]) and shape[1] == heads.count and shape[3] == heads.size
        ):
            raise CannotFuse(
                Code.SHAPE_MISMATCH, "a past key or value not of the layout (B, K, P, H)"
            )
    return past_key, past_value, concats[0].outputs[0], concats[1].outputs[0]
