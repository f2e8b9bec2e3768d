"""The sum of branches ending at an Add or Sub, read into its terms
(docs/fusions/merge_branches.md)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array, label
from fusion.base import CannotFuse
from fusion.merge_branches.codes import ReparamCode

#: How many nodes up a branch that is no Conv, identity or BatchNorm is followed to find that it
#: reads the block's input through another op (a ReLU in a branch): then it is refused, not
#: ignored.
_BRANCH_DEPTH = 3

#: The layers a sum of branches merges into one of: a Conv, or a Gemm / MatMul (:func:`is_dense`).
_LAYERS = ("Conv", "Gemm", "MatMul")


@dataclasses.dataclass
class Branch:
    """One term of the sum: ``sign * prod(factors) * B(x)``.

    Attributes:
        node: the Conv or BatchNormalization; None for the tensor itself.
        value: the tensor the branch reads (its ``x``).
        sign: +1 or -1.
        factors: the constant operands of the Muls on the way (per-channel or scalar).
    """

    node: ir.Node | None
    value: ir.Value
    sign: float
    factors: tuple[np.ndarray, ...]


@dataclasses.dataclass
class Sum:
    """A tree of Add / Sub / Neg / Mul-by-constant nodes and its branches.

    Attributes:
        root: the tree's last node.
        branches: the terms that read a tensor.
        constants: ``(sign, factors, constant)`` per constant added.
        nodes: the tree's nodes (the root included; the branches' Conv / BN nodes not).
    """

    root: ir.Node
    branches: list[Branch] = dataclasses.field(default_factory=list)
    constants: list[tuple[float, tuple[np.ndarray, ...], np.ndarray]] = dataclasses.field(
        default_factory=list
    )
    nodes: list[ir.Node] = dataclasses.field(default_factory=list)

    @property
    def dense(self) -> bool:
        """Whether a branch is a Gemm or MatMul (the sum merges into one, not into a Conv)."""
        return any(b.node is not None and is_dense(b.node) for b in self.branches)


def is_conv(node: ir.Node) -> bool:
    """A Conv with a constant weight (and bias, where it has one)."""
    if node.op_type != "Conv" or node.domain or len(node.inputs) < 2:
        return False
    if const_array(node.inputs[1]) is None:
        return False
    return bias_of(node) is not None or len(node.inputs) < 3 or node.inputs[2] is None


def is_dense(node: ir.Node) -> bool:
    """A Gemm with ``transA=0`` and a constant 2-D weight and constant bias (where it has one),
    or a MatMul with a constant 2-D weight."""
    if node.domain or node.op_type not in ("Gemm", "MatMul") or len(node.inputs) < 2:
        return False
    weight = const_array(node.inputs[1])
    if weight is None or weight.ndim != 2:
        return False
    if node.op_type == "MatMul":
        return True
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    return not node.attributes.get_int("transA", 0) and (
        bias is None or const_array(bias) is not None
    )


def bias_of(conv: ir.Node) -> np.ndarray | None:
    """A Conv's constant bias (None where it has none, or it is not constant)."""
    return const_array(conv.inputs[2]) if len(conv.inputs) > 2 else None


def collect(root: ir.Node) -> Sum | None:
    """The sum ending at ``root`` and its branches, where at least two branches read one tensor
    and one of them is a Conv, a Gemm or a MatMul; None where there is no such sum (a residual
    Add of two tensors).

    Raises:
        CannotFuse: ``branch_not_conv``: a branch reads that tensor through another op.
    """
    found = Sum(root)
    _visit(found, root.outputs[0], 1.0, (), top=True)
    counts: dict[ir.Value, list[Branch]] = {}
    for branch in found.branches:
        counts.setdefault(branch.value, []).append(branch)
    candidates = [
        (len(bs), x)
        for x, bs in counts.items()
        if len(bs) >= 2 and any(b.node is not None and b.node.op_type in _LAYERS for b in bs)
    ]
    if not candidates:
        return None
    x = max(candidates, key=lambda c: c[0])[1]
    for branch in found.branches:
        if branch.value is not x:
            through = _reaches(branch.value, x)
            if through is None:
                return None  # a tensor from elsewhere: no block of branches of x
            raise CannotFuse(
                ReparamCode.BRANCH_NOT_CONV,
                f"a branch reads '{x.name}' through {through.op_type} '{label(through)}': "
                "only Convs, the identity and BatchNorms of it merge into one Conv",
            )
    return found


def _visit(found: Sum, value: ir.Value, sign: float, factors: tuple, top: bool = False) -> None:
    """Add ``sign * prod(factors) * value`` to ``found``, expanding the tree's nodes."""
    node = value.producer()
    inside = node is not None and not node.domain and (top or read_once(value))
    if inside and node.op_type in ("Add", "Sub") and len(node.inputs) == 2:
        found.nodes.append(node)
        a, b = node.inputs
        minus = -sign if node.op_type == "Sub" else sign
        if const_array(b) is not None:
            found.constants.append((minus, factors, const_array(b)))
            _visit(found, a, sign, factors)
        elif const_array(a) is not None:
            found.constants.append((sign, factors, const_array(a)))
            _visit(found, b, minus, factors)
        else:
            _visit(found, a, sign, factors)
            _visit(found, b, minus, factors)
        return
    if inside and node.op_type == "Neg":
        found.nodes.append(node)
        _visit(found, node.inputs[0], -sign, factors)
        return
    if inside and node.op_type == "Mul" and len(node.inputs) == 2:
        a, b = (const_array(v) for v in node.inputs)
        if (a is None) != (b is None):  # data times a constant
            found.nodes.append(node)
            data = node.inputs[0] if a is None else node.inputs[1]
            _visit(found, data, sign, (*factors, b if a is None else a))
            return
    if inside and (is_conv(node) or is_dense(node) or node.op_type == "BatchNormalization"):
        found.branches.append(Branch(node, node.inputs[0], sign, factors))
        return
    found.branches.append(Branch(None, value, sign, factors))


def read_once(value: ir.Value) -> bool:
    """Whether ``value`` has one reader and is no graph output (a node of the tree may go)."""
    return not value.is_graph_output() and len(list(value.uses())) == 1


def _reaches(value: ir.Value, x: ir.Value) -> ir.Node | None:
    """``value``'s producer, where it reads ``x`` within :data:`_BRANCH_DEPTH` nodes up (along
    first inputs); else None."""
    first = value.producer()
    for _ in range(_BRANCH_DEPTH):
        node = value.producer()
        if node is None or not node.inputs or node.inputs[0] is None:
            return None
        if any(v is x for v in node.inputs):
            return first
        value = node.inputs[0]
    return None
