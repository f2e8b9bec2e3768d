"""Matching helpers shared by the LayerNorm and RMSNorm passes (and the passes built on them).

This package finds the core both norms share, a denominator ``sqrt(f * mean_A(v * v) + eps)``
(:func:`match_mean_square`, :func:`centered`), checks what both passes require of it
(:func:`check_core`), and holds a matched norm with what its fused node needs
(:class:`NormMatch`). Each check that fails raises :class:`~fusion.base.CannotFuse` with a
stable :class:`~fusion.base.Code`. The math: docs/fusions/fuse_layernorm.md.

The parts, whose names the passes import from here: :mod:`fusion.norm_match.core`,
:mod:`fusion.norm_match.axes`, :mod:`fusion.norm_match.fused` and
:mod:`fusion.norm_match.shared` (:class:`NormFusionPass`: norms that share values).
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
from fusion.norm_match.fused import (
    NO_EPS,
    ORT_CPU_TYPES,
    NormMatch,
    no_eps_note,
    param_value,
    require_kernel,
    weight_first,
)
from fusion.norm_match.shared import NormFusionPass

__all__ = [
    "FLOAT",
    "NO_EPS",
    "ORT_CPU_TYPES",
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
    "require_kernel",
    "subtracted_mean",
    "variance",
    "weight_first",
]
