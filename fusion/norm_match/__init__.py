"""Matching helpers shared by the LayerNorm and RMSNorm passes (and the passes built on them).

LayerNorm (Ba, Kiros & Hinton 2016) and RMSNorm (Zhang & Sennrich 2019) share one core: a
denominator ``sqrt(f * mean_A(v * v) + eps)`` over the trailing axes ``A`` of some ``v`` (the
centered input ``x - mean_A(x)`` for LayerNorm, ``x`` itself for RMSNorm), a division by it,
then an optional Cast, constant weight and bias. ONNX's ``LayerNormalization`` (opset 17) and
``RMSNormalization`` (opset 23) are defined as those function bodies (onnx/docs/Operators.md),
with ``axis = -k`` for ``k`` normalized axes and ``stash_type=1`` (statistics in float32).

This package finds that core (:func:`match_mean_square`, :func:`centered`), checks what both
passes require of it (:func:`check_core`), and holds a matched norm with what its fused node
needs (:class:`NormMatch`). Each check that fails raises :class:`~fusion.base.CannotFuse` with
a stable :class:`~fusion.base.Code`.

A constant factor ``f > 0`` on the mean square is exact to move into the fused op::

    v / sqrt(f * ms + eps) = f^(-1/2) * v / sqrt(ms + eps / f)

so the op takes ``epsilon = eps / f`` and ``Scale = w / sqrt(f)`` (:attr:`NormMatch.epsilon`,
:meth:`NormMatch.scale`).

The parts, whose names the passes import from here: :mod:`fusion.norm_match.core` (finding
and checking the core), :mod:`fusion.norm_match.axes` (the axes and element counts of its
reductions), :mod:`fusion.norm_match.fused` (:class:`NormMatch`: weight, bias, casts, the
fused node) and :mod:`fusion.norm_match.shared` (:class:`NormFusionPass`: norms that share
values).
"""

from __future__ import annotations

from fusion.norm_match.axes import normalized_dims, reduced_trailing
from fusion.norm_match.core import (
    FLOAT,
    REDUCTIONS,
    Centering,
    centered,
    check_core,
    match_eps_outside_sqrt,
    match_mean_square,
)
from fusion.norm_match.folded import divided, subtracted_mean, variance
from fusion.norm_match.fused import NO_EPS, NormMatch, no_eps_note, param_value, weight_first
from fusion.norm_match.shared import NormFusionPass

__all__ = [
    "FLOAT",
    "NO_EPS",
    "REDUCTIONS",
    "Centering",
    "NormFusionPass",
    "NormMatch",
    "centered",
    "check_core",
    "divided",
    "match_eps_outside_sqrt",
    "match_mean_square",
    "no_eps_note",
    "normalized_dims",
    "param_value",
    "reduced_trailing",
    "subtracted_mean",
    "variance",
    "weight_first",
]
