"""``normexport explain``: every normalization-like subgraph, what it became, or why not.

The question users ask most about these tools is "why wasn't my LayerNorm fused?". This lists,
for one model, each candidate the passes found: the norms the exporter already emitted as one
op, each rewrite (what it became), and each candidate left alone with its reason. The passes run
as a run of the main command on the same provider runs them (its fusion policy,
:func:`normexport.pipeline.job.run_policy`), so the two never disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import onnx_ir as ir
from rich.console import Console
from rich.table import Table

import fusion


@dataclasses.dataclass(frozen=True)
class Finding:
    """One normalization-like subgraph.

    Attributes:
        kind: ``batchnorm``, ``layernorm``, ``rmsnorm`` or ``skip`` (``note`` for a note;
            ``norm``, ``batchnorm`` or ``attention`` for an unlisted one).
        node: the anchor node's name in the model as given, after its subgraph's path where it
            is in one (:attr:`fusion.Refused.where`; empty for a note).
        outcome: ``"already fused"``, ``"fused"``, ``"left alone"``, ``"unlisted"`` (what
            :func:`fusion.unlisted` finds: it looks like a norm, a BatchNorm or an attention and
            no pass matched it), or ``"note"``: something
            the user should know about the model that is no one subgraph's outcome (e.g. a norm
            fused with epsilon 0 because the file has no eps: :attr:`fusion.FusionReport.notes`).
        detail: the op it is or became, the reason it was left alone, or the note.
    """

    kind: str
    node: str
    outcome: str
    detail: str


#: The outcome of a look-alike that no pass matched (:func:`fusion.unlisted`).
UNLISTED = "unlisted"


@dataclasses.dataclass(frozen=True)
class AlreadyFused:
    """A norm that the model held as one op before normexport's passes.

    Attributes:
        kind: ``layernorm``, ``rmsnorm`` or ``skip``.
        node: the node's name (its op type where it has none).
        op: its op type, e.g. ``"LayerNormalization"``.
    """

    kind: str
    node: str
    op: str


def already_fused(model: ir.Model) -> list[AlreadyFused]:
    """The norms that ``model`` already holds as one op, in graph order."""
    return [
        AlreadyFused(fusion.NORM_OPS[op], node.name or node.op_type, node.op_type)
        for node in model.graph
        if (op := fusion.Op(node.op_type, node.domain)) in fusion.registry.FUSED_NORM_OPS
    ]


def from_report(
    fused: Iterable[fusion.Fused],
    refused: Iterable[fusion.Refused],
    already: Iterable[AlreadyFused] = (),
    notes: Iterable[str] = (),
) -> list[Finding]:
    """Findings from a fusion report's outcomes and notes (:class:`fusion.FusionReport`, or a
    :class:`normexport.report.Fusions`) and :func:`already_fused` of the model before the
    passes."""
    findings = [Finding(a.kind, a.node, "already fused", a.op) for a in already]
    family = {kind.name: kind.family for kind in fusion.registry.KINDS}
    findings += [Finding(family[f.kind], f.where, "fused", f.became) for f in fused]
    findings += [Finding(r.family, r.where, "left alone", r.detail) for r in refused]
    findings += [Finding("note", "", "note", text) for text in notes]
    return findings


def explain(model: ir.Model, policy: fusion.Policy | None = None) -> list[Finding]:
    """Run the passes on ``model`` (in place) under ``policy``, as a run with that policy runs
    them (the CLI gives the run's, :func:`normexport.pipeline.job.run_policy`), and list
    what they found.

    Args:
        model: the model; it is optimized in place (pass a copy to keep the original).
        policy: the fusion policy; None: :class:`fusion.Policy`'s defaults.
    """
    already = already_fused(model)
    outcomes = fusion.optimize(model, policy)
    findings = from_report(outcomes.fused, outcomes.refused, already, outcomes.notes)
    return findings + [
        Finding(
            u.family, u.where, UNLISTED, "looks like one; no pass matched it, no report lists it"
        )
        for u in fusion.unlisted(model, outcomes)
    ]


def render(findings: list[Finding], title: str, console: Console) -> None:
    """Print ``findings`` as one table, with a count per outcome and the notes below it."""
    table = Table(title=title, title_justify="left")
    for col in ("kind", "node", "outcome", "what it is / became, or why not"):
        table.add_column(col, overflow="fold")
    style = {"fused": "green", "already fused": "cyan", "left alone": "yellow", UNLISTED: "red"}
    subgraphs = [f for f in findings if f.outcome in style]
    for f in subgraphs:
        table.add_row(f.kind, f.node, f"[{style[f.outcome]}]{f.outcome}[/]", f.detail)
    console.print(table)
    if not subgraphs:
        console.print("no normalization-like subgraph found")
    for outcome in style:
        n = sum(f.outcome == outcome for f in subgraphs)
        if n:
            console.print(f"{outcome}: {n}")
    for f in findings:
        if f.outcome == "note":
            console.print(f"[yellow]note[/]: {f.detail}")
