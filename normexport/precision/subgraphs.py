"""The float16 converter's model with subgraphs (an ``If``'s branches, a ``Loop``'s body)
made whole again (:mod:`normexport.precision.convert`): subgraphs read the outer graph's values
by name, which the converter and the clean-up around it handle for the main graph only."""

from __future__ import annotations

import onnx


def subgraphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The subgraphs of ``graph``'s nodes (an ``If``'s branches, a ``Loop``'s body), nested
    ones too."""
    found = []
    for node in graph.node:
        for subgraph in _children(node):
            found += [subgraph, *subgraphs(subgraph)]
    return found


def _children(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs among ``node``'s attributes."""
    return [g for a in node.attribute for g in [*a.graphs, *([a.g] if a.HasField("g") else [])]]


def input_casts(graph: onnx.GraphProto, original: onnx.GraphProto) -> None:
    """Add the casts the converter names and does not write: with ``keep_io_types`` it renames a
    float32 graph input that a subgraph reads to its float16 cast (``graph_input_cast_N``), and
    writes that Cast only where the main graph reads the input too (a past value read by the
    GroupQueryAttention guard's branches alone). Subgraph nodes are matched by name."""
    graphs = [graph, *subgraphs(graph)]
    defined = {i.name for g in graphs for i in [*g.input, *g.initializer]}
    defined |= {o for g in graphs for n in g.node for o in n.output}
    inputs = {i.name for i in original.input}
    before = {n.name: n for g in subgraphs(original) for n in g.node if n.name}
    casts = {}
    for subgraph in graphs[1:]:
        for node in subgraph.node:
            source = before.get(node.name)
            for name, was in zip(node.input, source.input if source else (), strict=False):
                if name and name not in defined and was in inputs and name not in casts:
                    casts[name] = onnx.helper.make_node(
                        "Cast", [was], [name], name=f"{name}_node", to=onnx.TensorProto.FLOAT16
                    )
    for cast in casts.values():
        graph.node.insert(0, cast)


def sort(graph: onnx.GraphProto) -> None:
    """Order ``graph``'s nodes so that each comes after the producers of what it and its
    subgraphs read (stable otherwise): the converter appends its casts of the graph inputs at
    the end, after an ``If`` whose branches read them by name, which a reader of the protobuf
    (onnx_ir, ONNX Runtime) cannot resolve there."""
    nodes = list(graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output}
    needs = []
    for i, node in enumerate(nodes):
        read = set(node.input).union(*map(names_read, _children(node)))
        needs.append({producer[n] for n in read if n in producer and producer[n] != i})
    order: list[int] = []
    placed: set[int] = set()
    pending = list(range(len(nodes)))
    while pending:
        ready = [i for i in pending if needs[i] <= placed]
        if not ready:  # a cycle: leave the rest as it is
            order += pending
            break
        for i in ready:  # in their order, as long as what they need is placed
            if needs[i] <= placed:
                order.append(i)
                placed.add(i)
        pending = [i for i in pending if i not in placed]
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def names_read(graph: onnx.GraphProto) -> set[str]:
    """The value names that the nodes of ``graph`` and of its subgraphs (an ``If``'s branches,
    a ``Loop``'s body, which read the outer graph's values by name) take, and its outputs."""
    read = {o.name for o in graph.output}
    for node in graph.node:
        read.update(node.input)
        for subgraph in _children(node):
            read |= names_read(subgraph)
    return read
