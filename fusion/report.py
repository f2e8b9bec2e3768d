"""What the fusion passes did to a model: counts of each rewrite, and each refusal with its reason.

A refusal is a feature, not a failure: a subgraph that looks like a norm but is not exactly one
(eps outside the square root, a BatchNorm before a padded Conv, a linear layer whose output has
another consumer) is left alone and recorded here so that a user can see why.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

#: The count keys that every report carries, zero or not. ``affine_folded`` counts chains of
#: scalar constant Mul / Add / Sub / Div folded into a linear layer (not BatchNorms, but the
#: same exact fold: attention's 1/sqrt(d) scaling after a projection is the common one).
#: ``attention_fused`` and ``gelu_fused`` count the contrib ops :mod:`fusion.fuse_attention`
#: adds (not norms: they keep a transformer as fast as the other optimizers make it).
FUSION_KINDS = (
    "batchnorm_folded",
    "affine_folded",
    "layernorm_fused",
    "rmsnorm_fused",
    "skip_fused",
    "attention_fused",
    "gelu_fused",
)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One candidate subgraph that a pass matched but left alone.

    Attributes:
        kind: the family of the candidate: ``"batchnorm"``, ``"layernorm"``, ``"rmsnorm"``
            or ``"skip"``.
        node: name of the anchor node (the BatchNormalization, or the node that produces the
            normalized output), as it appears in the ONNX graph.
        reason: one sentence that says why the rewrite would not be exact.
    """

    kind: str
    node: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One rewrite that a pass made.

    Attributes:
        kind: one of :data:`FUSION_KINDS`.
        node: name of the anchor node (the BatchNormalization or linear layer, or the node that
            produced the normalized output) in the graph before the rewrite; for attention and
            GELU, the fused node.
        became: what it was rewritten into, e.g. ``"LayerNormalization"`` or
            ``"folded into Conv 'conv1'"``.
        count: how many norms the rewrite removed (a chain of two BatchNorms folded at once
            counts 2).
    """

    kind: str
    node: str
    became: str
    count: int = 1


@dataclasses.dataclass
class FusionReport:
    """What the passes did: rewrites and refusals, in graph order; counts per kind.

    Passes add to one shared report; a refusal of the same (kind, node) is kept once, so a pass
    that is run twice does not repeat its reasons.
    """

    fused: list[Fusion] = dataclasses.field(default_factory=list)
    refused: list[Refusal] = dataclasses.field(default_factory=list)
    #: Changes to the model that are no fusion but that a user should know of (one sentence
    #: each), e.g. an IR version raised to make an old file valid.
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def counts(self) -> Counter:
        """Rewrites per kind (see :data:`FUSION_KINDS`)."""
        counts = Counter()
        for f in self.fused:
            counts[f.kind] += f.count
        return counts

    def record(self, kind: str, node: str, became: str, count: int = 1) -> None:
        """Record a rewrite of ``kind`` anchored at ``node`` into ``became``."""
        self.fused.append(Fusion(kind, node, became, count))

    def refuse(self, kind: str, node: str, reason: str) -> None:
        """Record that the candidate anchored at ``node`` was left alone, and why."""
        if any(r.kind == kind and r.node == node for r in self.refused):
            return
        self.refused.append(Refusal(kind, node, reason))

    def note(self, text: str) -> None:
        """Record a change to the model that is not a fusion (kept once)."""
        if text not in self.notes:
            self.notes.append(text)

    def to_dict(self) -> dict:
        """JSON-ready form: ``{kind: count, ..., "fused": [...], "refused": [...],
        "notes": [...]}``."""
        counts = self.counts
        out = {kind: counts.get(kind, 0) for kind in FUSION_KINDS}
        out["fused"] = [dataclasses.asdict(f) for f in self.fused]
        out["refused"] = [dataclasses.asdict(r) for r in self.refused]
        out["notes"] = list(self.notes)
        return out
