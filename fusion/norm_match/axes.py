"""The axes a norm's reductions run over, and the number of elements they sum.

A fused norm normalizes the trailing axes of its input with per-row statistics: this module
checks that a reduction is over the last ``k`` axes with its axes kept (:func:`trailing_axes`,
:func:`reduced_trailing`), gives their sizes (:func:`normalized_dims`), and how many elements a
ReduceSum adds up (:func:`summed_count`), so that a sum times a constant can be checked to be a
mean: a product of float32 constants counts as 1 within :data:`EXACT` (:func:`is_one`).
"""

from __future__ import annotations

import math

import onnx_ir as ir

from fusion._ir import reduce_axes
from fusion.base import CannotFuse, Code

#: How far from 1 a product of float32 constants may be and still count as 1: a few float32
#: roundings (``1/d`` rounded to float32 is within ``2^-24`` of it, relatively). A wrong divisor
#: such as ``d - 1`` is ``1/d`` off, far more for any realistic ``d``.
EXACT = 2.0**-21


def is_one(factor: float) -> bool:
    """Whether ``factor`` is 1 up to a few float32 roundings (see :data:`EXACT`)."""
    return abs(factor - 1.0) <= EXACT


def summed_count(reduce: ir.Node, dims: tuple[int | None, ...]) -> int:
    """How many elements a ReduceSum over the normalized ``dims`` adds up (1 for a ReduceMean,
    which divides by that number itself).

    Raises:
        CannotFuse: ``unknown_shape``: a ReduceSum over axes whose sizes are not known.
    """
    if reduce.op_type != "ReduceSum":
        return 1
    if None in dims:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE,
            f"ReduceSum '{reduce.name}' is divided by a constant, and the number of elements it "
            "sums is not known from the shape: cannot check that the quotient is a mean",
        )
    return math.prod(dims)


def trailing_axes(axes: tuple[int, ...], rank: int | None) -> int | None:
    """How many trailing axes ``axes`` are (``k``), or None if they are not the last k axes.

    Without a known rank only negative axes can be placed: ``(-2, -1)`` is the last two axes
    of any input.
    """
    if rank is not None:
        if any(not -rank <= a < rank for a in axes):
            return None
        axes = tuple(a - rank if a >= 0 else a for a in axes)
    k = len(set(axes))
    return k if k == len(axes) and set(axes) == set(range(-k, 0)) else None


def reduced_trailing(reduce: ir.Node, rank: int | None, *, restored: bool = False) -> int:
    """``k`` for a ReduceMean over the last k axes with keepdims=1.

    Args:
        reduce: the ReduceMean node.
        rank: the rank of its input, if known.
        restored: keepdims=0 is accepted, because Reshape / Expand nodes after the mean put the
            axes back (the caller checks them).

    Raises:
        CannotFuse: ``not_constant`` (the axes), ``axes_not_trailing``, or ``keepdims_zero``
            (the reduction drops the axes and nothing restores them).
    """
    axes = reduce_axes(reduce, rank)
    if axes is None:
        raise CannotFuse(
            Code.NOT_CONSTANT, f"{reduce.name} reduces over axes that are not constant"
        )
    if reduce.attributes.get_int("keepdims", 1) != 1 and not restored:
        raise CannotFuse(
            Code.KEEPDIMS_ZERO, f"{reduce.name} has keepdims=0: not a per-row statistic"
        )
    k = trailing_axes(axes, rank)
    if k is None:
        where = f"a rank-{rank} input" if rank is not None else "an input of unknown rank"
        raise CannotFuse(
            Code.AXES_NOT_TRAILING,
            f"mean over axes {list(axes)} of {where}: the fused op normalizes the trailing "
            "axes only",
        )
    return k


def normalized_dims(k: int, *values: ir.Value | None) -> tuple[int | None, ...]:
    """The sizes of the last ``k`` axes (None where symbolic), from the first known shape."""
    for value in values:
        if value is not None and value.shape is not None and len(value.shape) >= k:
            dims = value.shape.dims[len(value.shape) - k :]
            return tuple(d if isinstance(d, int) else None for d in dims)
    return (None,) * k
