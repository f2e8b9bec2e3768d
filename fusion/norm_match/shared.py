"""Norms of one pass that share intermediate values (:class:`NormFusionPass`): the pass plans
which candidates can all be fused together, so that a value shared only by norms being fused
blocks none of them (docs/fusions/fuse_layernorm.md).
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import label
from fusion.base import CannotFuse, Code, NodeFusionPass


def _outside_readers(value: ir.Value, inside: set[ir.Node]) -> bool:
    """Whether ``value`` is a graph output or read by a node not in ``inside``."""
    return value.is_graph_output() or any(use.node not in inside for use in value.uses())


class NormFusionPass(NodeFusionPass):
    """A :class:`~fusion.base.NodeFusionPass` whose norms may share intermediate values.

    Two norms of one input with different eps (or an RMSNorm and a scaled copy) compute the
    same ``x - mean(x)``, square and variance; common-subexpression elimination makes them one
    value. Each fused node computes its norm from ``x`` again, so a shared value blocks nothing
    when every reader of it belongs to a norm that is fused too: it goes once the last of them
    is. :meth:`apply` first matches every candidate without rewriting (a plan), drops until
    nothing changes those that share a value with a node no kept candidate covers, then runs
    the base pass, whose :meth:`match` calls :meth:`check_shared`.
    """

    _fusing: set[ir.Node] | None = None

    def apply(self, model: ir.Model) -> bool:
        """Plan (:meth:`_plan`), then fuse as :meth:`NodeFusionPass.apply` does."""
        self._fusing = self._plan(model)
        try:
            return super().apply(model)
        finally:
            self._fusing = None

    def _plan(self, model: ir.Model) -> set[ir.Node]:
        """The nodes of the candidates that can all be fused together (see the class)."""
        self._fusing = None
        matches = self.candidates(model)
        while True:
            covered = {n for m in matches for n in m.nodes}
            kept = [m for m in matches if not any(_outside_readers(v, covered) for v in m.shared)]
            if len(kept) == len(matches):
                return covered
            matches = kept

    def check_shared(self, nodes: list[ir.Node], keep: ir.Value, what: str) -> list[ir.Value]:
        """The outputs of ``nodes`` other than ``keep`` that are read outside them.

        While planning every such value is allowed (and returned, for
        :attr:`~fusion.norm_match.NormMatch.shared`); then only those whose readers all belong to
        planned norms.

        Raises:
            CannotFuse: ``shared_output``: a value is a graph output or read by a node that no
                norm being fused covers.
        """
        inside = set(nodes)
        shared = [
            v for n in nodes for v in n.outputs if v is not keep and _outside_readers(v, inside)
        ]
        if self._fusing is None:
            return shared
        for value in shared:
            if _outside_readers(value, self._fusing | inside):
                others = (u.node for u in value.uses() if u.node not in self._fusing | inside)
                reader = next(others, None)
                where = f"by '{label(reader)}'" if reader is not None else "as a graph output"
                raise CannotFuse(
                    Code.SHARED_OUTPUT,
                    f"{value.name} is also read outside the {what} subgraph ({where}), not only "
                    "by other norms being fused",
                )
        return shared
