"""A batched MatMul between views that merge its batch axes, as the batched MatMul of their
sources (tf2onnx's Einsum, :func:`unmerge_batched_matmuls`), and a bias added after a split into
heads moved before it (:func:`bias_before_split`). The view chains are followed by
:mod:`fusion.simplify.views`.

Why these are exact, and what is left alone: see docs/fusions/cleanup.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, const_array, label, replace_output
from fusion.simplify.views import (
    Group,
    Size,
    Views,
    atom_key,
    chain_back,
    follow,
    forward,
    group_size,
)


def _paired(a: list[Group], b: list[Group]) -> bool:
    """Whether the batch groups of the two operands line up atom by atom: equal sizes, or at
    most one pair of unknown sizes per group whose other atoms multiply to a number above 1
    (the merged sizes, that number times each unknown, cannot be 1, so the MatMul does not
    broadcast them: wherever the graph runs they are equal, and so are the unknowns)."""
    if len(a) != len(b):
        return False
    for ga, gb in zip(a, b, strict=True):
        if len(ga) != len(gb):
            return False
        unknown = [(x, y) for x, y in zip(ga, gb, strict=True) if x[2] != y[2]]
        if not unknown:
            continue
        rest = group_size(tuple(x for x, y in zip(ga, gb, strict=True) if x[2] == y[2]))
        if len(unknown) > 1 or rest.symbols or rest.coef <= 1:
            return False
        ((x, y),) = unknown
        if not (x[2].coef == y[2].coef == 1 and len(x[2].symbols) == len(y[2].symbols) == 1):
            return False
    return True


def _arranged(source_rank: int, groups: list[Group], last: list[Group]) -> list[int] | None:
    """The Transpose of a chain's source that puts its batch atoms (``groups``, flattened) and
    then the atoms of ``last`` (two single-atom groups) last, its other axes (units) first."""
    if any(len(g) != 1 for g in last):
        return None
    axes = [a[1] for g in groups for a in g] + [g[0][1] for g in last]
    units = [i for i in range(source_rank) if i not in axes]
    return units + axes if len(set(axes)) == len(axes) else None


def _rebuild(graph: ir.Graph, node: ir.Node, plan: tuple) -> ir.Value:
    """Insert ``MatMul(Transpose(a), Transpose(b))`` and the unit axes and order of the
    chain's end after ``node``; return its output."""
    (src_a, perm_a), (src_b, perm_b), order, units, end, sizes = plan
    hint = label(node)
    made: list[ir.Node] = []

    def add(op: str, inputs: list, **attributes) -> ir.Value:
        made.append(ir.node(op, inputs, attributes, name=f"{hint}_{op}_{len(made)}"))
        return made[-1].outputs[0]

    def axes(values: list[int]) -> ir.Value:
        return add_initializer(graph, f"{hint}_axes", np.array(values, np.int64))

    a = add("Transpose", [src_a], perm=perm_a) if perm_a != sorted(perm_a) else src_a
    b = add("Transpose", [src_b], perm=perm_b) if perm_b != sorted(perm_b) else src_b
    for value, source, perm in ((a, src_a, perm_a), (b, src_b, perm_b)):
        if value is not source:
            value.type = source.type
            value.shape = ir.Shape([source.shape[p] for p in perm])
    out = add("MatMul", [a, b])
    out.type = end.type
    wider = a if len(a.shape) >= len(b.shape) else b
    out.shape = ir.Shape([*wider.shape[:-2], a.shape[-2], b.shape[-1]])
    lead = max(len(perm_a), len(perm_b)) - len(order)  # the MatMul's leading unit axes
    if lead == len(units):  # one Transpose: units to units, atoms to their places
        leading, held = iter(range(lead)), iter(order)
        rank = lead + len(order)
        perm = [next(leading) if i in units else lead + next(held) for i in range(rank)]
        if perm != sorted(perm):
            out = add("Transpose", [out], perm=perm)
    else:
        if lead:
            out = add("Squeeze", [out, axes(list(range(lead)))])
        if order != sorted(order):
            out = add("Transpose", [out], perm=order)
        if units:
            out = add("Unsqueeze", [out, axes(units)])
    graph.insert_after(node, made)
    out.type = end.type
    out.shape = ir.Shape([_dim_of(size) for size in sizes])
    return out


def _dim_of(size: Size) -> int | str | None:
    """A shape's dimension for ``size``: its number, the name of its one symbol, or None."""
    if not size.symbols:
        return size.coef
    return size.symbols[0] if size.coef == 1 and len(size.symbols) == 1 else None


def _plan(views: Views, node: ir.Node) -> tuple | None:
    """What :func:`_rebuild` inserts for the MatMul ``node``, or None where the rewrite does
    not apply (see docs/fusions/cleanup.md)."""
    a, b = node.inputs
    chains = (chain_back(a), chain_back(b))
    if not any(n.op_type == "Reshape" for chain in chains for n in chain):
        return None
    found_a, found_b = follow(views, a), follow(views, b)
    if found_a is None or found_b is None:
        return None
    (src_a, ga), (src_b, gb) = found_a, found_b
    if len(ga) < 3 or len(ga) != len(gb) or not _paired(ga[:-2], gb[:-2]):
        return None
    if len(ga[-1]) != 1 or len(gb[-2]) != 1 or ga[-1][0][2] != gb[-2][0][2]:
        return None
    perm_a = _arranged(len(src_a.shape), ga[:-2], [ga[-2], ga[-1]])
    perm_b = _arranged(len(src_b.shape), gb[:-2], [gb[-2], gb[-1]])
    if perm_a is None or perm_b is None:
        return None
    batch = [atom for g in ga[:-2] for atom in g]
    atoms = [*batch, ga[-2][0], gb[-1][0]]
    end, groups = forward(views, node.outputs[0], [*ga[:-2], ga[-2], gb[-1]])
    if end is node.outputs[0] or any(len(g) > 1 for g in groups):
        return None
    held = [g[0] for g in groups if g]
    if sorted(held, key=atom_key) != sorted(atoms, key=atom_key):
        return None
    order = [atoms.index(atom) for atom in held]
    units = [i for i, g in enumerate(groups) if not g]
    sizes = [group_size(g) for g in groups]
    return (src_a, perm_a), (src_b, perm_b), order, units, end, sizes


def unmerge_batched_matmuls(graph: ir.Graph) -> int:
    """Rewrite each MatMul between views that merge its batch axes as the MatMul of its
    sources (see docs/fusions/cleanup.md), in place; return how many. The old chains are left
    for the dead-node clean-up."""
    done = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain != "" or node.graph is not graph:
            continue
        plan = _plan(Views(), node)
        if plan is None:
            continue
        end = plan[4]
        new = _rebuild(graph, node, plan)
        replace_output(graph, end, new)
        done += 1
    return done


def bias_before_split(graph: ir.Graph) -> int:
    """Move each constant bias added right after a Reshape that splits the last axis into
    two (``Add(Reshape(y, [..., N, H]), b)``, ``b`` of shape ``(N, H)``, as Keras adds its
    ``EinsumDense`` bias after the split into heads) before it: ``Reshape(Add(y, b'), [..., N,
    H])`` with ``b'`` of shape ``(N*H,)`` (docs/fusions/cleanup.md). Needs ``y``'s last
    size and ``b``'s shape known; return how many."""
    done = 0
    for add in list(graph):
        if add.op_type != "Add" or add.domain != "" or add.graph is not graph:
            continue
        for reshaped, bias in (add.inputs, add.inputs[::-1]):
            reshape = reshaped.producer() if reshaped is not None else None
            array = const_array(bias)
            if reshape is None or reshape.op_type != "Reshape" or reshape.domain != "":
                continue
            if array is None or array.ndim != 2 or len(list(reshaped.uses())) != 1:
                continue
            y = reshape.inputs[0]
            out_shape, in_shape = reshaped.shape, y.shape
            if out_shape is None or in_shape is None or len(out_shape) != len(in_shape) + 1:
                continue
            if list(out_shape[-2:]) != list(array.shape) or in_shape[-1] != array.size:
                continue
            flat = add_initializer(graph, f"{label(add)}_flat", array.reshape(-1))
            biased = ir.node("Add", [y, flat], name=f"{label(add)}_before_split")
            biased.outputs[0].type, biased.outputs[0].shape = y.type, y.shape
            graph.insert_before(reshape, biased)
            reshape.replace_input_with(0, biased.outputs[0])
            replace_output(graph, add.outputs[0], reshaped)
            graph.remove(add, safe=True)
            done += 1
            break
    return done
