"""Undo the rewrites that ONNX Runtime rejects or that change the function; never lose a run.

:func:`verify` checks an optimized model as a whole (checker, ONNX Runtime sessions, a run on
every input set, the parity rule) and says why it cannot be published (:class:`Rejection`);
:func:`roll_back` finds the rewrites responsible by group testing and builds the model again
without them (:class:`Outcome`, :class:`Undone`), or raises :class:`RollbackFailed` where no
rewrite is to blame and the model cannot be published. The latency verdict
(:mod:`normexport.latency.verdict`) runs the same search with a timing as its check, within a
budget (``afford``). The check, the search, its cost and its ending:
docs/parity.md#rollback-one-bad-rewrite-never-costs-you-the-model and
docs/parity.md#finding-the-rewrites-responsible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import fusion
from fusion import Code, Fused, FusionReport
from fusion.registry import PASSES
from normexport import precision, runtime
from normexport.errors import one_line
from normexport.io import files
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Candidate, Judge


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why a model failed the check.

    Attributes:
        code: ``rejected_by_checker``, ``rejected_by_runtime`` or ``changed_the_function``
            (a :class:`fusion.Code` value).
        message: the checker's or ONNX Runtime's message, or which outputs diverged where.
    """

    code: str
    message: str


@dataclasses.dataclass(frozen=True)
class Undone:
    """One rewrite left out of the published model.

    Attributes:
        rewrite: the rewrite as the passes reported it.
        rejection: the check the model with it (and without the others found) failed.
    """

    rewrite: Fused
    rejection: Rejection


class RollbackFailed(RuntimeError):
    """The model fails the check with every rewrite left out: not a rewrite's fault."""


#: ``build(excluded) -> (model file, what the passes did)``: the model optimized again from
#: the raw one with those rewrites left out. :func:`roll_back` deletes each build (the file and
#: its external data file) once it is of no more use: a large model's builds are GBs each.
Build = Callable[[frozenset[Fused]], tuple[Path, FusionReport]]
#: ``check(model file) -> why it fails, or None``.
Check = Callable[[Path], Rejection | None]


@dataclasses.dataclass
class Outcome:
    """What :func:`roll_back` kept.

    Attributes:
        path: the model that passes the check (the one first built, where it passed).
        report: what the passes did to it.
        undone: the rewrites left out, in the order the passes made them.
        checks: how many models were checked (the first one included).
        unexplained: why the model fails its check where the model with no rewrite fails
            it too (then nothing is undone, and the parity verdict fails); else None.
    """

    path: Path
    report: FusionReport
    undone: list[Undone]
    checks: int
    unexplained: Rejection | None = None

    def to_dict(self) -> dict:
        """JSON form: each rewrite undone (kind, node, what it became, code, message), the
        number of models checked, and why the model fails where no rewrite is to blame."""
        return {
            "undone": [
                {**dataclasses.asdict(u.rewrite), **dataclasses.asdict(u.rejection)}
                for u in self.undone
            ],
            "models_checked": self.checks,
            "unexplained": dataclasses.asdict(self.unexplained) if self.unexplained else None,
        }


def verify(
    path: Path, provider: str, checker_level: str, judge: Judge
) -> tuple[Rejection | None, ParityResult | None]:
    """Why the optimized model at ``path`` cannot be published, or None, and its parity
    verdict (None where it did not run): the ONNX checker at ``checker_level`` (the level the
    input passed: ``"full"``, ``"basic"`` or ``"none"``), an ONNX Runtime session on
    ``provider`` (with graph optimizations on, as deployed, and off, as parity runs it), a run
    on every input set, and ``judge``'s float32 parity rule on the outputs where the raw model
    has no NaN/Inf of its own.

    Raises:
        normexport.runtime.ProviderUnavailable: the provider does not load.
    """
    if checker_level != "none":
        try:
            fusion.check(path, full_check=checker_level == "full")
        except Exception as err:  # ValidationError, InferenceError: the checker's verdict
            return Rejection(Code.REJECTED_BY_CHECKER, one_line(err)), None
    name = runtime.PROVIDERS[provider][0]
    try:
        runtime.load_check(path, provider)
    except runtime.ProviderUnavailable:
        raise
    except Exception as err:  # ORT's own error types
        why = f"ONNX Runtime's {name} cannot load it: {runtime.message(err)}"
        return Rejection(Code.REJECTED_BY_RUNTIME, why), None
    try:  # opened by the judge once the references have run
        verdict = judge(path, opened(runtime.check_session, provider))
    except RuntimeFailed as err:
        why = f"ONNX Runtime's {name} cannot {err.doing} it: {err}"
        return Rejection(Code.REJECTED_BY_RUNTIME, why), None
    except ValueError as err:  # output count or shapes differ from the reference's
        return Rejection(Code.CHANGED_THE_FUNCTION, str(err)), None
    return diverged(verdict), verdict


class RuntimeFailed(Exception):
    """ONNX Runtime failed to load or to run a candidate of :func:`opened` (its message).

    Attributes:
        doing: ``"load"`` or ``"run"``.
    """

    def __init__(self, doing: str, message: str):
        super().__init__(message)
        self.doing = doing


def opened(session: Callable[..., Any], provider: str, **options) -> Candidate:
    """The judge's candidate (:data:`normexport.verdict.references.Candidate`) that opens its
    model with ``session(model, provider, quiet=True, external_data_folder=folder,
    **options)`` (:func:`normexport.runtime.check_session`, as written, or
    :func:`normexport.runtime.deployed_session`, as deployed) and runs it on feeds cast to the
    session's float inputs (:func:`normexport.precision.cast_feeds`): the one way the verdict's
    checks open and run a model, so that what they report of a failure cannot drift.

    Raises:
        RuntimeFailed: (by the candidate or its runs) ONNX Runtime failed to load or run it.
        normexport.runtime.ProviderUnavailable: (by the candidate) the provider does not load.
    """

    def candidate(model, folder):
        try:
            ran = session(model, provider, quiet=True, external_data_folder=folder, **options)
        except runtime.ProviderUnavailable:
            raise
        except Exception as err:  # ORT's own error types
            raise RuntimeFailed("load", runtime.message(err)) from None

        def run(feeds):
            try:
                return runtime.run(ran, precision.cast_feeds(ran, feeds), quiet=True)
            except Exception as err:  # ORT's own error types
                raise RuntimeFailed("run", runtime.message(err)) from None

        return run, [o.name for o in ran.get_outputs()]

    return candidate


def diverged(verdict: ParityResult) -> Rejection | None:
    """``changed_the_function`` where an output fails the parity rule and the raw model has no
    NaN/Inf there (one that has is the export's to answer for), naming the outputs and sets."""
    found = [
        (probe, e)
        for probe, e in verdict.failures()
        if e.raw_max_abs_err is None or math.isfinite(e.raw_max_abs_err)
    ]
    if not found:
        return None
    where: dict[str, list[str]] = {}
    for probe, e in found:
        where.setdefault(e.output, []).append(probe)
    probe, e = found[0]
    why = "; ".join(f"output {out!r} diverges on {', '.join(sets)}" for out, sets in where.items())
    raw = "" if e.raw_max_abs_err is None else f", raw model's {e.raw_max_abs_err:.3g}"
    why += (
        f" (on {probe}: max abs err {e.max_abs_err:.3g}{raw}, tolerance "
        f"{verdict.atol + verdict.rtol * e.max_abs_ref:.3g})"
    )
    return Rejection(Code.CHANGED_THE_FUNCTION, why)


def roll_back(
    path: Path,
    report: FusionReport,
    build: Build,
    check: Check,
    *,
    tolerated: Collection[str] = (Code.CHANGED_THE_FUNCTION,),
    afford: Callable[[int], bool] = lambda groups: True,
) -> Outcome:
    """Check the optimized model at ``path`` (whose passes reported ``report``); where it
    fails, find the rewrites responsible and build it again without them
    (docs/parity.md#finding-the-rewrites-responsible).

    Where the model with no rewrite at all fails too, with the same code, one of ``tolerated``,
    the model is kept as the passes made it and :attr:`Outcome.unexplained` says why.

    Args:
        path, report: the optimized model's file and what its passes did.
        build, check: :data:`Build` and :data:`Check` (which may measure, as the latency
            verdict's does: :mod:`normexport.latency.verdict`).
        tolerated: the codes of a failure that is no bug of normexport's where no rewrite is to
            blame; one that a build with no rewrite left fails with, where the model with none
            passed, is the measurement's noise: the search ends with that build.
        afford: ``afford(n)``: whether the search may look for the failing ones among ``n``
            groups (about ``2 * log2(n) + 1`` more checks), asked before each round (``n``: the
            passes with rewrites) and before each pass's rewrites are tested one by one (``n``:
            its rewrites). Where not, a pass found failing is left out whole, and a round
            leaves out every rewrite of its build (the model with none passed). Always, by
            default.

    Raises:
        RollbackFailed: the model fails with no rewrite at all, and one of the two failures is
            not ``tolerated`` (ONNX Runtime cannot load or run it, or it fails the checker):
            nothing can be published.
    """
    search = _Search(build, check, afford)
    rejection = search.check(path)
    if rejection is None:
        return Outcome(path, report, [], search.checks)
    bare = search.bare(report)
    if bare is not None:
        if rejection.code == bare.code and rejection.code in tolerated:
            return Outcome(path, report, [], search.checks, unexplained=rejection)
        raise RollbackFailed(
            f"the optimized model fails its check ({rejection.message}), and so does the model "
            f"with no rewrite at all ({bare.message})"
        )
    path, report, excluded = search.leave_out(path, report, rejection, tolerated)
    undone = [Undone(f, r) for f, r in excluded.items()]
    return Outcome(path, report, _in_pass_order(undone), search.checks)


class _Search:
    """The group tests of one rollback, counted."""

    def __init__(self, build: Build, check: Check, afford: Callable[[int], bool]):
        self._build = build
        self._check = check
        self._afford = afford
        self.checks = 0

    def check(self, path: Path) -> Rejection | None:
        self.checks += 1
        return self._check(path)

    def leave_out(
        self, path: Path, report: FusionReport, failing: Rejection, tolerated: Collection[str]
    ) -> tuple[Path, FusionReport, dict[Fused, Rejection]]:
        """Find the rewrites to leave out of the model at ``path`` (failing with ``failing``),
        build it again without them, and repeat until the build passes (or, with a
        ``tolerated`` code, fails with no rewrite left); the build kept, what its passes did,
        and the rewrites left out with their rejections."""
        excluded: dict[Fused, Rejection] = {}
        first, rejection = path, failing
        while rejection is not None:
            affordable = self._afford(len({_pass_of(f) for f in report.fused}))
            found = self.bad(report.fused, frozenset(excluded), rejection) if affordable else {}
            # none found: the failure needs rewrites together that each pass alone (or the
            # search cannot afford another round); the model with none passes, so leaving out
            # all that this build made is safe
            found = found or dict.fromkeys(report.fused, rejection)
            if not found and rejection.code in tolerated:  # a measurement's noise: keep it
                break
            if not found:  # no rewrite left to leave out, yet it fails where the bare one passed
                raise RollbackFailed(f"the model with no rewrite fails once: {rejection.message}")
            excluded.update(found)
            previous, (path, report) = path, self._build(frozenset(excluded))
            if previous != first:
                _delete(previous)
            rejection = self.check(path)
        return path, report, excluded

    def test(self, excluded: frozenset[Fused]) -> Rejection | None:
        """Build without ``excluded``, check it and delete it."""
        path = self._build(excluded)[0]
        try:
            return self.check(path)
        finally:
            _delete(path)

    def bare(self, report: FusionReport) -> Rejection | None:
        """Check the model built with no rewrite: without those of ``report``, and without
        any that leaving them out made possible."""
        excluded = frozenset(report.fused)
        while True:
            path, made = self._build(excluded)
            try:
                if not made.fused:
                    return self.check(path)
            finally:
                _delete(path)
            excluded |= frozenset(made.fused)

    def bad(
        self, fused: Sequence[Fused], excluded: frozenset[Fused], failing: Rejection
    ) -> dict[Fused, Rejection]:
        """The rewrites of ``fused`` (not yet in ``excluded``) to leave out, each with the
        rejection of a model where it was the only suspect left; ``failing`` is the rejection
        of the model built with all of them. First the passes, then the rewrites of each pass
        found (with the passes found after it left out, those before it without theirs), where
        the search affords it; else the pass's rewrites all."""
        groups = [[f for f in fused if f not in excluded and _pass_of(f) is p] for p in PASSES]
        bad_groups = self._bad_groups([g for g in groups if g], excluded, failing)
        found: dict[Fused, Rejection] = {}
        for i, (group, rejection) in enumerate(bad_groups):
            # one rewrite: its rejection's model had the others found left out
            if len(group) == 1 or not self._afford(len(group)):
                found.update(dict.fromkeys(group, rejection))
                continue
            later = {f for g, _ in bad_groups[i + 1 :] for f in g}
            context = excluded | found.keys() | later
            why = self.test(context)
            if why is None:  # it failed only beside the rewrites now known to be bad
                continue
            for (rewrite,), single in self._bad_groups([[f] for f in group], context, why):
                found[rewrite] = single
        return found

    def _bad_groups(
        self, groups: list[list[Fused]], excluded: frozenset[Fused], failing: Rejection
    ) -> list[tuple[list[Fused], Rejection]]:
        """The groups that fail the check, given that the model built with all of ``groups``
        (and without ``excluded``) fails with ``failing``."""
        if len(groups) <= 1:
            return [(g, failing) for g in groups]
        half = len(groups) // 2
        first, second = groups[:half], groups[half:]
        bad = []
        without_second = excluded | {f for g in second for f in g}
        why = self.test(without_second)
        if why is not None:
            bad = self._bad_groups(first, without_second, why)
        known = excluded | {f for g, _ in bad for f in g}
        why = failing if not bad else self.test(known)
        if why is not None:
            bad += self._bad_groups(second, known, why)
        return bad


def _delete(path: Path) -> None:
    """Delete a build of :func:`roll_back`: the model file and its external data file."""
    for file in (path, files.data_path(path)):
        file.unlink(missing_ok=True)


def _pass_of(rewrite: Fused) -> type:
    """The pass that makes rewrites of ``rewrite.kind``."""
    return next(p for p in PASSES if any(k.name == rewrite.kind for k in p.kinds))


def _in_pass_order(undone: list[Undone]) -> list[Undone]:
    order = {p: i for i, p in enumerate(PASSES)}
    return sorted(undone, key=lambda u: order[_pass_of(u.rewrite)])


def refusals(undone: Sequence[Undone]) -> FusionReport:
    """The undone rewrites as refusals (their family, anchor, rejection code and message), to
    add to the published model's fusion report."""
    report = FusionReport()
    for u in undone:
        family = next(k.family for k in _pass_of(u.rewrite).kinds if k.name == u.rewrite.kind)
        detail = f"{u.rewrite.became}, undone: {u.rejection.message}"
        rejection = Code(u.rejection.code)
        report.refuse(family, u.rewrite.node, rejection, detail, path=u.rewrite.path)
    return report
