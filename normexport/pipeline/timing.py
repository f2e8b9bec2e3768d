"""The latency stage, before the output is published: the staged model timed against the raw
model with an A/A control (:func:`timed_against_raw`) and judged by the latency
verdict (:mod:`normexport.latency.verdict`); where it is slower, the rewrites responsible found by
the rollback's group testing and left out, and the model without them put in its place (its
parity then judged anew, as every output's is)."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path

import torch

from fusion import Code
from normexport import precision, progress, runtime
from normexport.io.eager import Eager
from normexport.latency import verdict
from normexport.latency.measure import counterbalanced, runner, time_interleaved
from normexport.pipeline import rewrite
from normexport.pipeline.job import Job
from normexport.pipeline.raw_model import RawModel
from normexport.pipeline.rewrite import Staged
from normexport.report import Latency
from normexport.runtime import memory as runtime_memory
from normexport.verdict import rollback
from normexport.verdict.checker_levels import check_output

#: The fewest timed rounds of the main job's latency: the budget (``--budget``) decides above
#: it, and a model whose rounds take longer is timed past the budget (each timing says which
#: bound decided, :attr:`normexport.latency.measure.Timing.bound`).
MIN_ROUNDS = 5
#: Why the speed is unchecked where the two models were timed one at a time.
APART = (
    "the two models were timed one at a time (they do not fit in memory together): no paired "
    "comparison"
)


def judged(
    job: Job, ref: RawModel, staged: Staged, work: Path
) -> tuple[Staged, Latency, verdict.Speed]:
    """Time the staged model against the raw one for ``--budget`` seconds (the report's
    latency); where it is slower by the rule of :mod:`normexport.latency.verdict`, time it again
    (fresh sessions, fresh rounds: :func:`_as_optimized`) until :data:`~verdict.AGREEING`
    timings of :data:`~verdict.MIN_RUNS` rounds call it slower, and only then search for the
    rewrites responsible (:func:`normexport.verdict.rollback.roll_back`, each test a model
    built again from the raw one by :func:`normexport.pipeline.rewrite.builder`, without the
    rewrites the parity rollback undid, and timed for ``--budget / SEARCH_SLICES`` seconds,
    :data:`~verdict.MIN_RUNS` rounds at least, the search within ``--budget`` more:
    :class:`_Budget`); the model without them is put in the staged model's place only where the
    model as optimized, timed against it (``--budget`` seconds, fresh sessions), is slower too,
    with them under the fusion report's refusals (``slower_here``) and its parity to be judged
    anew. Where a timing is too busy to tell or the timings disagree
    (:func:`~verdict.undecided`), the staged model is kept as the stages made it and the speed
    is unchecked. A half-precision model or autotune's form is judged, not rebuilt (the search
    builds the passes' float32 form); an int8 model is timed against the float32 optimized
    model instead (:func:`int8_or_float32`).

    Returns:
        The staged model (a new :class:`Staged` where rewrites were undone), the latency of
        the model kept (its last timing, PyTorch's from the first), and the verdict.
    """
    budget = _Budget(job.opts.budget_s)
    timed: dict[Path, tuple[Latency, verdict.Comparison | None]] = {}
    first: list[verdict.Comparison] = []  # the model as optimized against the raw model

    def check(path: Path) -> rollback.Rejection | None:
        if not timed:
            *timed[path], why = _as_optimized(job, ref, staged, budget, first)
            if why is not None:
                raise _CannotTell(why)
            return verdict.rejection(timed[path][1])
        seconds = budget.seconds / verdict.SEARCH_SLICES
        timed[path] = timed_against_raw(job, ref, path, seconds, min_runs=verdict.MIN_RUNS)
        budget.tested()
        comparison = timed[path][1]
        if comparison is None or comparison.busy is not None:
            raise _CannotTell(APART if comparison is None else verdict.undecided([comparison]))
        return verdict.rejection(comparison)

    def unchecked(why: str) -> tuple[Staged, Latency, verdict.Speed]:
        speed = verdict.Speed(why, *first[:1], first[1:], models_timed=budget.timings)
        return staged, timed[staged.path][0], speed

    not_rebuilt = _not_rebuilt(staged)
    try:
        if not_rebuilt is not None:
            slower = check(staged.path) is not None
            latency, comparison = timed[staged.path]
            kept = not_rebuilt if slower else None
            speed = verdict.Speed(
                None, first[0], first[1:], comparison, [], None, budget.timings, kept
            )
            return staged, latency, speed
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
    except _CannotTell as err:
        return unchecked(str(err))
    head_to_head, why = _head_to_head(job, ref, staged, outcome, budget)
    if why is not None:
        return unchecked(why)
    latency, published = timed[outcome.path]
    eager = timed[staged.path][0].timings  # PyTorch, timed alone, with the first only
    latency.timings = {k: t for k, t in eager.items() if k == "pytorch_eager"} | latency.timings
    kept = None
    if outcome.unexplained is not None:
        kept = "no rewrite is to blame: the model built with none was slower too"
    if published is not None and published.slower and kept is None:
        kept = "every rewrite undone; the model with none, timed not slower before, was now"
    speed = verdict.Speed(
        None, first[0], first[1:], published, outcome.undone, head_to_head, budget.timings, kept
    )
    return _keep(ref, staged, outcome), latency, speed


#: What an int8 model is timed against.
FLOAT32 = verdict.FLOAT32_OPTIMIZED


def int8_or_float32(
    job: Job, ref: RawModel, staged: Staged
) -> tuple[Staged, Latency, verdict.Speed]:
    """The int8 model timed against the float32 optimized model (``--budget`` seconds,
    :data:`~verdict.MIN_RUNS` rounds at least, with the A/A controls): published only where
    :attr:`~verdict.Comparison.faster`; else the float32 model is put in its place, its
    parity to be judged, and the int8 report says why (docs/precision.md#int8)."""
    latency, comparison = timed_against_raw(
        job,
        ref,
        staged.path,
        job.opts.budget_s,
        min_runs=verdict.MIN_RUNS,
        base=(staged.float32, FLOAT32),
    )
    speed = verdict.Speed(None, comparison, [], comparison, [], None, 1)
    if comparison is None:
        speed = verdict.Speed(APART, models_timed=1)
    elif comparison.faster:
        return staged, latency, speed
    why = APART if comparison is None else f"int8 is not faster: {comparison.message()}"
    rewrite.move_onto(staged.float32, staged.path)
    report = dataclasses.replace(staged.precision, published="fp32", why_float32=why)
    checker = check_output(staged.path, *ref.checker)
    staged = dataclasses.replace(
        staged, checker=checker, verified=None, precision=report, float32=None
    )
    return staged, latency, speed


#: What the int8 model with its slow convs float is timed against (:func:`faster_than`).
EVERY_CONV_INT8 = "the time of the int8 model with every conv int8"


def faster_than(job: Job, ref: RawModel, path: Path, base: Path) -> bool:
    """Whether the model at ``path`` is faster than the one at ``base`` (the int8 model with
    the convs of :func:`normexport.precision.int8.slow_convs` float, against every conv int8:
    docs/precision.md#int8): timed interleaved for a quarter of ``--budget``,
    :data:`~verdict.MIN_RUNS` rounds at least, with the A/A controls
    (:func:`timed_against_raw`), and :attr:`~verdict.Comparison.faster`; False where they were
    timed apart (no comparison)."""
    seconds = job.opts.budget_s / 4
    base_words = (base, EVERY_CONV_INT8)
    _, comparison = timed_against_raw(
        job, ref, path, seconds, min_runs=verdict.MIN_RUNS, base=base_words
    )
    return comparison is not None and comparison.faster


#: What the model as optimized is timed against where the search undid rewrites.
WITHOUT = "the time of the model without them"


class _CannotTell(Exception):
    """A timing that cannot judge the model (too busy, the models timed apart, timings in
    disagreement: :func:`normexport.latency.verdict.undecided`): the speed is unchecked and the
    model kept as the stages made it."""


def _as_optimized(
    job: Job, ref: RawModel, staged: Staged, budget: _Budget, comparisons: list
) -> tuple[Latency, verdict.Comparison | None, str | None]:
    """The model as the stages made it timed against the raw model (``--budget`` seconds, with
    PyTorch eager first), and again, each time in fresh sessions and rounds, for
    :data:`~verdict.MIN_RUNS` rounds at least, while :func:`~verdict.another` asks; each
    comparison appended to ``comparisons``. A burst of the machine's load can put one timing's
    interval past the A/A controls' spread, two in a row far more rarely, and a search started
    on noise would undo rewrites that are not slower.

    Returns:
        The last timing's latency (PyTorch's from the first) and comparison, and why they
        cannot judge the model (:data:`APART`, or :func:`~verdict.undecided`'s reason) or None.
    """
    seconds, disabled = budget.seconds, staged.disabled
    latency, comparison = timed_against_raw(job, ref, staged.path, seconds, disabled, eager=True)
    budget.tested()
    eager = {k: t for k, t in latency.timings.items() if k == "pytorch_eager"}
    while comparison is not None:
        comparisons.append(comparison)
        if not verdict.another(comparisons):
            return latency, comparison, verdict.undecided(comparisons)
        latency, comparison = timed_against_raw(
            job, ref, staged.path, seconds, disabled, min_runs=verdict.MIN_RUNS
        )
        latency.timings = eager | latency.timings
        budget.tested()
    return latency, None, APART


def _head_to_head(
    job: Job, ref: RawModel, staged: Staged, outcome: rollback.Outcome, budget: _Budget
) -> tuple[verdict.Comparison | None, str | None]:
    """Where the search undid rewrites, an independent timing of what it found: the model as
    optimized against the model without them (``--budget`` seconds, fresh sessions,
    :data:`~verdict.MIN_RUNS` rounds at least), and why they must not be undone (it does not
    call the model as optimized slower, or cannot tell), or None; (None, None) where nothing
    was undone."""
    if not outcome.undone:
        return None, None
    base = (outcome.path, WITHOUT)
    seconds, disabled = budget.seconds, staged.disabled
    _, comparison = timed_against_raw(
        job, ref, staged.path, seconds, disabled, min_runs=verdict.MIN_RUNS, base=base
    )
    budget.tested()
    if comparison is None:
        why: str | None = APART
    else:
        why = verdict.undecided([comparison])
        if why is None and not comparison.slower:
            why = comparison.message()
    if why is None:
        return comparison, None
    return comparison, (
        f"the search found {len(outcome.undone)} rewrite(s) slower, but the model as optimized, "
        f"timed against the model without them, was not: {why}"
    )


def _keep(ref: RawModel, staged: Staged, outcome: rollback.Outcome) -> Staged:
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


def _not_rebuilt(staged: Staged) -> str | None:
    """Why the search cannot rebuild the staged model (it builds the passes' float32 form), or
    None."""
    if staged.precision is not None and getattr(staged.precision, "published", None) != "fp32":
        return f"--precision {staged.precision.precision} converted it (what was asked for)"
    if staged.tuned is not None and staged.tuned.best != staged.tuned.default:
        return f"--autotune kept the form {staged.tuned.best!r}, which the search does not build"
    return None


class _Budget:
    """The search's time, from the end of the first timing: ``seconds`` (``--budget``) in
    all, builds included; ``timings``: the timings so far, the first included."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.timings = 0
        self._start: float | None = None
        self._tests = 0

    def tested(self) -> None:
        """Count a timing (the first one starts the search's clock)."""
        self.timings += 1
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


def timed_against_raw(
    job: Job,
    ref: RawModel,
    path: Path,
    budget_s: float,
    disabled: tuple[str, ...] = (),
    eager: bool = False,
    min_runs: int = MIN_ROUNDS,
    base: tuple[Path, str] | None = None,
) -> tuple[Latency, verdict.Comparison | None]:
    """The raw model (or ``base``: another model's file, and whose time it is in words) and the
    model at ``path`` (run with ORT's ``disabled`` optimizers) on the example inputs, timed
    interleaved for ``budget_s`` seconds (``min_runs`` rounds at least) in ORT_ENABLE_ALL
    sessions (what a deployment runs), and with ``eager`` PyTorch eager first (where there is a
    module), alone, for a quarter of it; ms. PyTorch and ONNX Runtime get the same number of threads
    (``job.threads``: ``--threads``, else the cores this process may run on): each with its
    default beside the other's pool oversubscribes the cores and times the contention. PyTorch
    is not timed in the ONNX models' rounds: there its thread pool slowed the ORT call after it,
    by up to twice on 2 cores (a Conv-BN-LayerNorm net's 0.03 ms sessions took 0.06-0.08 ms),
    noise the A/A control does not see.

    Each ONNX model is two sessions, called once each a round; its time in a round is their
    mean, and each model's two, compared with each other, are the latency verdict's A/A
    controls (:func:`normexport.latency.verdict.compare`). On CPU, where two sessions of each fit
    in memory, they are four, opened in ABBA order (raw, model, model, raw:
    :func:`normexport.latency.measure.counterbalanced`): two CPU sessions of one file, opened
    one after the other, can differ by a percent or more, on some models always the same way
    (``benchmarks/session_order.py``); elsewhere one session of each, called twice. Where even
    one of each would not fit together (:func:`normexport.runtime.memory.copies_that_fit`),
    each model is timed alone in turn, with half the budget, the report says so, and there is
    no comparison (None)."""
    threads, provider, feeds = job.threads, job.provider, job.sets["example"]
    # Spinning off: these sessions are timed interleaved with each other.
    session = functools.partial(runtime.make_session, spinning=False, threads=threads)
    base_path, against = base or (ref.path, "the raw model's time")
    opens = {
        "ort_raw": lambda: session(base_path, provider),
        "ort_optimized": lambda: session(path, provider, disabled_optimizers=disabled),
    }
    timings: dict = {}
    if eager and job.loaded.module is not None:
        progress.step("pytorch_eager")
        run = Eager(job.loaded.module)
        calls = {"pytorch_eager": lambda: run([feeds[n] for n in job.feed_names])}
        timings |= _timed(calls, threads, budget_s / 4, MIN_ROUNDS)
        budget_s -= budget_s / 4
    copies, apart = runtime_memory.copies_that_fit([ref.path, path], provider, most=2)
    groups = [list(opens)] if apart is None else [[name] for name in opens]
    for group in groups:
        progress.step(", ".join(group) + (", interleaved" if len(group) > 1 else ""))
        opened = counterbalanced({name: opens[name] for name in group}, copies)
        timings |= _timed(_twice(opened, feeds), threads, budget_s / len(groups), min_runs)
        opened = None  # one group's sessions at a time
        runtime_memory.give_back()
    pairs = {name: [timings.pop(f"{name}#{i}") for i in (0, 1)] for name in opens}
    comparison = None
    if apart is None:
        timings["ort_raw"], timings["ort_optimized"], comparison = verdict.compare(
            pairs["ort_raw"], pairs["ort_optimized"], against
        )
    else:  # timed apart: each model's own mean over its calls, no pairing across models
        for name, pair in pairs.items():
            timings[name] = verdict.pooled(pair)
    return Latency(timings, threads, threads, apart, copies), comparison


def _twice(opened: dict, feeds: dict) -> dict:
    """``NAME#0`` and ``NAME#1`` -> a callable that runs one of ``opened[NAME]``'s sessions on
    ``feeds``: each of two sessions, or one session twice. A plain ``session.run``
    (:func:`~normexport.latency.measure.runner`): not :func:`normexport.runtime.run`, whose
    ``--run-timeout`` timer thread, started per call, would be timed with each run."""
    calls = {}
    for name, sessions in opened.items():
        for i, s in enumerate((sessions * 2)[:2]):
            calls[f"{name}#{i}"] = runner(s, precision.cast_feeds(s, feeds), io_binding=False)[0]
    return calls


def _timed(timed: dict, threads: int, budget_s: float, min_runs: int) -> dict:
    """:func:`time_interleaved` of ``timed`` (``min_runs`` rounds at least) with PyTorch on
    ``threads`` threads meanwhile."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return dict(time_interleaved(timed, budget_s=budget_s, min_runs=min_runs))
    finally:
        torch.set_num_threads(before)
