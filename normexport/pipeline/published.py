"""The parity stage: the verdict on the published output, with the hidden-state probe for half
precision."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from normexport import precision, runtime
from normexport.pipeline.job import Job
from normexport.pipeline.raw_model import RawModel
from normexport.pipeline.rewrite import Staged
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


def hidden_state_probe(job: Job, ref: RawModel, verdict: ParityResult, work: Path) -> None:
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
