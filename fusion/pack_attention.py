"""Self-attention's three projections packed into ONNX Runtime's ``Attention`` (com.microsoft),
as :mod:`fusion.fuse_attention`'s last step (:func:`pack`). When it is exact, what is left as
it is, and the measurements: see docs/fusions/fuse_attention.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._dense import Dense, dense
from fusion._ir import add_initializer, const_array, dims, producer, replace_output
from fusion.base import MS_DOMAIN
from fusion.fuse_gqa import parts

#: MultiHeadAttention's attributes that Attention has, with the same meaning.
_SHARED_ATTRIBUTES = ("num_heads", "scale", "mask_filter_value", "unidirectional")


def _projection(value: ir.Value | None, heads: int | None) -> Dense | None:
    """``value`` as ``x @ W (+ b)`` (:func:`fusion._dense.dense`), or, where ``heads`` is given
    and ``value`` is rank 4, as that split into ``heads`` heads (``Transpose(Reshape(x @ W + b,
    (B, S, heads, H)), [0, 2, 1, 3])``); None otherwise."""
    if value is None:
        return None
    shape = dims(value)
    if heads is not None and shape is not None and len(shape) == 4:
        split = parts.heads(value)  # Transpose(., [0, 2, 1, 3]) of (B, L, n, H), n, H known
        reshape = producer(split.split, "Reshape") if split is not None else None
        if reshape is None or split.count != heads:
            return None
        value = reshape.inputs[0]
        if (dims(value) or [None])[-1] != heads * split.size:
            return None
    return dense(value)


def pack(graph: ir.Graph, mha: ir.Node) -> bool:
    """Replace the MultiHeadAttention ``mha`` by ``Attention`` where its query, key and value
    are projections of one input (see docs/fusions/fuse_attention.md); return whether it did.
    The new node takes over ``mha``'s ``meta``; the projections left unread go with the
    clean-up."""
    inputs = list(mha.inputs) + [None] * (8 - len(mha.inputs))
    if any(inputs[i] is not None for i in (4, 6, 7)) or any(
        o.uses() or o.is_graph_output() for o in mha.outputs[1:]
    ):
        return False
    heads = mha.attributes.get_int("num_heads")
    parts = [_projection(inputs[0], None), *(_projection(inputs[i], heads) for i in (1, 2))]
    if None in parts or len({id(p.x) for p in parts}) != 1:
        return False
    widths = {p.weight.shape for p in parts}
    if len(widths) != 1 or len({p.weight.dtype for p in parts}) != 1:
        return False
    width = parts[0].weight.shape[1]
    packed_bias = const_array(inputs[3]) if inputs[3] is not None else None
    if inputs[3] is not None:
        if packed_bias is None or packed_bias.shape != (3 * width,):
            return False
        if any(p.bias is not None for p in parts):
            return False
    else:
        zero = np.zeros(width, parts[0].weight.dtype)
        packed_bias = np.concatenate([p.bias if p.bias is not None else zero for p in parts])
    name = mha.name or "attention"
    weight = add_initializer(
        graph, f"{name}_qkv_weight", np.concatenate([p.weight for p in parts], axis=1)
    )
    bias = add_initializer(graph, f"{name}_qkv_bias", packed_bias.astype(parts[0].weight.dtype))
    attributes = {k: a.value for k, a in mha.attributes.items() if k in _SHARED_ATTRIBUTES}
    node = ir.node(
        "Attention",
        [parts[0].x, weight, bias, None, None, inputs[5]],
        attributes,
        domain=MS_DOMAIN,
        name=f"{name}_packed",
    )
    node.meta.update(mha.meta)
    graph.insert_before(mha, node)
    replace_output(graph, mha.outputs[0], node.outputs[0])
    graph.remove(mha, safe=True)
    return True
