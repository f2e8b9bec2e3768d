"""A model cut into blocks at value names, for parity block by block: :func:`boundaries`
chooses the cuts on the reference model within a weight budget, :func:`blocks` finds a
model's blocks (:class:`Block`) at those cuts (dropping a cut that a rewrite spans), :func:`cut`
makes one block a model of its own, its initializers still in the model's external data file.
Where the cuts go and why: docs/memory.md#parity-block-by-block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import onnx_ir as ir
import onnx_ir.passes.common
from onnx_ir import traversal

from normexport.runtime.activations import computed_from_weights


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a model.

    Attributes:
        index: its place in the chain, from 0.
        inputs: the values it reads that are graph inputs or computed by earlier blocks.
        outputs: the values it computes that later blocks or the graph outputs read.
        nodes: how many (top-level) nodes it has.
        weight_bytes: the bytes of the initializers its nodes read (bytes on file).
        spans: how many of the reference's blocks it covers (more than 1 where a rewrite
            spans a boundary of the reference's).
        computed_bytes: the bytes of the values its nodes compute from the weights alone,
            which its session holds with them
            (:func:`normexport.runtime.activations.computed_from_weights`).
    """

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: int
    weight_bytes: int
    spans: int = 1
    computed_bytes: int = 0


#: A boundary after node ``k`` (in topological order): the names of the values computed by the
#: nodes before it and read by a node after it or by the graph outputs.
Boundary = tuple[str, ...]


def boundaries(model: ir.Model, max_bytes: int) -> list[Boundary]:
    """The boundaries that cut ``model`` into blocks that hold at most ``max_bytes`` each (a
    block of one node may hold more: a node is never split), in order: the bytes of the
    weights its nodes read and of the values they compute from the weights alone
    (:func:`normexport.runtime.activations.computed_from_weights`: a session holds those at
    once, a ``Transpose`` of every weight where the exporter's optimizer was off, so the block
    that reads 1 GiB of such weights holds 2). Each boundary is chosen, among the places in the
    last half of its block's bytes, where the fewest values cross (ties: the latest).
    ``model`` is sorted topologically in place."""
    model.graph.sort()
    nodes = list(model.graph)
    computed = computed_from_weights(model)
    weights = [
        read + sum(computed.get(v.name, 0) for v in node.outputs)
        for node, read in zip(nodes, _first_read_bytes(nodes), strict=True)
    ]
    live = _live_counts(model.graph, nodes)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    cuts, start = [], 0
    while True:
        end = start + 1
        while end < len(nodes) and prefix[end + 1] - prefix[start] <= max_bytes:
            end += 1
        if end >= len(nodes):
            return [_crossing(model.graph, nodes, k) for k in cuts]
        half = prefix[start] + (prefix[end] - prefix[start]) / 2
        candidates = [k for k in range(start + 1, end + 1) if prefix[k] >= half]
        start = min(candidates, key=lambda k: (live[k], -k))
        cuts.append(start)


def blocks(model: ir.Model, cuts: Sequence[Boundary]) -> list[Block]:
    """``model`` cut at ``cuts`` (:func:`boundaries`, found on the reference model): one
    :class:`Block` per stretch between two boundaries, the last ending at the graph outputs.
    A boundary's values that no node of ``model`` computes are left out of it (the passes
    folded a rotary table the reference computes from its weights into an initializer: each
    block reads it as a weight); a boundary that then does not cut ``model`` (none of its
    values is left, or a node of the model reads across it a value it does not name) is
    dropped, and the blocks on either side of it run as one."""
    computed = {o.name for node in model.graph for o in node.outputs}
    left = [tuple(n for n in c if n in computed) for c in cuts]
    kept = [i for i, c in enumerate(left) if c]
    held = computed_from_weights(model)
    while True:
        found = _walk(model.graph, [left[i] for i in kept], held)
        if isinstance(found, list):
            spans = _spans(len(cuts), kept)
            return [dataclasses.replace(b, spans=s) for b, s in zip(found, spans, strict=True)]
        del kept[found]  # the boundary before block ``found + 1`` does not cut this model


def cut(
    src: Path,
    inputs: Sequence[str],
    outputs: Sequence[str] | None = None,
    types: Mapping[str, ir.DataType] | None = None,
) -> ir.Model:
    """The model at ``src`` (loaded lazily: its external tensors still point into its external
    data file) with each of ``inputs`` a graph input instead of the output of the node computing
    it, and ``outputs`` (default: its own) as its graph outputs; the graph inputs, nodes and
    initializers no longer read are removed. ``types``: the element type of an input whose
    value the file does not annotate (a graph input must have one; exporters annotate only
    some intermediate values).

    Raises:
        ValueError: a value of ``inputs`` is not computed by any node of the model, or a value of
            ``outputs`` is not in it.
    """
    model = ir.load(src)
    producers = {out.name: node for node in model.graph for out in node.outputs}
    values = {v.name: v for v in model.graph.inputs} | {
        out.name: out for node in model.graph for out in node.outputs
    }
    for name in inputs:
        node = producers.get(name)
        if node is None:
            if name in values:  # a graph input already
                continue
            raise ValueError(f"{src}: no node computes value {name!r}")
        out = next(o for o in node.outputs if o.name == name)
        known = out.type or (ir.TensorType(types[name]) if types and name in types else None)
        fed = ir.Value(name=name, type=known, shape=out.shape)
        out.replace_all_uses_with(fed, replace_graph_outputs=True)
        model.graph.inputs.append(fed)
        values[name] = fed
    if outputs is not None:
        missing = [n for n in outputs if n not in values]
        if missing:
            raise ValueError(f"{src}: no value named {', '.join(map(repr, missing))}")
        model.graph.outputs[:] = [values[n] for n in outputs]
    ir.passes.common.RemoveUnusedNodesPass()(model)
    kept = {id(v) for v in model.graph.outputs}
    model.graph.inputs[:] = [v for v in model.graph.inputs if v.uses() or id(v) in kept]
    return model


def reads(node: ir.Node) -> Iterator[ir.Value]:
    """The values ``node`` reads: its inputs, and the outer values its subgraphs (``If``,
    ``Loop``, ``Scan`` bodies) read."""
    yield from (v for v in node.inputs if v is not None)
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs = [attr.value]
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs = list(attr.value)
        else:
            continue
        for graph in graphs:
            inner = list(traversal.RecursiveGraphIterator(graph))
            made = {id(o) for n in inner for o in n.outputs} | {id(v) for v in graph.inputs}
            made |= {id(v) for v in graph.initializers.values()}
            for n in inner:
                yield from (v for v in n.inputs if v is not None and id(v) not in made)


def _first_read_bytes(nodes: list[ir.Node]) -> list[int]:
    """Per node, the bytes of the initializers it is the first to read."""
    seen: set[int] = set()
    found = []
    for node in nodes:
        total = 0
        for value in reads(node):
            if value.is_initializer() and value.const_value is not None and id(value) not in seen:
                seen.add(id(value))
                total += value.const_value.nbytes
        found.append(total)
    return found


def _last_reads(graph: ir.Graph, nodes: list[ir.Node]) -> dict[int, int]:
    """Per value computed by a node (by identity), the position of the last node that reads
    it (``len(nodes)`` for a graph output)."""
    last: dict[int, int] = {}
    for k, node in enumerate(nodes):
        for value in reads(node):
            last[id(value)] = k
    for value in graph.outputs:
        last[id(value)] = len(nodes)
    return last


def _live_counts(graph: ir.Graph, nodes: list[ir.Node]) -> list[int]:
    """Per position ``k`` (before node ``k``), how many values cross it."""
    last = _last_reads(graph, nodes)
    delta = [0] * (len(nodes) + 2)
    for k, node in enumerate(nodes):
        for out in node.outputs:
            end = last.get(id(out), -1)
            if end > k:
                delta[k + 1] += 1
                delta[end + 1] -= 1
    counts, running = [], 0
    for d in delta:
        running += d
        counts.append(running)
    return counts


def _crossing(graph: ir.Graph, nodes: list[ir.Node], k: int) -> Boundary:
    """The names of the values computed before position ``k`` and read at or after it."""
    last = _last_reads(graph, nodes)
    return tuple(o.name for n in nodes[:k] for o in n.outputs if last.get(id(o), -1) >= k)


def _walk(graph: ir.Graph, cuts: list[Boundary], held: Mapping[str, int]) -> list[Block] | int:
    """The blocks of ``graph`` between ``cuts``, each the nodes its outputs need back to the
    previous boundary (``held``: the values computed from the weights alone, by name ->
    bytes); where a block needs a node an earlier block has, the index of the boundary
    before it (which does not cut ``graph``), and where a block would hand on nothing new,
    the index of the boundary after it."""
    given = {v.name for v in graph.inputs} | set(graph.initializers)
    ends = [*cuts, tuple(v.name for v in graph.outputs)]
    claimed: set[int] = set()
    found, before = [], ()
    for index, boundary in enumerate(ends):
        frontier = given | set(before)
        outputs = tuple(n for n in boundary if n not in before and n not in given)
        if not outputs:  # the values left of this boundary were all handed on before it
            return index
        values = [v for v in graph.outputs if v.name in outputs]
        values += [o for node in graph for o in node.outputs if o.name in outputs]
        mine, inputs, weights, computed, seen = set(), set(), 0, 0, set()
        while values:
            value = values.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if value.name in frontier or value.producer() is None:
                if value.is_initializer() and value.const_value is not None:
                    weights += value.const_value.nbytes
                elif value.name:
                    inputs.add(value.name)
                continue
            node = value.producer()
            if id(node) in claimed and id(node) not in mine:
                return index - 1
            if id(node) not in mine:
                computed += sum(held.get(o.name, 0) for o in node.outputs)
            mine.add(id(node))
            values.extend(reads(node))
        claimed |= mine
        described = (index, tuple(sorted(inputs)), outputs, len(mine), weights)
        found.append(Block(*described, computed_bytes=computed))
        before = boundary
    return found


def _spans(cuts: int, kept: list[int]) -> list[int]:
    """Per block between the boundaries ``kept`` (indices, in order, into ``cuts``
    boundaries), how many of the blocks between all ``cuts`` boundaries it covers."""
    ends = [*kept, cuts]
    return [end - start for start, end in zip([-1, *kept], ends, strict=True)]
