"""The variance written from the moments, ``Max(E[x^2] - E[x]^2, 0)``, as Flax's ``nnx.LayerNorm``
computes it and jax2onnx writes it. Why it is the variance: docs/fusions.md#fuselayernorm.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import producer, scalar_const
from fusion.norm_match.core import (
    REDUCTIONS,
    MeanSquare,
    scaled_mean_square,
    square_of,
    under_sqrt,
)


def _clipped(value: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """``(v, nodes)`` for ``value = Max(v, 0)`` (either order) or ``Clip(v, 0)``, else
    ``(value, [])``."""
    node = producer(value, "Max")
    if node is not None and len(node.inputs) == 2:
        for v, zero in (node.inputs, node.inputs[::-1]):
            if scalar_const(zero) == 0.0:
                return v, [node]
    node = producer(value, "Clip")  # Clip(v, 0) with no max
    no_max = node is not None and (len(node.inputs) < 3 or node.inputs[2] is None)
    if no_max and len(node.inputs) >= 2 and scalar_const(node.inputs[1]) == 0.0:
        return node.inputs[0], [node]
    return value, []


def match_moments(den: ir.Value) -> MeanSquare | None:
    """Match ``den = Sqrt(Add(Max(E[x^2] - E[x]^2, 0), eps))`` (docs/fusions.md#fuselayernorm).

    Returns:
        A :class:`~fusion.norm_match.core.MeanSquare` whose ``value`` is ``x`` itself, whose
        ``reduce`` is the mean of its square and whose ``mean`` is the reduction of ``E[x]``
        (the caller requires the numerator to be ``x`` minus a mean over the same axes), or
        None when ``den`` is not of that form.
    """
    return under_sqrt(den, moments_radicand)


def moments_radicand(value: ir.Value) -> MeanSquare | None:
    """:func:`match_moments` without the root: ``Add(Max(E[x^2] - E[x]^2, 0), eps)``."""
    add = producer(value, "Add")
    if add is None:
        return None
    for var, eps in (add.inputs, add.inputs[::-1]):
        inner, clip = _clipped(var)
        sub = producer(inner, "Sub")
        if sub is None:
            continue
        squares = scaled_mean_square(sub.inputs[0])
        mean_sq = square_of(sub.inputs[1])
        if squares is None or mean_sq is None or squares.factor != 1.0 or squares.restores:
            continue
        mean = mean_sq[0].producer()
        if mean is None or mean.op_type not in REDUCTIONS or mean.domain != "":
            continue
        if mean.op_type == "ReduceSum" or mean.inputs[0] is not squares.value:
            continue
        nodes = [*squares.nodes, mean, mean_sq[1], sub, *clip, add]
        found = MeanSquare(squares.value, squares.reduce, None, 1.0, [], nodes, mean=mean)
        found.take_eps(eps)
        return found
    return None
