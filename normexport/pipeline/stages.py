""":func:`run`, the main job stage by stage (see :mod:`normexport.pipeline`)."""

from __future__ import annotations

import functools
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime
import torch

import fusion
from fusion.graph import opset_version
from normexport import precision, progress, runtime
from normexport.arguments import Options, plan_outputs
from normexport.errors import UsageError
from normexport.io import external, files
from normexport.latency.verdict import NOT_TIMED, Speed
from normexport.pipeline import published, raw_model, rewrite, timing
from normexport.pipeline.job import Job, fewer_sets, start
from normexport.pipeline.prepare import prepare
from normexport.pipeline.raw_model import RawModel
from normexport.report import Cost, Fusions, InputInfo, Latency, NormOps, Report, Versions
from normexport.runtime import cuda_kernels, plan
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Judge


def run(opts: Options) -> Report:
    """Run the main job and return the report.

    Works from files: an ONNX input is read lazily (its external data stays on disk until a
    pass needs it), the raw export and every intermediate model live in a scratch folder beside
    the output, the checker and every ONNX Runtime session open files by path, and the output
    is written with its own external data file (``OUT.onnx.data``) when the input had one or
    the model is large (:func:`normexport.io.files.wants_external_data`); no model is ever one
    protobuf in memory (the float16 converter alone takes one, and refuses models over 2 GiB).
    One model's weights are in memory at a time where parity runs: each reference runs on
    every input set and is freed before the next opens (docs/memory.md); the report's ``cost``
    gives each stage's time and peak memory. The optimized model is written even when parity
    fails; ``report.parity.passed`` says whether it did.

    Raises:
        UsageError: a user mistake: unreadable or invalid file, missing or bad option, an
            output path that would overwrite the input.
        normexport.verdict.rollback.RollbackFailed: the model fails its check with no rewrite.
    """
    output, writes = plan_outputs(opts)
    with progress.recording() as stages, runtime.run_timeout(opts.run_timeout):
        with progress.stage("load"):
            provider = runtime.resolve_provider(opts.provider)
            prepared = prepare(opts)
        loaded, raw = prepared.loaded, prepared.raw
        inputs = external.input_files(loaded.path, loaded.onnx_model)
        files.refuse_overwriting(inputs, writes)
        files.write_back(inputs)  # a model file just written: clean pages, which a limit drops
        job = start(opts, output, provider, prepared)
        del prepared  # the passes change ``raw`` in place; nothing else holds it
        memory, job = _planned(job, raw)
        with files.work_folder(output) as work:
            ref, judge, job, memory = _reference(job, raw, work, memory)
            weights = external.tensor_bytes(ir.load(ref.path))  # headers only
            with progress.stage("optimize"):
                staged = rewrite.optimize(job, raw, ref, judge, work)
            del raw
            if opts.autotune:
                with progress.stage("autotune"):
                    staged = rewrite.tune(job, ref, staged)
            if opts.conversion == "int8":
                with progress.stage(opts.precision):
                    faster = None
                    if opts.benchmark and memory.latency is None:
                        faster = functools.partial(timing.faster_than, job, ref)
                    staged = rewrite.int8(job, ref, staged, judge, work, faster)
            elif opts.conversion == "half":
                with progress.stage(opts.precision):
                    staged = rewrite.half(job, ref, staged, work)
            staged, latency, judged = _latency(job, ref, staged, work, memory.latency)
            written = files.publish_model(staged.path, output)
            verdict = _parity(job, ref, staged, judge, work, memory.deployed)
    cost = Cost(stages, weights, progress.process_age_s())
    return _report(job, staged, written, verdict, latency, judged, cost, memory)


def _planned(job: Job, raw: ir.Model) -> tuple[plan.MemoryPlan, Job]:
    """The memory plan of ``raw`` on ``job``'s example inputs (said where it is worth a line),
    and the job with the input sets it keeps (:func:`normexport.pipeline.job.fewer_sets`).

    Raises:
        EnvironmentProblem: as :func:`normexport.runtime.plan.plan`.
    """
    memory = plan.plan(
        raw,
        str(job.opts.model),
        job.provider,
        latency=job.opts.benchmark,
        autotune=job.opts.autotune,
        by_blocks=job.loaded.module is None,
        feeds=job.sets["example"],
        sets=len(job.sets),
    )
    if memory.said:
        progress.say(memory.line)
    return memory, fewer_sets(job, memory.input_sets)


def _reference(
    job: Job, raw: ir.Model, work: Path, memory: plan.MemoryPlan
) -> tuple[RawModel, Judge, Job, plan.MemoryPlan]:
    """The reference stage: the reference model on file, and the parity judge with every
    reference run on every input set, one model (or one block: the memory plan's
    ``block_bytes``) at a time, each freed before the passes, the oracle in float64 where the
    plan has room for it; the job, with the example inputs the input file runs on
    (:func:`normexport.pipeline.raw_model.raw_model`), and the memory plan made again on them
    where they are larger than those first picked.

    Raises:
        UsageError: ``--last-token-logits`` where the verdict runs block by block.
        EnvironmentProblem: the larger inputs do not fit (:func:`_planned`).
    """
    with progress.stage("reference"):
        ref, runs = raw_model.raw_model(job, raw, work, memory.block_bytes)
        if runs is not job:  # the sizes first picked were refused: the plan on those that run
            memory, job = _planned(runs, raw)
        if job.policy.last_rows and memory.block_bytes is not None:
            raise UsageError(
                f"{job.opts.model}: --last-token-logits needs the whole-model verdict, and this "
                "model's runs block by block (its weights do not fit twice in the memory "
                "available): run it where more memory is free, or without --last-token-logits"
            )
        judge = Judge(
            loaded=job.loaded,
            raw=ref.runs,
            raw_path=ref.path,
            sets=job.sets,
            feed_names=job.feed_names,
            work=work,
            provider=job.provider,
            atol=job.opts.atol,
            rtol=job.opts.rtol,
            strict=job.opts.strict,
            rule=job.computes_in,
            block_bytes=memory.block_bytes,
            float64=memory.float64_oracle,
            last_position=(0,) if job.policy.last_rows else (),
        )
        judge.record((job.output_rule,))
        if memory.deployed is None:
            ref = raw_model.as_deployed(job, raw, ref, judge, work)
    return ref, judge, job, memory


def _latency(
    job: Job,
    ref: RawModel,
    staged: rewrite.Staged,
    work: Path,
    skipped: str | None,
) -> tuple[rewrite.Staged, Latency | None, Speed]:
    """The latency stage with its verdict, before the output is published (an int8 model
    against the float32 one, :func:`normexport.pipeline.timing.int8_or_float32`; else
    :func:`normexport.pipeline.timing.judged`: the staged model, kept or with the rewrites
    found slower left out), where asked for; ``skipped``: why the latency cannot be timed (the
    memory plan's), or None."""
    if not job.opts.benchmark:
        return staged, None, Speed(unchecked=NOT_TIMED)
    if skipped is not None:
        return staged, Latency({}, 0, 0, skipped), Speed(unchecked=skipped)
    with progress.stage("latency"):
        if staged.float32 is not None:
            return timing.int8_or_float32(job, ref, staged)
        return timing.judged(job, ref, staged, work)


def _parity(
    job: Job,
    ref: RawModel,
    staged: rewrite.Staged,
    judge: Judge,
    work: Path,
    unjudged: str | None,
) -> ParityResult:
    """The parity stage of the published output, judged as deployed too (and repaired for
    ONNX Runtime where it can be) unless the memory plan says why not (``unjudged``, then in
    the verdict's notes), with the hidden-state probe for half precision."""
    with progress.stage("parity"):
        verdict = published.parity(job, staged, judge)
        if unjudged is None:
            verdict = published.as_deployed(job, ref, staged, judge, verdict, work)
        else:
            verdict.notes = [*verdict.notes, unjudged]
        half = job.opts.conversion == "half"
        if half and precision.OVERFLOW_PROBE not in job.sets:
            published.hidden_state_probe(job, ref, verdict, work)
    return verdict


def _report(
    job: Job,
    staged: rewrite.Staged,
    written: list[Path],
    parity: ParityResult,
    latency: Latency | None,
    judged: Speed,
    cost: Cost,
    memory: plan.MemoryPlan,
) -> Report:
    """The typed report of a finished run; ``judged``: the latency verdict."""
    optimized = ir.load(job.output)
    return Report(
        model=str(job.opts.model),
        kind=job.loaded.kind,
        exporter=job.export.exporter,
        exporter_fallback=job.export.fallback_reason,
        exporter_warnings=list(job.export.warnings),
        opset=opset_version(optimized),
        target=job.opts.target,
        output=job.output,
        files_written=list(written),
        inputs={k: InputInfo(list(v.shape), str(v.dtype)) for k, v in job.example.items()},
        fusions=Fusions.from_fusion_report(staged.fusions, job.already),
        norm_ops=NormOps(job.ops_before, fusion.norm_ops(optimized)),
        onnxruntime_ops=fusion.onnxruntime_ops(optimized),
        checker=staged.checker,
        parity=parity,
        provider=runtime.PROVIDERS[job.provider][0],
        provider_note=job.provider_note,
        notes=job.notes,
        latency=latency,
        autotune=staged.tuned,
        precision=staged.precision,
        versions=Versions(torch.__version__, onnx.__version__, onnxruntime.__version__),
        rollback=staged.rollback,
        speed=judged,
        cost=cost,
        memory=memory,
        cuda_fallbacks=cuda_kernels.without_kernel(optimized) if job.provider == "cuda" else None,
    )
