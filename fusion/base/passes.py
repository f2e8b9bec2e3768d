"""The pass base classes and what a pass declares: the targets (:data:`TARGETS`), the ops
(:class:`Op`) and kinds of rewrite (:class:`Kind`), :class:`FusionPass` with its opset gate,
and :class:`NodeFusionPass`, which matches and rewrites node by node.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, NamedTuple

import onnx_ir as ir

from fusion._ir import label, module_path, opset_version
from fusion._scopes import path_of, scopes
from fusion.base.codes import CannotFuse, Code
from fusion.base.outcomes import FusionReport, FusionResult
from fusion.base.policy import TARGETS, Policy

MS_DOMAIN = "com.microsoft"


class Op(NamedTuple):
    """An operator as a graph names it: ``op_type`` in ``domain`` (``""`` is ai.onnx)."""

    op_type: str
    domain: str = ""


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of rewrite, as the report counts it.

    Attributes:
        name: the count key in the report, e.g. ``"layernorm_fused"``.
        family: what its refusals, the gallery and ``explain`` call the subgraph, e.g.
            ``"layernorm"``.
        ops: the ops of this family a graph can hold: what a rewrite of this kind leaves in the
            graph, and for BatchNorm the op that the fold removes.
        norm: whether the family is a normalization (counted by :func:`fusion.norm_ops`);
            attention, GELU and scalar affine folds are not.
        meaning: what the count counts, for people: its row of the report's table of kinds
            (docs/report.md#fusions, generated from it by ``tools/docs.py``).
    """

    name: str
    family: str
    ops: tuple[Op, ...] = ()
    norm: bool = True
    meaning: str = dataclasses.field(default="", kw_only=True)


class FusionPass(ir.passes.InPlacePass):
    """Base class of the fusion passes: declarations, the opset gate, and the outcomes.

    Subclasses set :attr:`kinds` (each with its meaning), :attr:`summary` and, where they raise
    codes of their own, :attr:`codes`, and implement :meth:`apply`; they record into
    :attr:`outcomes` with :meth:`fused` and :meth:`refused`. :meth:`call` runs :meth:`apply` on
    the main graph, then on each subgraph (``If`` branches, ``Loop`` and ``Scan`` bodies), given
    as a :class:`fusion._scopes.Scope` whose ``graph`` is the subgraph
    (docs/fusions.md#subgraphs); what it records there carries the subgraph's path.

    Args:
        target: one of :data:`TARGETS`.
        exclude: anchors of rewrites to leave out, each ``(path, node)``
            (:attr:`~fusion.base.Fused.path`, :attr:`~fusion.base.Fused.node`): a candidate
            anchored there is neither rewritten nor refused (whoever excludes it says why: a
            caller's rollback of rewrites it rejects does). Anchors are node names of the graph
            the pass runs on, so a run on the same model with the same passes before it finds
            them again; :attr:`excluded` holds those of the graph being run.
        **settings: the policy fields of :attr:`settings`, kept as attributes of those names:
            a :class:`~fusion.base.policy.Policy` of ``target`` and ``settings`` is built
            (checked there; a field not given is the policy's default), and the pass keeps its
            fields, so that a pass declares no default of its own.

    Raises:
        ValueError: ``target`` is not one of :data:`TARGETS`, or not one of :attr:`targets`;
            a setting the pass does not declare; a value the policy refuses.
    """

    #: The kinds of rewrite this pass makes; the first is the one its refusals belong to.
    kinds: ClassVar[tuple[Kind, ...]]
    #: One line: what the pass rewrites into what (docs/architecture.md's Layout, generated from
    #: it by ``tools/docs.py``).
    summary: ClassVar[str] = ""
    #: The refusal codes the pass raises besides the shared :class:`~fusion.base.Code`: an enum
    #: declared in its module, or None where it has none of its own.
    codes: ClassVar[type[enum.StrEnum] | None] = None
    #: The targets the pass may run for.
    targets: ClassVar[tuple[str, ...]] = TARGETS
    #: The field of :class:`fusion.base.policy.Policy` (a keyword of ``optimize()``) that turns the
    #: pass on where true, or None if it always runs.
    option: ClassVar[str | None] = None
    #: The targets for which the option defaults to on (an option the policy leaves as None).
    on_by_default: ClassVar[tuple[str, ...]] = ()
    #: The fields of :class:`fusion.base.policy.Policy` the pass reads, each given to the
    #: constructor and kept as the attribute of the same name (annotated on the class, with no
    #: default: the policy's is the one).
    settings: ClassVar[tuple[str, ...]] = ()
    #: Whether :meth:`apply` on the main graph rewrites its subgraphs too (onnxscript's rule
    #: sets recurse into them): :meth:`call` then runs it once, on the main graph, and the pass
    #: records each outcome with its subgraph's path itself.
    reaches_subgraphs: ClassVar[bool] = False
    #: Per target, the ai.onnx opset that the ops it emits need (absent: any opset).
    needs_opset: ClassVar[Mapping[str, int]] = {}

    def __init__(
        self,
        target: str = "ort",
        exclude: Collection[tuple[str | None, str]] = (),
        **settings: Any,
    ):
        super().__init__()
        if unknown := set(settings) - set(self.settings):
            raise ValueError(f"{type(self).__name__} has no setting {sorted(unknown)}")
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}: choose one of {TARGETS}")
        if target not in self.targets:
            raise ValueError(f"{type(self).__name__} emits ONNX Runtime ops: it needs target='ort'")
        policy = Policy(target, **settings)
        for name in self.settings:
            setattr(self, name, getattr(policy, name))
        self.target = target
        self.exclude = frozenset(exclude)
        self.excluded = self._excluded_in(None)
        self.path: str | None = None
        self.outcomes = FusionReport()

    def _excluded_in(self, path: str | None) -> frozenset[str]:
        """The anchors of :attr:`exclude` in the graph at ``path`` (None: the main graph)."""
        return frozenset(node for where, node in self.exclude if where == path)

    @classmethod
    def enabled(cls, policy: Policy) -> bool:
        """Whether ``optimize(model, policy)`` runs this pass."""
        if cls.option is None:
            return policy.target in cls.targets
        wanted = getattr(policy, cls.option)
        return bool(wanted) or (wanted is None and policy.target in cls.on_by_default)

    @property
    def family(self) -> str:
        """The family this pass's refusals are recorded under."""
        return self.kinds[0].family

    def opset_gate(self, model: ir.Model) -> CannotFuse | None:
        """Why this pass's ops cannot be emitted into ``model`` (its opset is too low for
        :attr:`needs_opset`), or None when they can."""
        needed = self.needs_opset.get(self.target, 0)
        opset = opset_version(model)
        if opset >= needed:
            return None
        op = self.kinds[0].ops[0].op_type
        return CannotFuse(
            Code.OPSET_TOO_LOW,
            f"opset {opset} has no {op} (needs {needed}): export with --opset {needed} or "
            "target ONNX Runtime",
        )

    def fused(
        self,
        node: ir.Node | str,
        became: str,
        *,
        kind: str | None = None,
        count: int = 1,
        path: str | None = None,
    ):
        """Record a rewrite anchored at ``node`` (of :attr:`kinds`\\ [0] unless ``kind``), in
        the graph being run unless ``path`` names another."""
        name = node if isinstance(node, str) else label(node)
        self.outcomes.record(kind or self.kinds[0].name, name, became, count, path or self.path)

    def refused(self, node: ir.Node | str, refusal: CannotFuse) -> None:
        """Record that the candidate anchored at ``node`` (in the graph being run) was left
        alone, and why."""
        name, module = (node, None) if isinstance(node, str) else (label(node), module_path(node))
        self.outcomes.refuse(self.family, name, refusal.code, refusal.detail, module, self.path)

    def plan(self, model: ir.Model) -> None:
        """Prepare ``model`` before the first pass of the run runs (after the shapes are
        filled): a pass whose rewrites need a higher opset raises it here where the passes
        before it must see the raised one. Nothing by default."""

    def call(self, model: ir.Model) -> FusionResult:
        """Run :meth:`apply` with fresh :attr:`outcomes` on the main graph, then on each
        subgraph there was before it ran (:func:`fusion._scopes.scopes`; one whose node a
        rewrite removed is skipped; none where :attr:`reaches_subgraphs`), :attr:`path` and
        :attr:`excluded` set for each; the result carries the outcomes."""
        self.outcomes = FusionReport()
        inner = [] if self.reaches_subgraphs else scopes(model)
        modified = self._apply_in(model)
        for scope in inner:
            if scope.owner.graph is not None:
                modified = self._apply_in(scope) or modified
        return FusionResult(model, modified, self.outcomes)

    def _apply_in(self, model: ir.Model) -> bool:
        """:meth:`apply` on ``model`` (the main graph or a scope) with its path and anchors."""
        self.path = path_of(model)
        self.excluded = self._excluded_in(self.path)
        try:
            return self.apply(model)
        finally:
            self.path, self.excluded = None, self._excluded_in(None)

    def apply(self, model: ir.Model) -> bool:
        """Rewrite ``model`` in place and record outcomes; return whether it changed."""
        raise NotImplementedError


class NodeFusionPass(FusionPass):
    """A pass that visits each node of the graph it runs on once (:meth:`FusionPass.call` runs
    it on each subgraph too): :meth:`match` finds a candidate anchored at the node,
    :meth:`rewrite` replaces it.

    The opset gate applies here: when :meth:`opset_gate` says the ops cannot be emitted, every
    match is recorded as an ``opset_too_low`` refusal and nothing is rewritten. A node among
    :attr:`excluded` is not visited.
    """

    def apply(self, model: ir.Model) -> bool:
        graph = model.graph
        gate = self.opset_gate(model)
        modified = False
        for node in list(graph):
            if node.graph is not graph or label(node) in self.excluded:  # removed, or left out
                continue
            try:
                match = self.match(model, node)
                if match is not None and gate is not None:
                    raise gate
            except CannotFuse as refusal:
                self.refused(node, refusal)
                continue
            if match is not None:
                self.fused(node, self.rewrite(model, match))
                modified = True
        return modified

    def candidates(self, model: ir.Model) -> list[Any]:
        """Every candidate :meth:`match` finds in ``model``'s graph and the subgraphs under it
        (so that a plan that raises the whole model's opset sees them all), without rewriting
        or recording anything: refusals and :attr:`exclude`\\ d anchors left out."""
        outcomes, self.outcomes = self.outcomes, FusionReport()
        found = []
        try:
            for scope in (model, *scopes(model)):
                excluded = self._excluded_in(path_of(scope))
                for node in list(scope.graph):
                    if label(node) in excluded:
                        continue
                    try:
                        match = self.match(scope, node)
                    except CannotFuse:
                        continue
                    if match is not None:
                        found.append(match)
        finally:
            self.outcomes = outcomes
        return found

    def match(self, model: ir.Model, node: ir.Node) -> Any | None:
        """The candidate anchored at ``node``, or None if there is none.

        Raises:
            CannotFuse: there is one, but it cannot be rewritten exactly.
        """
        raise NotImplementedError

    def rewrite(self, model: ir.Model, match: Any) -> str:
        """Replace the matched nodes; return what they became (for
        :attr:`~fusion.base.Fused.became`)."""
        raise NotImplementedError
