"""The variance written from the moments, ``Max(E[x^2] - E[x]^2, 0)``, as Flax's ``nnx.LayerNorm``
computes it and jax2onnx writes it, and as jax2tf then tf2onnx write it (each mean a
``ReduceSum`` divided by the count, the clamp ``Max(0, .)``; over a batch of unknown size the
sums with ``keepdims=0``, put back by a Reshape checked by :mod:`fusion.norm_match.restored`).
Why it is the variance, and why the clamp at 0 goes: docs/fusions/fuse_layernorm.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array, producer, scalar_const
from fusion.base import CannotFuse, Code
from fusion.norm_match.core import (
    Centering,
    MeanSquare,
    restored,
    scaled_mean_square,
    scaled_reduction,
    square_of,
    under_sqrt,
)


def _bound(value: ir.Value | None, v: ir.Value) -> float | None:
    """The number ``c`` when ``value`` is a constant whose elements are all ``c`` (a scalar, or
    jnp's scalar broadcast by jax2tf: a full constant, or ``Expand`` of a scalar) and taking
    ``Max`` with it leaves the shape of ``v``; None otherwise."""
    expand = producer(value, "Expand")
    source = expand.inputs[0] if expand is not None else value
    array = const_array(source)
    if array is None or array.size == 0 or scalar_const(v) is not None:
        return None
    if array.size > 1 or expand is not None:
        shape = value.shape
        if shape is None or v.shape is None or not shape.is_static() or not v.shape.is_static():
            return None
        if np.broadcast_shapes(tuple(shape), tuple(v.shape)) != tuple(v.shape):
            return None
    flat = array.reshape(-1)
    return float(flat[0]) if (flat == flat[0]).all() else None


def _clamped(value: ir.Value) -> tuple[ir.Value, list[ir.Node], float | None]:
    """``(v, nodes, c)`` for ``value = Max(v, c)`` (either order, ``c`` a constant of one
    value: :func:`_bound`), ``Relu(v)`` (``c = 0``) or ``Clip(v, c)`` with no max;
    ``(value, [], None)`` for anything else."""
    node = producer(value, "Relu")
    if node is not None:
        return node.inputs[0], [node], 0.0
    node = producer(value, "Max")
    if node is not None and len(node.inputs) == 2:
        for v, bound in (node.inputs, node.inputs[::-1]):
            if (c := _bound(bound, v)) is not None:  # an Expand of c stays: a constant
                return v, [node], c
    node = producer(value, "Clip")  # Clip(v, c) with no max
    no_max = node is not None and (len(node.inputs) < 3 or node.inputs[2] is None)
    if no_max and len(node.inputs) >= 2 and (c := scalar_const(node.inputs[1])) is not None:
        return node.inputs[0], [node], c
    return value, [], None


def match_moments(den: ir.Value) -> MeanSquare | None:
    """Match ``den = Sqrt(Add(Max(E[x^2] - E[x]^2, 0), eps))`` (docs/fusions/fuse_layernorm.md).

    Returns:
        A :class:`~fusion.norm_match.core.MeanSquare` whose ``value`` is ``x`` itself, whose
        ``reduce`` is the mean of its square and whose ``mean`` is ``E[x]`` (the caller
        requires both to be means over the trailing axes, and the numerator to be ``x`` minus
        a mean over the same axes), or None when ``den`` is not of that form.

    Raises:
        CannotFuse: ``clamp_not_zero``: the difference of the moments is clamped at a value
            other than 0 (a different function).
    """
    return under_sqrt(den, moments_radicand)


def moments_radicand(value: ir.Value) -> MeanSquare | None:
    """:func:`match_moments` without the root: ``Add(Max(E[x^2] - E[x]^2, 0), eps)``, the
    clamped difference maybe put back to its keepdims shape by Reshape / Expand nodes before
    or after the clamp (:attr:`~fusion.norm_match.core.MeanSquare.restores`; jax2tf's
    ``keepdims=0`` sums: docs/fusions/fuse_layernorm.md).

    Raises:
        CannotFuse: ``clamp_not_zero`` (:func:`match_moments`), ``variance_reshaped``
            (``E[x^2]`` alone goes through a Reshape / Expand before the difference),
            ``keepdims_zero`` (one moment keeps the reduced axes and the other drops them:
            their difference broadcasts to a table of rows against rows).
    """
    add = producer(value, "Add")
    if add is None:
        return None
    for var, eps in (add.inputs, add.inputs[::-1]):
        var, after = restored(var)
        inner, clamp, bound = _clamped(var)
        inner, before = restored(inner)
        sub = producer(inner, "Sub")
        if sub is None:
            continue
        squares = scaled_mean_square(sub.inputs[0])
        mean_sq = square_of(sub.inputs[1])
        if squares is None or mean_sq is None:
            continue
        mean = scaled_reduction(mean_sq[0])
        if mean is None or mean[0].inputs[0] is not squares.value:
            continue
        _check_moments(squares, mean[0], clamp, bound)
        reduce, factor, steps = mean
        restores = [*before, *after]
        nodes = [*squares.nodes, reduce, *steps, mean_sq[1], sub, *before, *clamp, *after, add]
        found = MeanSquare(squares.value, squares.reduce, None, squares.factor, restores, nodes)
        found.mean = Centering(squares.value, reduce, factor, [reduce, *steps], restores)
        found.take_eps(eps)
        return found
    return None


def _check_moments(squares: MeanSquare, mean: ir.Node, clamp: list[ir.Node], bound) -> None:
    """Refuse the moments ``E[x^2]`` (``squares``) and ``E[x]`` (its reduction ``mean``),
    clamped by ``clamp`` at ``bound``, where they are no variance of the keepdims shape.

    Raises:
        CannotFuse: the codes of :func:`moments_radicand`.
    """
    if bound is not None and bound != 0.0:
        raise CannotFuse(
            Code.CLAMP_NOT_ZERO,
            f"E[x^2] - E[x]^2 is clamped at {bound:g} by {clamp[0].op_type} "
            f"'{clamp[0].name}': only a clamp at 0 is implied by the variance",
        )
    if squares.restores:
        raise CannotFuse(
            Code.VARIANCE_RESHAPED,
            f"E[x^2] goes through {squares.restores[0].op_type} '{squares.restores[0].name}' "
            "before E[x]^2 is subtracted: only the difference of the moments may be reshaped",
        )
    keepdims = (
        squares.reduce.attributes.get_int("keepdims", 1),
        mean.attributes.get_int("keepdims", 1),
    )
    if keepdims[0] != keepdims[1]:
        raise CannotFuse(
            Code.KEEPDIMS_ZERO,
            f"E[x^2] ('{squares.reduce.name}') and E[x] ('{mean.name}') differ in keepdims: "
            "their difference broadcasts rows against rows",
        )
