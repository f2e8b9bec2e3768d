"""A decoder's attention with a KV cache or a run-time mask as ONNX's own ``Attention`` and
``RotaryEmbedding`` (opset 23), where :mod:`fusion.fuse_gqa` would otherwise put
``GroupQueryAttention`` behind an ``If`` (:mod:`.guard`): the opset raise (:func:`upgrade`), the
mask as the op takes it (:func:`bias`, :func:`attention_mask`) and the rewrite
(:func:`rewrite`). Why it is exact (rows masked everywhere, float32's lowest): see
docs/fusions/fuse_gqa.md.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript.version_converter import ConvertVersionPass

from fusion._ir import (
    add_initializer,
    opset_version,
    producer,
    remove_nodes,
    replace_output,
    scalar_const,
)
from fusion.fuse_gqa import build

#: The ai.onnx opset of ``Attention`` and ``RotaryEmbedding``.
OPSET = 23

#: The lowest opset onnxscript's version converter converts from.
_CONVERTIBLE = 18

#: float32's lowest, which ONNX Runtime's ``Attention`` kernel takes in a mask as ``-inf``; and
#: the next float32 above it, which it does not (:func:`bias`).
LOWEST = float(np.finfo(np.float32).min)
ABOVE_LOWEST = float(np.nextafter(np.float32(LOWEST), np.float32(0)))


def convertible(model: ir.Model) -> bool:
    """Whether ``model``'s ai.onnx opset is 23 or above, or can be raised to it
    (:func:`upgrade`)."""
    return opset_version(model) >= _CONVERTIBLE


def upgrade(model: ir.Model) -> None:
    """Raise ``model``'s ai.onnx opset to :data:`OPSET` in place, where it is below, with
    onnxscript's ``ConvertVersionPass`` (its adapters rewrite the ops whose meaning changed)."""
    if opset_version(model) >= OPSET:
        return

    ConvertVersionPass(OPSET, fallback=False)(model)


def bias(mask: ir.Value | None, nan_guard: bool) -> str | None:
    """How ``Attention`` takes the model's run-time additive ``mask``: ``"as is"`` (also where
    there is none), ``"raised"`` where its masked value float32's lowest becomes the next
    float32 above, or None where it cannot (the ``If`` stays); why:
    docs/fusions/fuse_gqa.md. ``nan_guard``: the model maps NaN attention
    weights to 0."""
    if mask is None:
        return "as is"
    where = producer(mask, "Where")
    if where is None:
        return None
    values = [scalar_const(v) for v in where.inputs[1:]]
    if any(v is None or math.isnan(v) or v == math.inf for v in values):
        return None
    if -math.inf in values:
        return "as is" if nan_guard and values.count(-math.inf) == 1 else None
    return "raised" if LOWEST in values else "as is"


def attention_mask(graph: ir.Graph, mask: ir.Value, how: str, shared: dict) -> ir.Value:
    """``mask`` as ``Attention`` takes it (:func:`bias`), a new Where where a value is raised,
    made once per mask and kept in ``shared``."""
    if how != "raised":
        return mask
    key = ("standard_mask", id(mask))
    if key not in shared:
        where = producer(mask, "Where")
        values = []
        for value in where.inputs[1:]:
            if scalar_const(value) == LOWEST:
                above = np.array(ABOVE_LOWEST, np.float32)
                value = add_initializer(graph, "attention_masked", above)
            values.append(value)
        node = ir.node("Where", [where.inputs[0], *values])
        node.outputs[0].type, node.outputs[0].shape = mask.type, mask.shape
        graph.insert_after(where, node)
        shared[key] = node.outputs[0]
    return shared[key]


def rewrite(graph: ir.Graph, match, anchor: ir.Node, how: str, shared: dict) -> str:
    """Replace ``match`` (a :class:`fusion.fuse_gqa.GQAMatch`) by ``RotaryEmbedding`` of the
    query and the key and one ``Attention`` (docs/fusions/fuse_gqa.md) before
    ``anchor``, the last matched node; ``how`` from :func:`bias`. Layers of the same sizes and
    tables share the positions and caches, kept in ``shared``."""
    name = anchor.name or "attention"
    inserted: list[ir.Node] = []
    heads = (match.query, match.key, match.value)
    flat = [build.flat(graph, h, inserted) for h in heads]
    projected = build.projected(graph, flat, inserted, OPSET) if match.past is not None else None
    if projected is not None:  # a decode step: one MatMul, not three
        flat = projected[1]
    if match.tables is not None:
        rotation = _rotation(graph, match, flat[0], inserted, shared)
        for index, h in enumerate(heads[:2]):
            rotary = ir.node("RotaryEmbedding", [flat[index], *rotation], {"num_heads": h.count})
            rotary.outputs[0].type, rotary.outputs[0].shape = flat[index].type, flat[index].shape
            inserted.append(rotary)
            flat[index] = rotary.outputs[0]
    attn_mask = attention_mask(graph, match.bias, how, shared) if match.bias is not None else None
    past = match.past or (None,) * 4
    outputs = [match.output, *past[2:]] if match.past is not None else [match.output]
    attributes = {
        "q_num_heads": match.query.count,
        "kv_num_heads": match.key.count,
        "scale": match.scale,
        "is_causal": int(match.causal),
    }
    if match.softcap:
        attributes["softcap"] = match.softcap
    inputs = [*flat, attn_mask, *past[:2]] if match.past is not None else [*flat, attn_mask]
    fused = ir.node(
        "Attention", inputs, attributes, num_outputs=len(outputs), name=f"{name}_Attention"
    )
    graph.insert_before(anchor, [*inserted, fused])
    for old, new in zip(outputs, fused.outputs, strict=True):
        replace_output(graph, old, new)
    remove_nodes(graph, match.nodes[::-1])
    rotated = " and RotaryEmbedding" if match.tables is not None else ""
    return f"Attention{rotated} (opset {OPSET}, " + ("KV cache)" if match.past else "mask)")


def _rotation(
    graph: ir.Graph, match, query: ir.Value, inserted: list[ir.Node], shared: dict
) -> list[ir.Value]:
    """``RotaryEmbedding``'s ``[cos_cache, sin_cache, position_ids]`` for the ``(B, S, .)``
    ``query``: for the model's run-time tables, their rows for the call expanded to the batch,
    ``(B, S, H/2)`` (no ``position_ids``: the fewest nodes); for constant tables, the
    ``(positions, H/2)`` caches at ``position_ids = 0 .. S-1``."""
    size = match.query.size
    if not isinstance(match.tables[0], np.ndarray):
        batch = build.batch(graph, query, inserted, shared)
        return build.caches(graph, match.tables, size, inserted, shared, batch)
    read = build.sizes(graph, query, None, inserted, shared)
    caches = build.caches(graph, match.tables, size, inserted, shared)
    return [*caches, build.position_ids(graph, read, inserted, shared)]
