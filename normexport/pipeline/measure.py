"""The stages that judge and time the published output: parity (with the hidden-state probe
for half precision) and latency."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from normexport import precision, progress, runtime
from normexport.io.eager import Eager
from normexport.pipeline.job import Job
from normexport.pipeline.optimize import Reference, Staged
from normexport.report import Latency
from normexport.runtime import memory as runtime_memory
from normexport.runtime.latency import (
    counterbalanced,
    latency_threads,
    rotating,
    time_interleaved,
)
from normexport.verdict import hidden_probe
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Judge


def parity(job: Job, staged: Staged, judge: Judge) -> ParityResult:
    """The parity verdict of the published output (``job.output``) against the oracle (see
    :mod:`normexport.verdict.parity` and :mod:`normexport.verdict.references`), with the raw
    model (the raw export, or the input file as written) and PyTorch float32 compared with it
    too. Every ONNX model runs with ONNX Runtime's graph optimizations off, so that its own
    rewrites are not part of the comparison. Its ``raw_worst()`` is the raw model's worst error
    against the oracle over all input sets (None where no float64 oracle could be built for
    ONNX input).

    A float32 model that is still the one :func:`normexport.verdict.rollback.check` judged
    keeps that verdict (its runs are not repeated); autotune's choice or a half-precision model
    is judged anew.
    """
    if staged.verified is not None:
        return dataclasses.replace(staged.verified, strict=job.opts.strict)

    def candidate(model, folder):  # opened once the references have run and been freed
        session = runtime.check_session(
            model, job.provider, disabled_optimizers=staged.disabled, external_data_folder=folder
        )

        def run(feeds):
            return runtime.run(session, precision.cast_feeds(session, feeds))

        return run, [o.name for o in session.get_outputs()]

    return judge(job.output, candidate, precision=job.output_rule)


def hidden_state_probe(job: Job, ref: Reference, verdict: ParityResult, work: Path) -> None:
    """Add the hidden-state overflow probe (:mod:`normexport.verdict.hidden_probe`) to
    ``verdict``, for a model without float inputs, where it has embedding lookups."""
    found = hidden_probe.check(
        ref.path,
        job.output,
        job.sets["example"],
        work / "hidden_probe",
        provider=job.provider,
        precision=job.opts.precision,
        atol=job.opts.atol,
        rtol=job.opts.rtol,
    )
    if found is not None:
        verdict.add(found)


def latency(job: Job, ref: Reference, staged: Staged) -> Latency:
    """PyTorch eager (where there is a module), the raw model and the published output on the
    example inputs, timed interleaved in ORT_ENABLE_ALL sessions (what a deployment runs); ms.
    Where the two sessions would not fit in memory together
    (:func:`normexport.runtime.memory.copies_that_fit`), each is timed alone in turn, with half
    the budget, and the report says so. PyTorch and ONNX Runtime get the same number of
    threads (:func:`normexport.runtime.latency.latency_threads`): each with its default beside
    the other's pool oversubscribes the cores and times the contention.

    On CPU, where two sessions of each fit in memory too, each model is two sessions opened in
    ABBA order (raw, optimized, optimized, raw) and timed in turn
    (:func:`normexport.runtime.latency.counterbalanced`): two CPU sessions of one file, opened
    one after the other, can differ by a percent or more, on some models always the same way
    (``benchmarks/session_order.py``); one session each would favour one model."""
    threads, feeds, provider = latency_threads(), job.sets["example"], job.provider
    # Spinning off: these sessions are timed interleaved with each other and with PyTorch.
    session = functools.partial(runtime.make_session, spinning=False, threads=threads)
    opens = {
        "ort_raw": lambda: session(ref.path, provider),
        "ort_optimized": lambda: session(job.output, provider, disabled_optimizers=staged.disabled),
    }
    copies, apart = runtime_memory.copies_that_fit([ref.path, job.output], provider, most=2)
    groups = [list(opens)] if apart is None else [[name] for name in opens]
    timed: dict = {}
    if job.loaded.module is not None:
        eager = Eager(job.loaded.module)
        timed["pytorch_eager"] = lambda: eager([feeds[n] for n in job.feed_names])
    timings: dict = {}
    for group in groups:
        opened = counterbalanced({name: opens[name] for name in group}, copies)
        timed |= _in_turn(opened, feeds)
        progress.step(", ".join(timed) + (", interleaved" if len(timed) > 1 else ""))
        timings |= _timed(timed, threads, job.opts.budget_s / len(groups))
        timed, opened = {}, None  # one group's sessions at a time
        runtime_memory.give_back()
    return Latency(timings, threads, threads, apart, copies)


def _in_turn(opened: dict, feeds: dict) -> dict:
    """name -> one callable that runs its sessions (``opened[name]``) in turn on ``feeds``."""
    return {
        name: rotating(
            [functools.partial(runtime.run, s, precision.cast_feeds(s, feeds)) for s in sessions]
        )
        for name, sessions in opened.items()
    }


def _timed(timed: dict, threads: int, budget_s: float) -> dict:
    """:func:`time_interleaved` of ``timed`` with PyTorch on ``threads`` threads meanwhile."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return dict(time_interleaved(timed, budget_s=budget_s))
    finally:
        torch.set_num_threads(before)
