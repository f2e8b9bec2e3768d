"""The latency stage, before the output is published: the staged model timed against the raw
one with an A/A control (:func:`normexport.pipeline.measure.latency`) and judged by the latency
verdict (:mod:`normexport.verdict.speed`); where it is slower, the rewrites responsible found by
the rollback's group testing and left out, and the model without them put in its place (its
parity then judged anew, as every output's is)."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from fusion import Code
from normexport.pipeline import measure, rewrite
from normexport.pipeline.job import Job
from normexport.pipeline.rewrite import Reference, Staged
from normexport.report import Latency
from normexport.verdict import rollback
from normexport.verdict import speed as verdict
from normexport.verdict.checker import check_output

#: Why the speed is unchecked where the two models were timed one at a time.
APART = (
    "the two models were timed one at a time (they do not fit in memory together): no paired "
    "comparison"
)


def judged(
    job: Job, ref: Reference, staged: Staged, work: Path
) -> tuple[Staged, Latency, verdict.Speed]:
    """Time the staged model against the raw one for ``--budget`` seconds (the report's
    latency); where it is slower by the rule of :mod:`normexport.verdict.speed`, search for the
    rewrites responsible (:func:`normexport.verdict.rollback.roll_back`, each test a model
    built again from the raw one by :func:`normexport.pipeline.rewrite.builder`, without the
    rewrites the parity rollback undid, and timed for ``--budget / SEARCH_SLICES`` seconds,
    the search within ``--budget`` more: :class:`_Budget`), and put the model without them in
    the staged model's place, with them under the fusion report's refusals (``slower_here``)
    and its parity to be judged anew. A half-precision model or autotune's form is judged, not
    rebuilt (the search builds the passes' float32 form).

    Returns:
        The staged model (a new :class:`Staged` where rewrites were undone), the latency of
        the model kept (its last timing, PyTorch's from the first), and the verdict.
    """
    budget = _Budget(job.opts.budget_s)
    timed: dict[Path, tuple[Latency, verdict.Comparison | None]] = {}

    def check(path: Path) -> rollback.Rejection | None:
        first = not timed
        seconds = budget.seconds if first else budget.seconds / verdict.SEARCH_SLICES
        disabled = staged.disabled if first else ()
        timed[path] = measure.latency(job, ref, path, seconds, disabled, eager=first)
        budget.tested()
        if first and verdict.rejection(timed[path][1]) is not None:
            timed[path] = _confirmed(
                timed[path], measure.latency(job, ref, path, seconds, disabled)
            )
            budget.tested()
        return verdict.rejection(timed[path][1])

    not_rebuilt = _not_rebuilt(staged)
    if not_rebuilt is not None:
        check(staged.path)
        latency, comparison = timed[staged.path]
        kept = not_rebuilt if comparison is not None and comparison.slower else None
        return staged, latency, _speed(comparison, comparison, [], 1, kept)
    always = (
        frozenset(u.rewrite for u in staged.rollback.undone) if staged.rollback else frozenset()
    )
    outcome = rollback.roll_back(
        staged.path,
        staged.fusions,
        rewrite.builder(job, ref, work, "speed", always),
        check,
        tolerated=(Code.SLOWER_HERE,),
        afford=budget.affords,
    )
    latency, published = timed[outcome.path]
    first = timed[staged.path][0].timings  # PyTorch, timed alone, with the first only
    latency.timings = {k: t for k, t in first.items() if k == "pytorch_eager"} | latency.timings
    kept = None
    if outcome.unexplained is not None:
        kept = "no rewrite is to blame: the model built with none was slower too"
    result = _speed(timed[staged.path][1], published, outcome.undone, outcome.checks, kept)
    return _keep(ref, staged, outcome), latency, result


def _confirmed(
    first: tuple[Latency, verdict.Comparison | None],
    again: tuple[Latency, verdict.Comparison | None],
) -> tuple[Latency, verdict.Comparison | None]:
    """The timing of the model as the stages made it, where its first timing found it slower:
    ``again`` (a second one, of as many seconds), with PyTorch's time from ``first``. The search
    starts only where the second says slower too: a burst of the machine's load can put one
    timing's interval past the A/A controls' spread, two in a row far more rarely, and a search
    started on noise would undo rewrites that are not slower."""
    latency, comparison = again
    eager = {k: t for k, t in first[0].timings.items() if k == "pytorch_eager"}
    latency.timings = eager | latency.timings
    return latency, comparison


def _keep(ref: Reference, staged: Staged, outcome: rollback.Outcome) -> Staged:
    """The staged model, or where the search undid rewrites the model it kept, moved into its
    place: the undone rewrites (the parity rollback's and the search's) under its refusals,
    checked at the input's level, its parity to be judged."""
    if not outcome.undone:
        return staged
    rewrite.move_onto(outcome.path, staged.path)
    fusions = outcome.report
    fusions.extend(rollback.refusals(staged.rollback.undone if staged.rollback else []))
    fusions.extend(rollback.refusals(outcome.undone))
    checker = check_output(staged.path, *ref.checker)
    return dataclasses.replace(staged, fusions=fusions, checker=checker, verified=None)


def _speed(
    as_optimized: verdict.Comparison | None,
    published: verdict.Comparison | None,
    undone: list[rollback.Undone],
    timings: int,
    kept: str | None,
) -> verdict.Speed:
    """The verdict's report: unchecked where the models were timed apart (:data:`APART`); a
    published model still slower after the search is one timed so where the model with no
    rewrite was not (every rewrite undone: the machine's noise)."""
    if published is not None and published.slower and kept is None:
        kept = "every rewrite undone; the model with none, timed not slower before, was now"
    unchecked = None if as_optimized is not None else APART
    return verdict.Speed(unchecked, as_optimized, published, undone, timings, kept)


def _not_rebuilt(staged: Staged) -> str | None:
    """Why the search cannot rebuild the staged model (it builds the passes' float32 form), or
    None."""
    if staged.precision is not None:
        return f"--precision {staged.precision.precision} converted it (what was asked for)"
    if staged.tuned is not None and staged.tuned.best != staged.tuned.default:
        return f"--autotune kept the form {staged.tuned.best!r}, which the search does not build"
    return None


class _Budget:
    """The search's time, from the end of the first timing: ``seconds`` (``--budget``) in
    all, builds included."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._start: float | None = None
        self._tests = 0

    def tested(self) -> None:
        """Count a timing (the first one starts the search's clock)."""
        if self._start is None:
            self._start = time.perf_counter()
        else:
            self._tests += 1

    def affords(self, groups: int) -> bool:
        """Whether the time so far and ``2 * log2(groups) + 1`` more tests, at the mean time
        of the tests so far, fit in the budget (always before the first test)."""
        if self._start is None or not self._tests:
            return True
        spent = time.perf_counter() - self._start
        more = 2 * math.log2(max(groups, 1)) + 1
        return spent + more * spent / self._tests <= self.seconds
