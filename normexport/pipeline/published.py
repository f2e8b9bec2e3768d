"""The parity stage: the verdict on the published output, the output judged as deployed (and
repaired where ONNX Runtime's own fusions misread it), with the hidden-state probe for half
precision."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import onnx_ir as ir

from normexport import progress, runtime
from normexport.io import files
from normexport.pipeline.job import Job
from normexport.pipeline.raw_model import RawModel, for_ort
from normexport.pipeline.rewrite import Staged
from normexport.verdict import deployed, hidden_probe
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Judge
from normexport.verdict.result import Deployed
from normexport.verdict.rollback import opened


def parity(job: Job, staged: Staged, judge: Judge, path: Path | None = None) -> ParityResult:
    """The parity verdict of the published output (``job.output``) against the oracle (see
    :mod:`normexport.verdict.parity` and :mod:`normexport.verdict.references`), with the raw
    model (the raw export, or the input file as written) and PyTorch float32 compared with it
    too. Every ONNX model runs with ONNX Runtime's graph optimizations off, so that its own
    rewrites are not part of the comparison. Its ``raw_worst()`` is the raw model's worst error
    against the oracle over all input sets (None where no float64 oracle could be built for
    ONNX input).

    A float32 model that is still the one :func:`normexport.verdict.rollback.verify` judged
    keeps that verdict (its runs are not repeated); autotune's choice or a half-precision model
    is judged anew, as is ``path`` (a model other than the one staged), where given.
    """
    if staged.verified is not None and path is None:
        return dataclasses.replace(staged.verified, strict=job.opts.strict)

    # opened once the references have run and been freed
    candidate = opened(runtime.check_session, job.provider, disabled_optimizers=staged.disabled)
    return judge(path or job.output, candidate, precision=rule(job, staged))


def rule(job: Job, staged: Staged) -> str:
    """The precision whose parity rule judges the published output: ``job.output_rule``, but
    the raw model's own where ``--precision int8`` published the float32 model."""
    if getattr(staged.precision, "published", None) == "fp32":
        return job.computes_in
    return job.output_rule


def as_deployed(
    job: Job, ref: RawModel, staged: Staged, judge: Judge, verdict: ParityResult, work: Path
) -> ParityResult:
    """``verdict`` (the published output's) with the output judged as deployed
    (:func:`normexport.verdict.deployed.judged`: ONNX Runtime's default session against the
    oracle) as its ``deployed``, which says what was repaired in the raw model (``ref``:
    :func:`normexport.pipeline.raw_model.as_deployed`). Where that fails, the output is
    rewritten into the forms ONNX Runtime's fusions do not misread
    (:func:`normexport.pipeline.raw_model.for_ort`, exact), judged again as written and as
    deployed, and published in its place where both pass (the verdict returned is then the new
    model's); else the output stays as it is and the verdict fails
    (docs/parity.md#judged-as-deployed).
    """
    progress.step(f"as deployed ({deployed.LEVEL})")
    judged = (job.provider, judge, rule(job, staged), staged.disabled)
    found = deployed.judged(job.output, *judged)
    sets = list(job.sets)
    raw = (ref.found, ref.repairs, "raw") if ref.repairs else ()
    verdict.deployed = Deployed(found.passed, found.message, sets, *raw)
    model = None if found.passed else ir.load(job.output)
    repairs = for_ort(model) if model else {}
    if not repairs:
        return verdict
    repaired = work / "deployed" / job.output.name
    repaired.parent.mkdir()
    files.save_model(model, repaired, external_data=job.external)
    del model
    progress.step("the output repaired for ONNX Runtime, judged again")
    again = parity(job, staged, judge, repaired)
    after = deployed.judged(repaired, *judged)
    repairs = dict(collections.Counter(ref.repairs) + collections.Counter(repairs))
    if not (after.passed and again.passed):  # tried, not kept
        verdict.deployed.repairs = repairs
        return verdict
    files.publish_model(repaired, job.output)
    again.deployed = Deployed(True, after.message, sets, found.message, repairs, "output")
    return again


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
