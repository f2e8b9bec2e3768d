"""The core of a decoder's attention around its Softmax, as the exporters write it: the scores
``scale * Q @ K^T [+ mask]`` before it, the weights' ``@ V`` after it, the merge of the heads,
and the nodes that only feed these (:mod:`fusion.fuse_gqa`;
docs/fusions/fuse_gqa.md).
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import dims, producer, same_shape, scalar_const, sole_consumer
from fusion.fuse_gqa import parts


def _product(value: ir.Value) -> tuple[ir.Node, float, float, list[ir.Node]] | None:
    """``(Q @ K^T MatMul, factor, softcap, nodes)`` where ``value`` is ``factor * (Q @ K^T)``
    (softcap 0), or ``a * tanh(b * (Q @ K^T))`` with ``a > 0``: the logit soft-capping of
    Gemma 2 (``softcap * tanh(scores / softcap)``), the ops' ``softcap=a`` with
    ``scale = a * b`` (docs/fusions/fuse_gqa.md); None otherwise."""
    outer, cap, nodes = parts.scaled(value)
    tanh = producer(outer, "Tanh")
    if tanh is None:
        matmul = producer(outer, "MatMul")
        return (matmul, cap, 0.0, nodes) if matmul is not None else None
    inner, factor, inside = parts.scaled(tanh.inputs[0])
    matmul = producer(inner, "MatMul")
    if matmul is None or cap <= 0:
        return None
    return matmul, cap * factor, cap, [*nodes, tanh, *inside]


def scores(softmax: ir.Node):
    """``(Q @ K^T MatMul, mask or None, factor, softcap, nodes)`` of the Softmax's input
    (:func:`_product`; softcap 0 where there is none)."""
    if softmax.attributes.get_int("axis", -1) not in (-1, 3):
        return None
    scores, mask, nodes = softmax.inputs[0], None, []
    add = producer(scores, "Add")
    if add is not None:
        sides = [i for i in (0, 1) if _product(add.inputs[i]) is not None]
        if not sides:
            return None
        scores, mask, nodes = add.inputs[sides[0]], add.inputs[1 - sides[0]], [add]
    found = _product(scores)
    if found is None:
        return None
    matmul, factor, softcap, more = found
    return matmul, mask, factor, softcap, [*nodes, *more, matmul]


def weights_reader(softmax: ir.Node) -> tuple[ir.Node, list[ir.Node]] | None:
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


def merged(attention: ir.Node, size: int) -> tuple[ir.Value, list[ir.Node]] | None:
    """The ``(B, S, size)`` value that merges the heads of ``attention``'s output back, and the
    Transpose and Reshape that do it (after a Reshape to the same shape, as Phi-3's export and
    the TorchScript exporter's have)."""
    nodes: list[ir.Node] = []
    transpose = _reader(attention.outputs[0])
    if transpose is not None and transpose.op_type == "Reshape":  # a view to the same shape
        shape = dims(transpose.outputs[0])
        if shape is None or not same_shape(shape, dims(attention.outputs[0]) or []):
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


def _reader(value: ir.Value) -> ir.Node | None:
    """The one node that reads ``value`` other than Shape nodes (the TorchScript exporter's
    ``view(*x.shape)`` reads its input's shape; :func:`with_helpers` takes such nodes in), or
    None."""
    readers = [use.node for use in value.uses() if use.node.op_type != "Shape"]
    return readers[0] if len(readers) == 1 and not value.is_graph_output() else None


def with_helpers(nodes: list[ir.Node]) -> list[ir.Node]:
    """``nodes`` and the nodes that read them only to feed them (the dynamo exporter's
    ``Shape`` of a head tensor, sliced and concatenated into the target of a Reshape among
    them): of the nodes downstream of ``nodes``, those whose every output is read by ``nodes``
    or by such nodes alone."""
    inside = set(nodes)
    helpers: set[ir.Node] = set()
    frontier = list(nodes)
    while frontier:  # every node reached from ``nodes`` outside them
        for out in frontier.pop().outputs:
            for use in out.uses():
                if use.node not in inside and use.node not in helpers:
                    helpers.add(use.node)
                    frontier.append(use.node)
    dropped = True
    while dropped:  # keep those whose outputs stay among ``nodes`` and the helpers
        dropped = False
        for helper in list(helpers):
            outs = helper.outputs
            if any(v.is_graph_output() or not v.uses() for v in outs) or any(
                u.node not in inside and u.node not in helpers for v in outs for u in v.uses()
            ):
                helpers.discard(helper)
                dropped = True
    return [*nodes, *(n for n in nodes[0].graph if n in helpers)]
