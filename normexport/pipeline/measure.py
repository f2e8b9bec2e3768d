"""What judges and times the output: the parity stage's verdict on the published output (with
the hidden-state probe for half precision), and the timing of a model against the raw one that
the latency stage runs before publishing (:mod:`normexport.pipeline.speed`)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from normexport import precision, progress, runtime
from normexport.io.eager import Eager
from normexport.pipeline.job import Job
from normexport.pipeline.rewrite import Reference, Staged
from normexport.report import Latency
from normexport.runtime import memory as runtime_memory
from normexport.runtime.latency import counterbalanced, runner, time_interleaved
from normexport.verdict import hidden_probe, speed
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Judge
from normexport.verdict.speed import Comparison


def parity(job: Job, staged: Staged, judge: Judge) -> ParityResult:
    """The parity verdict of the published output (``job.output``) against the oracle (see
    :mod:`normexport.verdict.parity` and :mod:`normexport.verdict.references`), with the raw
    model (the raw export, or the input file as written) and PyTorch float32 compared with it
    too. Every ONNX model runs with ONNX Runtime's graph optimizations off, so that its own
    rewrites are not part of the comparison. Its ``raw_worst()`` is the raw model's worst error
    against the oracle over all input sets (None where no float64 oracle could be built for
    ONNX input).

    A float32 model that is still the one :func:`normexport.verdict.rollback.verify` judged
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
    found = hidden_probe.compare(
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


def latency(
    job: Job,
    ref: Reference,
    path: Path,
    budget_s: float,
    disabled: tuple[str, ...] = (),
    eager: bool = False,
) -> tuple[Latency, Comparison | None]:
    """The raw model and the model at ``path`` (run with ORT's ``disabled`` optimizers) on the
    example inputs, timed interleaved for ``budget_s`` seconds in ORT_ENABLE_ALL sessions (what
    a deployment runs), and with ``eager`` PyTorch eager first (where there is a module), alone,
    for a quarter of it; ms. PyTorch and ONNX Runtime get the same number of threads
    (``job.threads``: ``--threads``, else the cores this process may run on): each with its
    default beside the other's pool oversubscribes the cores and times the contention. PyTorch
    is not timed in the ONNX models' rounds: there its thread pool slowed the ORT call after it,
    by up to twice on 2 cores (a Conv-BN-LayerNorm net's 0.03 ms sessions took 0.06-0.08 ms),
    noise the A/A control does not see.

    Each ONNX model is two sessions, called once each a round; its time in a round is their
    mean, and each model's two, compared with each other, are the latency verdict's A/A
    controls (:func:`normexport.verdict.speed.compare`). On CPU, where two sessions of each fit
    in memory, they are four, opened in ABBA order (raw, model, model, raw:
    :func:`normexport.runtime.latency.counterbalanced`): two CPU sessions of one file, opened
    one after the other, can differ by a percent or more, on some models always the same way
    (``benchmarks/session_order.py``); elsewhere one session of each, called twice. Where even
    one of each would not fit together (:func:`normexport.runtime.memory.copies_that_fit`),
    each model is timed alone in turn, with half the budget, the report says so, and there is
    no comparison (None)."""
    threads, provider, feeds = job.threads, job.provider, job.sets["example"]
    # Spinning off: these sessions are timed interleaved with each other.
    session = functools.partial(runtime.make_session, spinning=False, threads=threads)
    opens = {
        "ort_raw": lambda: session(ref.path, provider),
        "ort_optimized": lambda: session(path, provider, disabled_optimizers=disabled),
    }
    timings: dict = {}
    if eager and job.loaded.module is not None:
        progress.step("pytorch_eager")
        run = Eager(job.loaded.module)
        calls = {"pytorch_eager": lambda: run([feeds[n] for n in job.feed_names])}
        timings |= _timed(calls, threads, budget_s / 4)
        budget_s -= budget_s / 4
    copies, apart = runtime_memory.copies_that_fit([ref.path, path], provider, most=2)
    groups = [list(opens)] if apart is None else [[name] for name in opens]
    for group in groups:
        progress.step(", ".join(group) + (", interleaved" if len(group) > 1 else ""))
        opened = counterbalanced({name: opens[name] for name in group}, copies)
        timings |= _timed(_twice(opened, feeds), threads, budget_s / len(groups))
        opened = None  # one group's sessions at a time
        runtime_memory.give_back()
    pairs = {name: [timings.pop(f"{name}#{i}") for i in (0, 1)] for name in opens}
    comparison = None
    if apart is None:
        timings["ort_raw"], timings["ort_optimized"], comparison = speed.compare(
            pairs["ort_raw"], pairs["ort_optimized"]
        )
    else:  # timed apart: each model's own mean over its calls, no pairing across models
        for name, pair in pairs.items():
            timings[name] = speed.pooled(pair)
    return Latency(timings, threads, threads, apart, copies), comparison


def _twice(opened: dict, feeds: dict) -> dict:
    """``NAME#0`` and ``NAME#1`` -> a callable that runs one of ``opened[NAME]``'s sessions on
    ``feeds``: each of two sessions, or one session twice. A plain ``session.run``
    (:func:`~normexport.runtime.latency.runner`): not :func:`normexport.runtime.run`, whose
    ``--run-timeout`` timer thread, started per call, would be timed with each run."""
    calls = {}
    for name, sessions in opened.items():
        for i, s in enumerate((sessions * 2)[:2]):
            calls[f"{name}#{i}"] = runner(s, precision.cast_feeds(s, feeds), io_binding=False)[0]
    return calls


#: The fewest timed rounds of the main job's latency: the budget (``--budget``) decides above
#: it, and a model whose rounds take longer is timed past the budget (each timing says which
#: bound decided, :attr:`normexport.runtime.latency.Timing.bound`).
MIN_ROUNDS = 5


def _timed(timed: dict, threads: int, budget_s: float) -> dict:
    """:func:`time_interleaved` of ``timed`` with PyTorch on ``threads`` threads meanwhile."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return dict(time_interleaved(timed, budget_s=budget_s, min_runs=MIN_ROUNDS))
    finally:
        torch.set_num_threads(before)
