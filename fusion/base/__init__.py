"""What every fusion pass shares: the kinds of rewrite, typed outcomes, and the pass base class.

A pass is an :class:`onnx_ir.passes.InPlacePass`. It declares what it needs instead of testing
it inside its matcher: the targets it runs for (:attr:`FusionPass.targets`), the field of the
run's :class:`Policy` that turns it on (:attr:`FusionPass.option`), the fields it reads
(:attr:`FusionPass.settings`), and the default-domain opset its ops need per target
(:attr:`FusionPass.needs_opset`). Each call collects its own :class:`FusionReport`
(:attr:`FusionPass.outcomes`, also on the returned :class:`FusionResult`): a rewrite is a
:class:`Fused`, a candidate left alone a :class:`Refused` with a stable :class:`Code`.

To add a fusion: one pass module that subclasses :class:`NodeFusionPass` (or
:class:`FusionPass`) and declares its :class:`Kind`, its summary and its own codes, one line in
:data:`fusion.registry.PASSES`, its doc docs/fusions/<module>.md and one test module
(docs/architecture.md#recipes).

The parts, imported from here: :mod:`fusion.base.policy` (the targets and :class:`Policy`),
:mod:`fusion.base.passes` (:class:`Op`, :class:`Kind` and the pass classes),
:mod:`fusion.base.outcomes` (:class:`Fused`, :class:`Refused`, :class:`FusionReport`,
:class:`FusionResult`) and :mod:`fusion.base.codes` (:class:`Code` and :class:`CannotFuse`).
"""

from __future__ import annotations

from fusion.base.codes import CannotFuse, Code
from fusion.base.outcomes import Fused, FusionReport, FusionResult, Refused
from fusion.base.passes import MS_DOMAIN, FusionPass, Kind, NodeFusionPass, Op
from fusion.base.policy import TARGETS, Policy

__all__ = [
    "MS_DOMAIN",
    "TARGETS",
    "CannotFuse",
    "Code",
    "Fused",
    "FusionPass",
    "FusionReport",
    "FusionResult",
    "Kind",
    "NodeFusionPass",
    "Op",
    "Policy",
    "Refused",
]
