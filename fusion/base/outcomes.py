"""What a pass did, typed: a rewrite is a :class:`Fused`, a candidate left alone a
:class:`Refused`; a :class:`FusionReport` collects them with the notes, and a
:class:`FusionResult` is a pass's result that carries its report.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import onnx_ir as ir


@dataclasses.dataclass(frozen=True)
class Fused:
    """One rewrite that a pass made.

    Attributes:
        kind: a :attr:`~fusion.base.Kind.name`, e.g. ``"layernorm_fused"``.
        node: name of the anchor node (the BatchNormalization or linear layer, or the node that
            produced the normalized output) in the graph before the rewrite; for attention and
            GELU, the Softmax, or the Erf or Tanh, that the fused node replaced. A pass given
            it in ``exclude`` leaves this rewrite out.
        became: what it was rewritten into, e.g. ``"LayerNormalization"`` or
            ``"folded into Conv 'conv1'"``.
        count: how many norms the rewrite removed (a chain of two BatchNorms folded at once
            counts 2).
        path: the subgraph the anchor is in, e.g. ``If 'cond' / then_branch``
            (docs/fusions.md#subgraphs); None in the main graph.
    """

    kind: str
    node: str
    became: str
    count: int = 1
    path: str | None = None

    @property
    def where(self) -> str:
        """The anchor for a reader: its name, after its subgraph's path where it has one."""
        return where_in(self.node, self.path)


@dataclasses.dataclass(frozen=True)
class Refused:
    """One candidate subgraph that a pass matched but left alone.

    Attributes:
        family: the :attr:`~fusion.base.Kind.family` of the candidate, e.g. ``"batchnorm"``.
        node: name of the anchor node, as it appears in the ONNX graph.
        code: the stable reason (a value of ``fusion.Code``).
        detail: one sentence that says why the rewrite would not be exact.
        module: the path of the ``nn.Module`` the anchor came from (``layer1.0.bn1``), where
            the exporter recorded it (:func:`fusion._ir.module_path`), else None.
        path: the subgraph the anchor is in, e.g. ``If 'cond' / then_branch``
            (docs/fusions.md#subgraphs); None in the main graph.
    """

    family: str
    node: str
    code: str
    detail: str
    module: str | None = None
    path: str | None = None

    @property
    def where(self) -> str:
        """The anchor for a reader: ``module (node)`` where the module is known, the node after
        its subgraph's path (``If 'cond' / then_branch / 'ReduceMean_3'``) where it has one."""
        node = where_in(self.node, self.path)
        return f"{self.module} ({node})" if self.module else node


def where_in(node: str, path: str | None) -> str:
    """A node for a reader: ``node`` (a name) in the main graph, ``path / 'node'`` in the
    subgraph at ``path`` (:attr:`Refused.path`)."""
    return f"{path} / '{node}'" if path else node


@dataclasses.dataclass
class FusionReport:
    """What passes did: rewrites and refusals in graph order, notes, counts per kind.

    A refusal of the same (family, node, code, path) is kept once, so a pass run twice does not
    repeat it; two reasons for one candidate (a rewrite undone, then another pass's refusal) are
    both kept.
    """

    fused: list[Fused] = dataclasses.field(default_factory=list)
    refused: list[Refused] = dataclasses.field(default_factory=list)
    #: Changes to the model that are no fusion but that a user should know of (one sentence
    #: each), e.g. an IR version raised to make an old file valid.
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def counts(self) -> Counter:
        """Rewrites per :attr:`~fusion.base.Kind.name`."""
        counts = Counter()
        for f in self.fused:
            counts[f.kind] += f.count
        return counts

    def record(
        self, kind: str, node: str, became: str, count: int = 1, path: str | None = None
    ) -> None:
        """Record a rewrite of ``kind`` anchored at ``node`` (in the subgraph ``path``) into
        ``became``."""
        self.fused.append(Fused(kind, node, became, count, path))

    def refuse(
        self,
        family: str,
        node: str,
        code: str,
        detail: str,
        module: str | None = None,
        path: str | None = None,
    ) -> None:
        """Record that the candidate of ``family`` anchored at ``node`` (from the user's
        ``module``, where known; in the subgraph ``path``) was left alone, and why: ``code``, a
        member of a code enum (:class:`~fusion.base.Code`, a pass's own) or its value."""
        key = (family, node, code, path)
        if any((r.family, r.node, r.code, r.path) == key for r in self.refused):
            return
        self.refused.append(Refused(family, node, str(code), detail, module, path))

    def note(self, text: str) -> None:
        """Record a change to the model that is not a fusion (kept once)."""
        if text not in self.notes:
            self.notes.append(text)

    def extend(self, other: FusionReport) -> None:
        """Append ``other``'s rewrites, refusals and notes (refusals and notes kept once)."""
        self.fused.extend(other.fused)
        for r in other.refused:
            self.refuse(r.family, r.node, r.code, r.detail, r.module, r.path)
        for text in other.notes:
            self.note(text)

    def codes(self, family: str | None = None) -> list[str]:
        """The refusal codes, in graph order, of one family or of all."""
        return [r.code for r in self.refused if family is None or r.family == family]

    def to_dict(self, kinds: tuple[str, ...] = ()) -> dict[str, Any]:
        """JSON-ready form: ``{kind: count, ..., "fused": [...], "refused": [...],
        "notes": [...]}``, with a count (zero or not) for every name in ``kinds``."""
        counts = self.counts
        out: dict[str, Any] = {kind: counts.get(kind, 0) for kind in kinds}
        out["fused"] = [dataclasses.asdict(f) for f in self.fused]
        out["refused"] = [dataclasses.asdict(r) for r in self.refused]
        out["notes"] = list(self.notes)
        return out


@dataclasses.dataclass
class FusionResult(ir.passes.PassResult):
    """A :class:`~onnx_ir.passes.PassResult` that also carries the pass's outcomes."""

    outcomes: FusionReport = dataclasses.field(default_factory=FusionReport)
