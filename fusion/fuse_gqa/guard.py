"""GroupQueryAttention behind an ``If`` whose other branch is the model's own attention, for the
models ONNX's ``Attention`` cannot take instead (:mod:`.standard`): the condition under which
the op's CPU kernel computes the model's attention (:func:`condition`) and the branch
(:func:`branch`). The kernel's limits it guards against: see
docs/fusions/fuse_gqa.md.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer
from fusion.fuse_gqa import build
from fusion.fuse_gqa.masks import MASKED


def condition(
    graph: ir.Graph,
    query: ir.Value,
    past: ir.Value | None,
    bias: ir.Value | None,
    opset: int,
    inserted: list[ir.Node],
    shared: dict,
) -> ir.Value:
    """The boolean scalar under which the op computes the model's attention
    (docs/fusions/fuse_gqa.md) for the ``(B, S, .)`` ``query``, the
    ``(B, K, P, H)`` ``past`` key (or None) and the run-time ``(B | 1, N | 1, S, T)`` ``bias``
    (or None); nodes appended to ``inserted``, kept in ``shared`` for the layers of the same
    key."""
    read = build.sizes(graph, query, past, inserted, shared) if past is not None else None
    key = ("condition", id(read), id(bias))
    if key in shared:
        return shared[key]
    const = functools.partial(add_initializer, graph)
    terms = []
    if past is not None:
        one, zero = const("gqa_int1", np.array(1)), const("gqa_int0", np.array(0))
        tests = [
            ir.node("Equal", [read.batch, one]),  # (1,): the If takes a one-element cond
            ir.node("Equal", [read.length, one]),
            ir.node("Equal", [read.past, zero]),
        ]
        either = ir.node("Or", [tests[0].outputs[0], tests[1].outputs[0]])
        allowed = ir.node("Or", [either.outputs[0], tests[2].outputs[0]])
        inserted += [*tests, either, allowed]
        terms.append(allowed.outputs[0])
    if bias is not None:
        if opset >= 18:
            rows = ir.node("ReduceMax", [bias, const("gqa_last_axis4", np.array([3]))])
        else:
            rows = ir.node("ReduceMax", [bias], {"axes": [3]})
        rows.attributes["keepdims"] = ir.AttrInt64("keepdims", 0)
        least = ir.node("ReduceMin", [rows.outputs[0]], {"keepdims": 0})
        kept = ir.node(
            "Greater", [least.outputs[0], const("gqa_masked", np.array(MASKED, np.float32))]
        )
        inserted += [rows, least, kept]
        terms.append(kept.outputs[0])
    if len(terms) == 2:
        both = ir.node("And", terms)
        inserted.append(both)
        terms = [both.outputs[0]]
    shared[key] = terms[0]
    return terms[0]


def branch(
    graph: ir.Graph,
    anchor: ir.Node,
    inserted: list[ir.Node],
    fused: ir.Node,
    cond: ir.Value,
    nodes: list[ir.Node],
    outputs: list[ir.Value],
) -> None:
    """Replace ``nodes`` by ``If(cond)`` with ``fused`` as its ``then`` branch and ``nodes`` as
    its ``else`` branch, both computing ``outputs`` (the attention's output, the present key and
    value), which keep their names and types in the main graph; ``inserted`` and the ``If`` go
    before ``anchor``, the last of ``nodes`` in the graph. The nodes that only feed ``nodes``
    (the split into heads) move into the ``else`` branch with them."""
    name = fused.name
    for index, (new, old) in enumerate(zip(fused.outputs, outputs, strict=False)):
        new.name, new.type, new.shape = f"{name}_then_{index}", old.type, old.shape
    then = ir.Graph([], fused.outputs[: len(outputs)], nodes=[fused], name=f"{name}_then")
    node = ir.node("If", [cond], {"then_branch": then}, num_outputs=len(outputs), name=f"{name}_If")
    graph.insert_before(anchor, [*inserted, node])
    inside = set(nodes)
    for index, (new, old) in enumerate(zip(node.outputs, outputs, strict=True)):
        new.name, new.type, new.shape = old.name, old.type, old.shape
        old.name = f"{name}_else_{index}"
        for use in list(old.uses()):  # the readers outside the branch
            if use.node not in inside:
                use.node.replace_input_with(use.idx, new)
        for position, value in enumerate(graph.outputs):
            if value is old:
                graph.outputs[position] = new
    inside = _with_feeders(inside)
    ordered = [n for n in graph if n in inside]
    graph.remove(ordered)  # unsafe: the nodes keep their inputs, moved to the branch
    otherwise = ir.Graph([], outputs, nodes=ordered, name=f"{name}_else")
    otherwise.sort()  # the Split of a packed projection comes after its readers here
    node.attributes["else_branch"] = ir.AttrGraph("else_branch", otherwise)


def _with_feeders(inside: set[ir.Node]) -> set[ir.Node]:
    """``inside`` and the nodes upstream whose every output is read by them alone (no graph
    output), transitively: what only the ``else`` branch needs."""
    pending = [v.producer() for n in inside for v in n.inputs if v is not None]
    while pending:
        node = pending.pop()
        if node is None or node in inside:
            continue
        if all(
            not v.is_graph_output() and v.uses() and all(u.node in inside for u in v.uses())
            for v in node.outputs
        ):
            inside.add(node)
            pending += [v.producer() for v in node.inputs if v is not None]
    return inside
