"""The nodes the rewrite of :mod:`fusion.fuse_sdpa` inserts: ``Attention``, the Transposes of
its key and value where they are needed, and its ``attn_mask`` (:mod:`.masks`). See
docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    add_initializer,
    dims,
    drop_if_unused,
    label,
    remove_nodes,
    replace_output,
)
from fusion.fuse_gqa import standard
from fusion.fuse_sdpa import core, layout
from fusion.fuse_sdpa.masks import Mask, View


def rewrite(graph: ir.Graph, match, shared: dict) -> str:
    """Insert ``Attention`` for ``match`` (a :class:`fusion.fuse_sdpa.SDPAMatch`), with the
    Transposes and the mask it needs, before the weights' product; move the readers over; drop
    the old nodes. Return what it became."""
    inserted: list[ir.Node] = []
    key, value = (operand(o, inserted, graph) for o in (match.key, match.value))
    inputs = [
        _lifted(graph, v, count, inserted)
        for v, count in zip((match.query, key, value), match.lifts, strict=True)
    ]
    if match.perm is not None:
        inverse = core.Operand(inputs[2], core.inverse(match.perm))
        inputs[2] = operand(inverse, inserted, graph)
    if match.heads is not None:
        inputs[0] = _scaled_query(graph, match.query, match.heads, inserted)
    attributes = {"scale": match.scale}
    if match.rank == 3:
        attributes |= {"q_num_heads": 1, "kv_num_heads": 1}
    merged = _three_d(graph, match, inputs, inserted, attributes)
    if match.mask is not None:
        inputs.append(attn_mask(graph, match.mask, inputs[0], inputs[1], inserted, shared))
    fused = ir.node("Attention", inputs, attributes, name=f"{label(match.softmax)}_Attention")
    inserted.append(fused)
    out = fused.outputs[0]
    if match.transposed:
        out = operand(core.Operand(out, core.swap(match.rank)), inserted, graph)
    if match.perm is not None:
        out = operand(core.Operand(out, match.perm), inserted, graph)
    graph.insert_before(match.nodes[-1], inserted)
    if merged is None:
        out.type = match.output.type
        replace_output(graph, match.output, out)
    else:
        out.dtype, y = match.output.dtype, dims(match.output)
        if isinstance(y[1], int) and isinstance(y[3], int):
            out.shape = ir.Shape([y[0], y[2], y[1] * y[3]])
        for reshape in merged:
            reshape.replace_input_with(0, out)
        _drop_unread(graph, [use.node for use in match.output.uses()])
    remove_nodes(graph, match.nodes[::-1])
    _drop_unread(graph, match.side)
    return f"Attention (opset {standard.OPSET})"


def _lifted(graph: ir.Graph, value: ir.Value, count: int, inserted: list[ir.Node]) -> ir.Value:
    """``value`` with ``count`` leading axes of size 1 (an ``Unsqueeze`` appended to
    ``inserted``; ``value`` itself for none): a 3-D operand of a 4-D attention as the model's
    MatMuls broadcast it."""
    if count == 0:
        return value
    axes = add_initializer(graph, "attn_lift_axes", np.arange(count, dtype=np.int64))
    unsqueeze = ir.node("Unsqueeze", [value, axes])
    out = unsqueeze.outputs[0]
    shape = dims(value)
    if shape is not None:
        out.shape = ir.Shape([1] * count + shape)
    out.dtype = value.dtype
    inserted.append(unsqueeze)
    return out


def _scaled_query(
    graph: ir.Graph, query: ir.Value, heads: np.ndarray, inserted: list[ir.Node]
) -> ir.Value:
    """``Mul(query, heads)``, appended to ``inserted``: the scale of each head on the scores
    (float64, 1 in every axis but the heads', :func:`.scales.per_head`) moved into ``Q``, in
    float32 (docs/fusions/fuse_sdpa.md); the op's ``scale`` is then the rest of the scale, one
    number. ``Q`` is then no view of the projections: the 4-D form."""
    scale = add_initializer(graph, "attn_head_scale", heads.astype(np.float32))
    mul = ir.node("Mul", [query, scale])
    out = mul.outputs[0]
    out.shape, out.dtype = ir.Shape(dims(query)), query.dtype
    inserted.append(mul)
    return out


def _three_d(
    graph: ir.Graph, match, inputs: list[ir.Value], inserted: list[ir.Node], attributes: dict
) -> list[ir.Node] | None:
    """Where ``Q``, ``K``, ``V`` are all views of the tensors before their split into heads and
    the output's heads are merged back (:mod:`.layout`), put those tensors in ``inputs`` (the
    4-D views' new nodes out of ``inserted``, their other nodes to ``match.side``), the head
    counts in ``attributes``, and return the Reshapes that merge the output's heads, to read
    the 3-D output instead; else None."""
    if match.rank != 4 or match.transposed or match.perm is not None:
        return None
    views = [layout.of(v) for v in inputs]
    merged = layout.merged_readers(match.output)
    if merged is None or any(v is None for v in views):
        return None
    for node in [n for n in inserted if n.outputs[0] in inputs]:  # a 4-D view made above
        inserted.remove(node)
        sources = list(node.inputs)
        for index in range(len(sources)):
            node.replace_input_with(index, None)
        for value in sources:
            drop_if_unused(graph, value)
    inputs[:] = [layout.source(v, graph, inserted) for v in views]
    attributes |= {"q_num_heads": views[0].heads, "kv_num_heads": views[1].heads}
    # the views of one packed projection share its nodes: each once
    match.side += [
        n for n in dict.fromkeys(n for v in views for n in v.nodes) if n not in match.side
    ]
    return merged


def operand(found: core.Operand, inserted: list[ir.Node], graph: ir.Graph) -> ir.Value:
    """``found`` as a value: its source, or a new Transpose or Reshape of it (appended to
    ``inserted``; the Reshape's shape an initializer of ``graph``)."""
    if found.shape is not None:
        shape = add_initializer(graph, "attn_kv_shape", np.array(found.shape, np.int64))
        reshape = ir.node("Reshape", [found.source, shape])
        out = reshape.outputs[0]
        out.shape, out.dtype = ir.Shape(found.shape), found.source.dtype
        inserted.append(reshape)
        return out
    if found.perm is None:
        return found.source
    transpose = ir.node("Transpose", [found.source], {"perm": list(found.perm)})
    out = transpose.outputs[0]
    shape = dims(found.source)
    if shape is not None:
        out.shape = ir.Shape([shape[p] for p in found.perm])
    out.dtype = found.source.dtype
    inserted.append(transpose)
    return out


def _drop_unread(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove those of ``nodes`` still in ``graph`` whose outputs nothing reads any more."""
    pending = [n for n in nodes if n.graph is graph]
    while unread := [
        n for n in pending if not any(v.uses() or v.is_graph_output() for v in n.outputs)
    ]:
        remove_nodes(graph, unread)
        pending = [n for n in pending if n not in unread]


def attn_mask(
    graph: ir.Graph, mask: Mask, query: ir.Value, key: ir.Value, inserted: list, shared: dict
) -> ir.Value:
    """The ``attn_mask`` value of ``mask`` for ``Attention(query, key, ..)``: new nodes are
    appended to ``inserted`` (the raised ``Where`` of
    :func:`fusion.fuse_gqa.standard.attention_mask` goes after the model's, once per mask, kept
    in ``shared``)."""

    def add(op: str, inputs: list, **attributes) -> ir.Value:
        node = ir.node(op, inputs, attributes or None)
        inserted.append(node)
        return node.outputs[0]

    def constant(hint: str, array) -> ir.Value:
        return add_initializer(graph, hint, np.asarray(array))

    if mask.condition is not None:
        out = mask.condition if mask.attend else add("Not", [mask.condition])
        if mask.above:
            zero, above = np.float32(0), np.float32(standard.ABOVE_LOWEST)
            out = add("Where", [out, constant("attn_zero", zero), constant("attn_above", above)])
    else:
        values = []
        for term in mask.additive:
            if isinstance(term, np.ndarray):
                term = constant("attn_mask", term)
            elif mask.raise_where:
                term = standard.attention_mask(graph, term, "raised", shared)
            values.append(term)
        if mask.view is not None:
            values.append(_viewed(mask.view, add, constant))
        out = values[0]
        for value in values[1:]:
            out = add("Add", [out, value])
        if mask.raise_at_run_time:
            lowest = constant("attn_lowest", np.float32(standard.LOWEST))
            above = constant("attn_above", np.float32(standard.ABOVE_LOWEST))
            out = add("Where", [add("Equal", [out, lowest]), above, out])
    if mask.expand:
        out = add("Expand", [out, _rows(query, key, add, constant)])
    if mask.unsqueeze:
        out = add("Unsqueeze", [out, constant("attn_head_axis", np.array([1], np.int64))])
    return out


def _viewed(view: View, add, constant) -> ir.Value:
    """The :class:`View`'s bias in the scores' shape: its terms summed, expanded to ``X`` where
    their sum may be smaller, reshaped back."""
    out = view.terms[0]
    for term in view.terms[1:]:
        out = add("Add", [out, term])
    if view.shape is not None:
        out = add("Expand", [out, constant("attn_bias_view", np.array(view.shape, np.int64))])
    target = view.target
    if isinstance(target, np.ndarray):
        target = constant("attn_bias_shape", target)
    return add("Reshape", [out, target], allowzero=view.allowzero)


def _rows(query: ir.Value, key: ir.Value, add, constant) -> ir.Value:
    """``[S, L]``: the query's and the key's lengths, a constant where both are numbers."""
    q, k = dims(query), dims(key)
    if q is not None and k is not None and isinstance(q[-2], int) and isinstance(k[-2], int):
        return constant("attn_rows", np.array([q[-2], k[-2]], np.int64))
    lengths = [add("Shape", [v], start=-2, end=-1) for v in (query, key)]
    return add("Concat", lengths, axis=0)
