""":func:`optimize`: the run of the fusion passes on one model, in place (what
:func:`fusion.optimize` is): the clean-ups and shapes around the passes of
:data:`fusion.registry.PASSES` that the run's :class:`fusion.base.Policy` enables."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import onnx_ir as ir
import onnx_ir.passes.common

from fusion._ir import label, opset_version
from fusion._scopes import path_of, scopes
from fusion.base import MS_DOMAIN, Fused, FusionPass, FusionReport, Policy
from fusion.cleanup import Cleanup, SimplifyWithShapes, normalize_ir_version
from fusion.registry import PASSES
from fusion.shapes import DropShapes, FillShapes


def optimize(
    model: ir.Model,
    policy: Policy | None = None,
    *,
    exclude: Collection[Fused] = (),
    **settings,
) -> FusionReport:
    """Fold BatchNorm and fuse LayerNorm / RMSNorm in ``model``, in place.

    Inlines the model's local functions first (onnx_ir's ``InlinePass``; a note says so), as ONNX
    Runtime does when it loads the model: their nodes are then fused like any other. The passes run
    in the main graph and in every subgraph (``If``, ``Loop``, ``Scan``; docs/fusions.md#subgraphs).
    Runs, as one :class:`onnx_ir.passes.PassManager`: exact clean-up (constant folding, CSE, dead
    nodes), :class:`FillShapes` (ONNX shape inference for the values that carry no shape, as the
    TorchScript exporter leaves them; :class:`DropShapes` takes them off again after the passes),
    the exact rewrites those shapes allow (:class:`fusion.cleanup.SimplifyWithShapes`), then each
    pass of :data:`fusion.registry.PASSES` that the policy enables, in the registry's order
    (FoldBatchNorm first, FuseSkip last), then clean-up again. An op is only emitted where the
    model's opset (or, for ``target="ort"``, ONNX Runtime) has it; the opset is raised in two cases
    only, to 23: by FuseGroupQueryAttention, for a decoder's attention with a KV cache or a run-time
    mask (:mod:`fusion.fuse_gqa.standard`), and by FuseSDPA, for an attention it makes ONNX's
    ``Attention`` (:mod:`fusion.fuse_sdpa`); each is said in the report's notes.

    Args:
        model: the model, changed in place.
        policy: the fusion policy (:class:`fusion.base.policy.Policy`); None: its defaults.
        exclude: rewrites to leave out, as an earlier run on the same model reported them (their
            ``kind``, ``node`` and ``path``): the pass that makes that kind skips the candidate
            anchored there, and records nothing for it (see :class:`FusionPass`).
        **settings: fields of :class:`fusion.base.policy.Policy` by name (``target="onnx"``),
            each replacing that field of ``policy``.

    Returns:
        What was fused, and what was refused with the reason, in pass order.

    Raises:
        ValueError: the policy is not one :class:`fusion.base.policy.Policy` accepts.
        TypeError: a name of ``settings`` is no field of :class:`fusion.base.policy.Policy`.
    """
    policy = dataclasses.replace(policy or Policy(), **settings)
    passes = _passes(policy, exclude)
    report = FusionReport()
    if (note := normalize_ir_version(model)) is not None:
        report.note(note)
    if functions := len(model.functions):
        ir.passes.common.InlinePass()(model)
        report.note(
            f"the model's {functions} local function(s) were inlined (ONNX Runtime inlines them "
            "too when it loads the model), so that the passes see their nodes"
        )
    fill = FillShapes()
    steps = [Cleanup(), fill, SimplifyWithShapes(), _Plan(passes), *passes]
    steps += [DropShapes(fill), Cleanup(final=True)]
    ir.passes.PassManager(steps)(model)
    for fusion_pass in passes:
        report.extend(fusion_pass.outcomes)
    _drop_removed_batchnorms(report, model)
    _import_ms_domain(model)
    return report


def _passes(policy: Policy, exclude: Collection[Fused]) -> list[FusionPass]:
    """The passes :func:`optimize` runs under ``policy``, each given the policy's fields it
    declares (:attr:`FusionPass.settings`) and told the rewrites to leave out."""
    return [
        p(
            policy.target,
            exclude={(f.path, f.node) for f in exclude if f.kind in {k.name for k in p.kinds}},
            **{name: getattr(policy, name) for name in p.settings},
        )
        for p in PASSES
        if p.enabled(policy)
    ]


class _Plan(ir.passes.InPlacePass):
    """Each pass's :meth:`FusionPass.plan`, in pass order, before the first pass runs."""

    def __init__(self, passes: list[FusionPass]):
        super().__init__()
        self.passes = passes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = opset_version(model)
        for fusion_pass in self.passes:
            fusion_pass.plan(model)
        return ir.passes.PassResult(model, modified=opset_version(model) != opset)


def _import_ms_domain(model: ir.Model) -> None:
    """Declare com.microsoft version 1 (the contrib ops' only version) where a pass emitted a
    node of that domain, in any subgraph too, and the model does not import it: ONNX Runtime
    runs such a model, but ONNX's shape inference and checker refuse it ("No opset import for
    domain com.microsoft"), and so does every tool built on them (float16 converters)."""
    if MS_DOMAIN in model.opset_imports:
        return
    if any(n.domain == MS_DOMAIN for n in ir.traversal.RecursiveGraphIterator(model.graph)):
        model.opset_imports[MS_DOMAIN] = 1


def _drop_removed_batchnorms(report: FusionReport, model: ir.Model) -> None:
    """A BatchNorm one pass left alone and a later one removed (an identity branch's, merged
    with its block by MergeBranches) is no longer left alone: drop its refusal."""
    labels = {(path_of(s), label(n)) for s in (model, *scopes(model)) for n in s.graph}
    report.refused = [
        r for r in report.refused if r.family != "batchnorm" or (r.path, r.node) in labels
    ]
