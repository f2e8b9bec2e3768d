"""View chains followed axis by axis (``Unsqueeze``, ``Squeeze``, ``Transpose``, ``Reshape``):
each value of a chain a list of groups of its source's axes (:class:`Views`), sizes kept as
numbers or products of symbols (:class:`Size`), for :mod:`fusion.simplify.batched`; and the
naming of the sizes Reshapes' -1 stand for (:func:`unify_reshape_symbols`).

What a chain may do and still be followed: see docs/fusions/cleanup.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array

#: The ops a chain may go through: they move elements, never change them.
VIEWS = ("Unsqueeze", "Squeeze", "Transpose", "Reshape")


@dataclasses.dataclass(frozen=True)
class Size:
    """A size: ``coef`` times the product of the named ``symbols`` (unknown sizes)."""

    coef: int
    symbols: tuple[str, ...] = ()

    def __mul__(self, other: Size) -> Size:
        return Size(self.coef * other.coef, tuple(sorted(self.symbols + other.symbols)))

    def divide(self, other: Size) -> Size | None:
        """``self / other`` where it is a size of this form, else None."""
        left = list(self.symbols)
        for s in other.symbols:
            if s not in left:
                return None
            left.remove(s)
        if other.coef == 0 or self.coef % other.coef:
            return None
        return Size(self.coef // other.coef, tuple(left))

    @property
    def one(self) -> bool:
        return self.coef == 1 and not self.symbols


ONE = Size(1)
#: An atom: one axis of a chain's source (its value's name and axis) and its size.
Atom = tuple[str, int, Size]
#: A group of atoms: one axis of a value in a chain, the atoms merged in it in order.
Group = tuple[Atom, ...]


def atom_key(atom: Atom) -> tuple[str, int]:
    return atom[0], atom[1]


def group_size(group: Group) -> Size:
    size = ONE
    for _, _, s in group:
        size = size * s
    return size


class Views:
    """The groups of the values of view chains, and sizes read off shapes and computed shape
    tensors (see docs/fusions/cleanup.md)."""

    def __init__(self):
        self.groups: dict[ir.Value, list[Group]] = {}
        self._fresh = itertools.count()

    def source(self, value: ir.Value) -> list[Group] | None:
        """``value`` as a source: one group per axis; its unit axes are empty groups. Its
        shape is the one it carries, or where that one has unknown sizes the shape of the
        tensor an op that keeps shapes (:data:`SAME_SHAPE`, a scalar Mul / Div / Add / Sub)
        made it from."""
        shape = _shape_through(value)
        if shape is None:
            return None
        groups = []
        for axis, dim in enumerate(shape):
            size = self._dim(value, axis, dim)
            groups.append(() if size.one else ((value.name, axis, size),))
        return groups

    def _dim(self, value: ir.Value, axis: int, dim) -> Size:
        if isinstance(dim, int):
            return Size(dim)
        name = getattr(dim, "value", None) or f"?{value.name}:{axis}:{next(self._fresh)}"
        return Size(1, (name,))

    def sizes(self, value: ir.Value) -> list[Size] | None:
        """The sizes of ``value``'s axes: from its groups, else its shape."""
        if value in self.groups:
            return [group_size(g) for g in self.groups[value]]
        groups = self.source(value)
        return [group_size(g) for g in groups] if groups is not None else None

    def shape_tensor(self, value: ir.Value | None, depth: int = 0) -> list[Size] | None:
        """The sizes a 1-D int64 shape tensor holds (a constant, or computed from ``Shape``
        by ``Gather``, ``Slice``, ``ReduceProd``, ``Concat``, ``Max``, ``Unsqueeze``,
        ``Squeeze``, ``Cast``); None where it cannot be read. -1 and 0 stay as written."""
        if value is None or depth > 32:
            return None
        array = const_array(value)
        if array is not None:
            return [Size(int(v)) for v in np.asarray(array).reshape(-1)]
        node = value.producer()
        if node is None or node.domain != "":
            return None
        read = [self.shape_tensor(v, depth + 1) for v in node.inputs[1:]]
        op = node.op_type
        if op == "Shape":
            found = self.sizes(node.inputs[0])
            start = node.attributes.get_int("start", 0)
            end = node.attributes.get_int("end", len(found) if found else 0)
            return found[start:end] if found is not None else None
        first = self.shape_tensor(node.inputs[0], depth + 1) if node.inputs else None
        if first is None:
            return None
        if op in ("Cast", "Identity", "Unsqueeze", "Squeeze"):
            return first
        if op == "Gather" and node.attributes.get_int("axis", 0) == 0 and read[0] is not None:
            picks = [s.coef for s in read[0]]
            return (
                [first[i] for i in picks]
                if all(-len(first) <= i < len(first) for i in picks)
                else None
            )
        if op == "ReduceProd" and node.attributes.get_int("keepdims", 1) and len(node.inputs) == 1:
            return [math.prod(first, start=ONE)]
        if op == "Concat" and all(r is not None for r in read):
            return first + [s for r in read for s in r]
        if op == "Max" and len(read) == 1 and read[0] is not None and len(read[0]) == len(first):
            found = [_max(a, b) for a, b in zip(first, read[0], strict=True)]
            return found if None not in found else None
        return None


#: Ops whose output has the shape of their (first) input.
SAME_SHAPE = ("Softmax", "LogSoftmax", "Cast", "Identity", "Neg", "Exp", "Relu", "Tanh", "Erf")


def _shape_through(value: ir.Value, depth: int = 0) -> ir.Shape | None:
    """``value``'s shape, through shape-keeping ops where its own has unknown sizes."""
    shape = value.shape
    if shape is not None and all(isinstance(d, int) for d in shape) or depth > 16:
        return shape
    node = value.producer()
    if node is None or node.domain != "" or not node.inputs or node.inputs[0] is None:
        return shape
    inner = None
    if node.op_type in SAME_SHAPE:
        inner = node.inputs[0]
    elif node.op_type in ("Mul", "Div", "Add", "Sub") and len(node.inputs) == 2:
        constant = const_array(node.inputs[1])
        if constant is not None and constant.size == 1 and constant.ndim <= 1:
            inner = node.inputs[0]
    found = _shape_through(inner, depth + 1) if inner is not None else None
    return found if found is not None else shape


def _max(a: Size, b: Size) -> Size | None:
    """``max(a, b)`` where the sizes prove it: two numbers, equal sizes, or a product of symbols
    and the number 1 (the product: a symbol of 0 empties the tensor, whose Reshape to a
    target of 1 there then fails at run time); None otherwise (two different symbols may
    differ, as a batch of 1 broadcast against one of 3)."""
    if not a.symbols and not b.symbols:
        return Size(max(a.coef, b.coef))
    if a == b or b.one:
        return a
    return b if a.one else None


def _reshaped(groups: list[Group], target: list[Size], allowzero: bool) -> list[Group] | None:
    """``groups`` reshaped to ``target``: consecutive groups merged, a merged group split back
    at its atoms, unit axes in and out; None for anything else. A 0 copies the input's axis
    (unless ``allowzero``), one -1 is what the others leave."""
    target = list(target)
    for i, t in enumerate(target):
        if t == Size(0) and not allowzero:
            if i >= len(groups):
                return None
            target[i] = group_size(groups[i])
    total = math.prod((group_size(g) for g in groups), start=ONE)
    if sum(t == Size(-1) for t in target) == 1:
        known = math.prod((t for t in target if t != Size(-1)), start=ONE)
        rest = total.divide(known)
        if rest is None:
            return None
        target = [rest if t == Size(-1) else t for t in target]
    atoms = [a for g in groups for a in g]
    out, i = [], 0
    for t in target:
        if t.one:
            out.append(())
            continue
        group, size = [], ONE
        while i < len(atoms) and size != t:
            group.append(atoms[i])
            size = size * atoms[i][2]
            i += 1
        if size != t:
            return None
        out.append(tuple(group))
    return out if i == len(atoms) else None


def step(views: Views, node: ir.Node, groups: list[Group]) -> list[Group] | None:
    """The groups of ``node``'s output, from those of its first input."""
    op, rank = node.op_type, len(groups)
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", list(range(rank))[::-1])
        return [groups[p] for p in perm] if sorted(perm) == list(range(rank)) else None
    axes_value = node.inputs[1] if len(node.inputs) > 1 else None
    axes = const_array(axes_value) if axes_value is not None else None
    axes = [int(a) for a in np.asarray(axes).reshape(-1)] if axes is not None else None
    if axes is None:
        axes = list(node.attributes.get_ints("axes", ())) or None
    if op == "Unsqueeze" and axes is not None:
        out = list(groups)
        width = rank + len(axes)
        for a in sorted(a % width for a in axes):
            out.insert(a, ())
        return out
    if op == "Squeeze":
        drop = {a % rank for a in axes} if axes else {i for i, g in enumerate(groups) if not g}
        if any(groups[i] for i in drop):
            return None
        return [g for i, g in enumerate(groups) if i not in drop]
    if op == "Reshape":
        target = views.shape_tensor(node.inputs[1])
        allowzero = bool(node.attributes.get_int("allowzero", 0))
        return _reshaped(groups, target, allowzero) if target is not None else None
    return None


def chain_back(value: ir.Value) -> list[ir.Node]:
    """The view ops that make ``value``, from its source on (empty: it is its own source)."""
    chain = []
    node = value.producer()
    while node is not None and node.domain == "" and node.op_type in VIEWS and node.inputs:
        chain.insert(0, node)
        node = node.inputs[0].producer()
    return chain


def follow(views: Views, value: ir.Value) -> tuple[ir.Value, list[Group]] | None:
    """The source of ``value``'s chain and ``value``'s groups, or None."""
    chain = chain_back(value)
    source = chain[0].inputs[0] if chain else value
    groups = views.source(source)
    for node in chain:
        if groups is None:
            return None
        groups = step(views, node, groups)
        views.groups[node.outputs[0]] = groups
    return (source, groups) if groups is not None else None


def forward(views: Views, value: ir.Value, groups: list[Group]) -> tuple[ir.Value, list[Group]]:
    """Follow ``value`` (of ``groups``) down through view ops, each its only reader: the last
    value of the chain whose axes are all single atoms or units, and its groups (``value``
    itself where there is none)."""
    views.groups[value] = groups
    best = value, groups
    while not value.is_graph_output():
        uses = list(value.uses())
        node = uses[0].node if len(uses) == 1 else None
        if node is None or node.domain != "" or node.op_type not in VIEWS or uses[0].idx != 0:
            break
        found = step(views, node, groups)
        if found is None:
            break
        value, groups = node.outputs[0], found
        views.groups[value] = groups
        if all(len(g) <= 1 for g in groups):
            best = value, groups
    return best


def unify_reshape_symbols(graph: ir.Graph) -> int:
    """Name the size a Reshape's -1 stands for after its input's, where that is proven: a
    constant target with one -1 (and 0s copying the input's axes), an input of one unknown
    size ``s`` and numbers otherwise, the numbers of both sides multiplying to the same: the
    -1 is ``s`` (why: docs/fusions/cleanup.md). Every use of the fresh name in the
    graph's value shapes is replaced (the shapes are the passes' scaffolding:
    :class:`fusion.FillShapes`);
    return how many names were replaced."""
    renamed: dict[str, str] = {}
    for node in graph:
        if node.op_type != "Reshape" or node.domain != "" or len(node.inputs) < 2:
            continue
        x, out = node.inputs[0], node.outputs[0]
        target = const_array(node.inputs[1])
        if target is None or x.shape is None or out.shape is None or list(target).count(-1) != 1:
            continue
        copies = not node.attributes.get_int("allowzero", 0)
        dims = [x.shape[i] if t == 0 and copies and i < len(x.shape) else int(t)
                for i, t in enumerate(target.reshape(-1))]  # fmt: skip
        unknown = [d for d in x.shape if not isinstance(d, int)]
        at = list(target.reshape(-1)).index(-1)
        fresh = out.shape[at] if at < len(out.shape) else None
        if len(unknown) != 1 or isinstance(fresh, int) or getattr(fresh, "value", None) is None:
            continue
        if any(not isinstance(d, int) for i, d in enumerate(dims) if i != at):
            continue
        known_in = math.prod(d for d in x.shape if isinstance(d, int))
        known_out = math.prod(d for i, d in enumerate(dims) if i != at)
        name = getattr(unknown[0], "value", None)
        if known_in == known_out and name and fresh.value != name:
            renamed[fresh.value] = name
    if not renamed:
        return 0
    for value in (v for n in graph for v in n.outputs):
        if value.shape is not None and any(
            getattr(d, "value", None) in renamed for d in value.shape
        ):
            value.shape = ir.Shape(
                [
                    renamed.get(getattr(d, "value", None), d) if not isinstance(d, int) else d
                    for d in value.shape
                ]  # fmt: skip
            )
    return len(renamed)
