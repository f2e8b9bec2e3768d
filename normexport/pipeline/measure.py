"""The stages that judge and time the published output: parity (with the hidden-state probe
for half precision) and latency."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from normexport import precision, runtime
from normexport.io.eager import Eager
from normexport.pipeline.job import Job
from normexport.pipeline.optimize import Reference, Staged
from normexport.report import Latency
from normexport.runtime.latency import latency_threads, time_interleaved
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
    session = runtime.make_session(
        job.output,
        job.provider,
        optimization_level=runtime.AS_WRITTEN,
        spinning=False,
        disabled_optimizers=staged.disabled,
    )

    def candidate(feeds):
        return runtime.run(session, precision.cast_feeds(session, feeds))

    names = [o.name for o in session.get_outputs()]
    return judge(candidate, names, precision=job.opts.precision)


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
    PyTorch and ONNX Runtime get the same number of threads
    (:func:`normexport.runtime.latency.latency_threads`): each with its default beside the
    other's pool oversubscribes the cores and times the contention."""
    threads = latency_threads()
    feeds, provider = job.sets["example"], job.provider
    # Spinning off: these sessions are timed interleaved with each other and with PyTorch.
    raw_session = runtime.make_session(ref.path, provider, spinning=False, threads=threads)
    opt_session = runtime.make_session(
        job.output, provider, spinning=False, disabled_optimizers=staged.disabled, threads=threads
    )
    opt_feeds = precision.cast_feeds(opt_session, feeds)
    timed = {
        "ort_raw": lambda: runtime.run(raw_session, feeds),
        "ort_optimized": lambda: runtime.run(opt_session, opt_feeds),
    }
    if job.loaded.module is not None:
        eager = Eager(job.loaded.module)
        timed = {"pytorch_eager": lambda: eager([feeds[n] for n in job.feed_names])} | timed
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timings = time_interleaved(timed, budget_s=job.opts.budget_s)
    finally:
        torch.set_num_threads(before)
    return Latency(dict(timings), threads, threads)
