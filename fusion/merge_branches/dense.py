"""The merged Gemm or MatMul of a sum of linear branches on one input (timm's distillation
heads, ``(head(x) + head_dist(x)) / 2``): its weight and bias (docs/fusions/merge_branches.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import KnownShapes, const_array, label, remove_nodes, replace_output, set_input
from fusion.base import CannotFuse, Code
from fusion.fold_batchnorm.after import add_to_matmul_bias
from fusion.merge_branches.branches import Sum, is_dense
from fusion.merge_branches.codes import ReparamCode


@dataclasses.dataclass
class DensePlan:
    """The merged layer: the branch node that becomes it, its ``(K, N)`` weight and ``(N,)``
    bias (float64, ``x @ weight + bias``), and how many branches it merges."""

    main: ir.Node
    weight: np.ndarray
    bias: np.ndarray
    count: int


def merged_dense(found: Sum, shapes: KnownShapes) -> DensePlan:
    """The one layer computing ``found``, whose branches include a :func:`is_dense` node (the
    rank of the sum from ``shapes``, where known).

    Raises:
        CannotFuse: ``branch_not_conv`` (an identity or BatchNorm branch beside them),
            ``group_mismatch`` (weights of other shapes), ``not_per_channel`` (a constant or
            bias that varies along another axis than the last, or of unknown broadcast).
    """
    if any(b.node is None or not is_dense(b.node) for b in found.branches):
        raise CannotFuse(
            ReparamCode.BRANCH_NOT_CONV,
            "an identity or BatchNorm branch beside Gemm / MatMul branches: only the linear "
            "layers of one input merge into one",
        )
    shape = shapes(found.root.outputs[0])
    rank = None if shape is None else len(shape)
    weights = [_weight(b.node) for b in found.branches]
    shapes = {w.shape for w in weights}
    if len(shapes) != 1:
        raise CannotFuse(
            ReparamCode.GROUP_MISMATCH,
            f"the Gemm / MatMul branches have weights of shapes {sorted(shapes)}: no one layer "
            "computes their sum",
        )
    ((_, n),) = shapes
    weight, bias = np.zeros(weights[0].shape), np.zeros(n)
    for branch, w in zip(found.branches, weights, strict=True):
        coef = branch.sign * _product(branch.factors, n, rank)
        weight += w * coef
        bias += coef * _bias(branch.node, n, rank)
    for sign, factors, constant in found.constants:
        bias += sign * _product(factors, n, rank) * _last(constant, n, rank)
    return DensePlan(found.branches[0].node, weight, bias, len(found.branches))


def rewrite_dense(graph: ir.Graph, found: Sum, plan: DensePlan) -> str:
    """Rewrite ``found`` into ``plan.main``, in place: a Gemm keeps its ``transB``, its
    ``alpha`` and ``beta`` made 1; a MatMul gets an Add of the bias (none where it is 0).
    Returns what the sum became, for the report."""
    main = plan.main
    dtype = const_array(main.inputs[1]).dtype
    hint = main.inputs[1].name
    replace_output(graph, found.root.outputs[0], main.outputs[0])
    remove_nodes(graph, [*found.nodes, *(b.node for b in found.branches if b.node is not main)])
    if main.op_type == "Gemm":
        weight = plan.weight.T if main.attributes.get_int("transB", 0) else plan.weight
        set_input(graph, main, 1, weight.astype(dtype), f"{hint}_merged")
        set_input(graph, main, 2, plan.bias.astype(dtype), f"{hint}_merged_bias")
        main.attributes["alpha"] = ir.AttrFloat32("alpha", 1.0)
        main.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
    else:
        set_input(graph, main, 1, plan.weight.astype(dtype), f"{hint}_merged")
        if plan.bias.any():
            add_to_matmul_bias(graph, main, plan.bias, dtype)
    return f"{main.op_type} '{label(main)}' ({plan.count} {main.op_type})"


def _weight(node: ir.Node) -> np.ndarray:
    """The ``(K, N)`` float64 matrix ``node`` multiplies its input by (Gemm's ``alpha`` and
    ``transB`` applied)."""
    weight = const_array(node.inputs[1]).astype(np.float64)
    if node.op_type == "MatMul":
        return weight
    weight = weight.T if node.attributes.get_int("transB", 0) else weight
    return node.attributes.get_float("alpha", 1.0) * weight


def _bias(node: ir.Node, n: int, rank: int | None) -> np.ndarray:
    """The ``(N,)`` float64 bias ``node`` adds (Gemm's ``beta`` applied; 0 for a MatMul)."""
    bias = const_array(node.inputs[2]) if len(node.inputs) > 2 else None
    if bias is None:
        return np.zeros(n)
    return node.attributes.get_float("beta", 1.0) * _last(bias, n, 2)


def _product(factors: tuple[np.ndarray, ...], n: int, rank: int | None) -> np.ndarray:
    """The product of ``factors`` over the last axis, a ``(N,)`` float64 vector."""
    out = np.ones(n)
    for factor in factors:
        out = out * _last(factor, n, rank)
    return out


def _last(array: np.ndarray, n: int, rank: int | None) -> np.ndarray:
    """A constant on a rank-``rank`` result as a ``(N,)`` float64 vector over its last axis.

    Raises:
        CannotFuse: ``not_per_channel``: it varies along another axis, has more axes than the
            result, or the result's rank is unknown and it has more than one axis.
    """
    fits = array.ndim <= (1 if rank is None else rank) and all(d == 1 for d in array.shape[:-1])
    if not fits or array.shape[-1:] not in ((), (1,), (n,)):
        raise CannotFuse(
            Code.NOT_PER_CHANNEL,
            f"a constant of shape {array.shape} on the sum of {n} features varies along another "
            "axis than the features, or may broadcast the sum up",
        )
    return np.broadcast_to(array.astype(np.float64).reshape(-1), (n,))
