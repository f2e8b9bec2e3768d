"""Moving a per-element affine map ``s * x + t`` across the ops that commute with it (the views,
means and maxes of :data:`ACROSS`); the positive scale a max needs is checked by the callers,
who know the scale. Which ops, and why: docs/fusions/fold_batchnorm.md.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from fusion._ir import KnownShapes, label, num_consumers, reduce_axes, same_dim, shape_text
from fusion.base import CannotFuse, Code
from fusion.fold_batchnorm.codes import BatchNormCode

RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
#: Ops that take the max over a window or over axes: a map moves across them only with a
#: positive scale (max(s * x + t) = s * max(x) + t needs s > 0).
MAXES = ("MaxPool", "GlobalMaxPool", "ReduceMax")
#: Ops that reduce whole axes (mean or max), each as (axes, keepdims) by :func:`reduction`.
REDUCTIONS = ("GlobalAveragePool", "ReduceMean", "GlobalMaxPool", "ReduceMax")
#: Ops that a per-channel affine map moves across: data movement, means over the axes along
#: which it is constant, and the maxes of :data:`MAXES` for positive scales.
ACROSS = ("Transpose", "Identity", "MaxPool", *REDUCTIONS, *RESHAPES)


def _squeeze_constant_axes(array: np.ndarray) -> np.ndarray:
    """``array`` with every axis along which it does not vary cut to size 1."""
    for axis, size in enumerate(array.shape):
        first = array.take([0], axis=axis)
        if size > 1 and np.array_equal(array, np.broadcast_to(first, array.shape)):
            array = first
    return array


def _reshape_map(coeff: np.ndarray, src: ir.Shape, dst: ir.Shape) -> np.ndarray | None:
    """Move ``coeff``, broadcast against a tensor of shape ``src``, to that tensor reshaped to
    ``dst`` (row-major, as ONNX Reshape / Flatten / Squeeze / Unsqueeze do).

    The leading and trailing dimensions that both shapes share are kept as they are; the middle
    ones are regrouped. That needs their sizes unless ``coeff`` is constant along them: None
    when they are not known. The middles hold the same number of elements, so one unknown
    dimension among them is that number over the others.

    Raises:
        ValueError: ``coeff`` does not broadcast against ``src``.
    """
    head = 0
    while head < min(len(src), len(dst)) and same_dim(src[head], dst[head]):
        head += 1
    tail = 0
    while tail < min(len(src), len(dst)) - head and same_dim(src[-1 - tail], dst[-1 - tail]):
        tail += 1
    middle_src, middle_dst = src.dims[head : len(src) - tail], dst.dims[head : len(dst) - tail]
    kept_head, kept_tail = coeff.shape[:head], coeff.shape[len(src) - tail :]
    if all(n == 1 for n in coeff.shape[head : len(src) - tail]):
        return coeff.reshape(kept_head + (1,) * len(middle_dst) + kept_tail)
    middle_src, middle_dst = _fill_in(middle_src, middle_dst), _fill_in(middle_dst, middle_src)
    if middle_src is None or middle_dst is None:
        return None
    full = np.broadcast_to(coeff, kept_head + middle_src + kept_tail)
    return _squeeze_constant_axes(full.reshape(kept_head + middle_dst + kept_tail))


def _fill_in(dims: tuple, other: tuple) -> tuple[int, ...] | None:
    """``dims`` as numbers, its one unknown (if any) worked out from ``other``, which holds as
    many elements; None when that cannot be done."""
    unknown = [i for i, d in enumerate(dims) if not isinstance(d, int)]
    if not unknown:
        return tuple(dims)
    known = [d for d in dims if isinstance(d, int)]
    if len(unknown) > 1 or not all(isinstance(d, int) for d in other) or 0 in known:
        return None
    filled = list(dims)
    filled[unknown[0]] = math.prod(other) // math.prod(known)
    return tuple(filled)


def move(node: ir.Node, coeff: np.ndarray, shapes: KnownShapes, forward: bool) -> np.ndarray:
    """Carry ``coeff`` across ``node`` (one of :data:`ACROSS`): from its input to its output
    (``forward``) or back.

    Args:
        coeff: a float64 array of the rank of the side it comes from, broadcast against it.

    Raises:
        CannotFuse: the map does not move across ``node`` as a per-element map:
            ``not_per_channel`` (it varies over a MaxPool window), ``pools_over_channels`` (it
            varies along an axis that a mean or max reduces), ``shape_mismatch`` (it does not
            fit the shapes around a reshape), ``channels_regrouped`` (a reshape regroups it
            across dimensions of unknown size), ``unknown_shape`` (a reduction's axes).
    """
    op = node.op_type
    if op in REDUCTIONS:
        return _move_across_reduction(node, coeff, shapes, forward)
    if op == "MaxPool":
        if any(n != 1 for n in coeff.shape[2:]):
            raise CannotFuse(
                Code.NOT_PER_CHANNEL,
                f"MaxPool '{label(node)}' pools over axes along which the map varies: "
                "max-pool commutes only with a map that is the same over the window",
            )
        return coeff
    if op == "Identity":
        return coeff
    if op == "Transpose":
        perm = list(node.attributes.get_ints("perm", ())) or list(range(coeff.ndim))[::-1]
        return coeff.transpose(perm if forward else np.argsort(perm))
    src, dst = shapes(node.inputs[0]), shapes(node.outputs[0])
    try:
        moved = _reshape_map(coeff, src, dst) if forward else _reshape_map(coeff, dst, src)
    except ValueError:  # np.broadcast_to: sizes that do not match the shapes
        raise CannotFuse(
            Code.SHAPE_MISMATCH,
            f"a constant of shape {coeff.shape} does not fit the shape "
            f"{shape_text(src if forward else dst)} around {op} '{label(node)}'",
        ) from None
    if moved is None:
        raise CannotFuse(
            BatchNormCode.CHANNELS_REGROUPED,
            f"{op} '{label(node)}' from {shape_text(src)} to {shape_text(dst)} regroups the "
            "channels across dimensions whose sizes are unknown",
        )
    return moved


def reduction(node: ir.Node, rank: int) -> tuple[tuple[int, ...], bool]:
    """``(axes, keepdims)`` of ``node`` (one of :data:`REDUCTIONS`) on a rank-``rank`` input:
    the axes it reduces, each in ``[0, rank)``, sorted, and whether it keeps them as size 1.

    GlobalAveragePool / GlobalMaxPool reduce axes 2 and up and keep them (ONNX spec); ReduceMean
    / ReduceMax reduce their ``axes`` (an attribute before opset 18, an input from 18; none:
    all axes) with ``keepdims`` (default 1).

    Raises:
        CannotFuse: ``unknown_shape``, the axes are not constant (or ``noop_with_empty_axes``
            makes the node reduce nothing).
    """
    if node.op_type.startswith("Global"):
        return tuple(range(2, rank)), True
    axes = reduce_axes(node, rank)
    if axes is None:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE,
            f"the axes of {node.op_type} '{label(node)}' are not constant: cannot tell whether "
            "it reduces the channels",
        )
    return tuple(sorted({a % rank for a in axes})), bool(node.attributes.get_int("keepdims", 1))


def _move_across_reduction(
    node: ir.Node, coeff: np.ndarray, shapes: KnownShapes, forward: bool
) -> np.ndarray:
    """Carry ``coeff`` across a mean or max over whole axes (see :func:`move`).

    Forward, the map must be constant along the reduced axes, which are then dropped unless
    kept; back, they come back as size 1, and a map on the output must not vary along a kept
    one (docs/fusions/fold_batchnorm.md).

    Raises:
        CannotFuse: ``pools_over_channels``, the map varies along a reduced axis (forward);
            ``broadcast_changes_shape``, along a kept one (back); ``unknown_shape``, the axes
            are unknown.
    """
    rank = coeff.ndim if forward else _input_rank(node, coeff.ndim, shapes)
    axes, keepdims = reduction(node, rank)
    on_coeff = forward or keepdims  # the reduced axes are axes of coeff
    varying = [a for a in axes if coeff.shape[a] != 1] if on_coeff else []
    if not forward and varying:  # a constant on the output, broadcast up along a kept axis
        raise CannotFuse(
            Code.BROADCAST_CHANGES_SHAPE,
            f"a constant of shape {coeff.shape} varies along axis {varying[0]}, which "
            f"{node.op_type} '{label(node)}' reduced to size 1: broadcasting grows the output",
        )
    if not forward:
        return coeff if keepdims else np.expand_dims(coeff, axes)
    if varying:
        raise CannotFuse(
            BatchNormCode.POOLS_OVER_CHANNELS,
            f"{node.op_type} '{label(node)}' reduces axis {varying[0]}, along which the map "
            "varies (its channels): the reduction of s * x + t is no map of the reduction of x",
        )
    return coeff if keepdims else np.squeeze(coeff, axis=axes)


def _input_rank(node: ir.Node, out_rank: int, shapes: KnownShapes) -> int:
    """The input rank of the reduction ``node`` whose output has rank ``out_rank``.

    Raises:
        CannotFuse: ``unknown_shape``, neither the input shape nor the axes are known.
    """
    shape = shapes(node.inputs[0])
    if shape is not None:
        return len(shape)
    if node.op_type.startswith("Global") or node.attributes.get_int("keepdims", 1):
        return out_rank
    written = reduce_axes(node, None)  # as written; None when it reduces every axis
    if written is None:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE,
            f"the input rank of {node.op_type} '{label(node)}' is unknown: cannot tell where "
            "its reduced axes were",
        )
    return out_rank + len(written)


def rank_after(node: ir.Node, rank: int, shapes: KnownShapes) -> int:
    """The output rank of ``node`` (one of :data:`ACROSS`) reading a value of rank ``rank``.

    Raises:
        CannotFuse: a map cannot be carried across ``node``: ``maxpool_indices_used``,
            ``perm_mismatch`` (a Transpose perm that does not fit), ``unknown_shape`` (the input
            or output shape of a reshape, or the axes of a reduction).
    """
    op = node.op_type
    if op == "MaxPool" and any(out is not None and num_consumers(out) for out in node.outputs[1:]):
        raise CannotFuse(
            BatchNormCode.MAXPOOL_INDICES_USED,
            f"MaxPool '{label(node)}' has its Indices output in use",
        )
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", ())
        if perm and len(perm) != rank:
            raise CannotFuse(
                BatchNormCode.PERM_MISMATCH,
                f"Transpose '{label(node)}' has perm {perm} for a rank-{rank} input",
            )
    if op in RESHAPES:
        src, dst = shapes(node.inputs[0]), shapes(node.outputs[0])
        if src is None or dst is None:
            raise CannotFuse(
                Code.UNKNOWN_SHAPE,
                f"the {'input' if src is None else 'output'} shape of {op} '{label(node)}' "
                "is unknown: cannot tell where the channels go",
            )
        return len(dst)
    if op in REDUCTIONS:
        axes, keepdims = reduction(node, rank)
        return rank if keepdims else rank - len(axes)
    return rank
