"""The stages that change the output, each returning a new :class:`Staged` that names the file
it stands for in the run's scratch folder: optimize (the passes; the rewrites that ONNX Runtime
rejects or that change the function undone), autotune, and the conversion to half precision or
int8.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir

import fusion
from normexport import precision, progress, runtime
from normexport.errors import InputFileError, one_line
from normexport.io import files
from normexport.pipeline.job import Job
from normexport.pipeline.raw_model import RawModel
from normexport.precision import int8 as quant
from normexport.precision import int8_budget as budget
from normexport.precision.convert import load_for_conversion, name_nodes
from normexport.tuning import autotune
from normexport.verdict import rollback
from normexport.verdict.checker_levels import Checker, check_output
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Judge
from normexport.verdict.rollback import opened


@dataclasses.dataclass(frozen=True)
class Staged:
    """The output as it stands after a stage, in the scratch folder.

    Attributes:
        path: its file (with its external data file beside it, where it has one).
        fusions: what the passes did to it (:class:`fusion.FusionReport`).
        checker: the ONNX checker's levels for the input and it.
        verified: its float32 verdict, while it is still the model that was judged, else None.
        rollback: what the rollback undid, where it undid anything or could not explain a
            failure (:class:`normexport.verdict.rollback.Outcome`), else None.
        tuned: autotune's result, where it ran.
        precision: the half-precision conversion's or the int8 stage's report, where it ran.
        float32: with int8, the float32 optimized model (its nodes named as the int8 model's
            exclusions name them), which the latency verdict times int8 against and publishes
            where int8 is slower; else None.
    """

    path: Path
    fusions: fusion.FusionReport
    checker: Checker
    verified: ParityResult | None = None
    rollback: rollback.Outcome | None = None
    tuned: autotune.AutotuneResult | None = None
    precision: precision.PrecisionReport | quant.Int8Report | None = None
    float32: Path | None = None

    @property
    def disabled(self) -> tuple[str, ...]:
        """ORT optimizers the output's sessions must disable (autotune's choice)."""
        return self.tuned.disabled_optimizers if self.tuned else ()


def optimize(job: Job, raw: ir.Model, ref: RawModel, judge: Judge, work: Path) -> Staged:
    """Run the passes on ``raw`` in place, stage the result in ``work``, check it
    (:func:`normexport.verdict.rollback.verify`) and, where it fails, put the model without the
    rewrites responsible in its place (:func:`normexport.verdict.rollback.roll_back`, each build
    from ``ref.path``); the undone rewrites join the fusion report's refusals.

    Raises:
        normexport.verdict.rollback.RollbackFailed: the model fails its check with no rewrite.
    """
    progress.step("the passes")
    fusions = _passes(job, raw, ref)
    staged = work / job.output.name
    progress.step("saving")
    files.save_model(raw, staged, external_data=job.external)
    build = builder(job, ref, work, "rollback")
    verdicts: dict[Path, ParityResult] = {}

    def check(path):
        progress.step(f"checking {path.relative_to(work)}")
        rejection, verdicts[path] = rollback.verify(path, job.provider, ref.checker[0], judge)
        return rejection

    outcome = rollback.roll_back(staged, fusions, build, check)
    if outcome.undone:
        move_onto(outcome.path, staged)
        fusions = outcome.report
        fusions.extend(rollback.refusals(outcome.undone))
    level, problem = ref.checker
    return Staged(
        staged,
        fusions,
        # rollback.verify has checked it at the input's level, where the input has one
        check_output(staged, level, problem) if level == "none" else Checker(level, problem, level),
        verdicts.get(outcome.path),
        outcome if outcome.undone or outcome.unexplained else None,
    )


def _passes(job: Job, raw: ir.Model, ref: RawModel) -> fusion.FusionReport:
    """:func:`fusion.optimize` of ``raw`` under the run's policy. A pass that fails on a model
    the ONNX checker rejects (a Constant with no value, an attribute no schema has) fails on
    the file, not on a bug: said as the file's, with the checker's complaint.

    Raises:
        InputFileError: a pass failed, and the ONNX checker rejects the input.
    """
    try:
        return fusion.optimize(raw, job.policy)
    except Exception as err:
        level, problem = ref.checker
        if level == "full":
            raise  # a valid model: a bug of the passes
        raise InputFileError(
            f"{job.opts.model}: the graph passes cannot read this model ({one_line(err)}), and "
            f"the ONNX checker rejects it: {problem}; fix the file or export it again"
        ) from None


def builder(
    job: Job, ref: RawModel, work: Path, folder: str, always: frozenset[fusion.Fused] = frozenset()
) -> rollback.Build:
    """``build(excluded)`` (:data:`normexport.verdict.rollback.Build`): the reference model
    optimized again as the optimize stage does, with the rewrites ``excluded`` and ``always``
    left out, saved under the output's name in a new folder ``work/FOLDER-N``."""
    builds = itertools.count(1)

    def build(excluded):
        model = ir.load(ref.path)
        report = fusion.optimize(model, job.policy, exclude=excluded | always)
        path = work / f"{folder}-{next(builds)}" / job.output.name
        path.parent.mkdir()
        files.save_model(model, path, external_data=job.external)
        return path, report

    return build


def tune(job: Job, ref: RawModel, staged: Staged) -> Staged:
    """Time the exact alternatives of the staged output (and, where attention was fused, of the
    model without it) and put the fastest in the staged model's place; the fusion report
    becomes that of the model kept."""
    opts, unfused_path, unfused_fusions = job.opts, None, None
    counts = staged.fusions.counts
    if counts["attention_fused"] or counts["gqa_fused"] or counts["sdpa_fused"]:  # per shape
        unfused = ir.load(ref.path)
        unfused_fusions = fusion.optimize(unfused, job.policy.without_attention())
        unfused_path = staged.path.with_name(autotune.ATTENTION_UNFUSED + ".onnx")
        files.save_model(unfused, unfused_path, external_data=True)
    tuned = autotune.autotune(
        autotune.candidates(staged.path, target=opts.target, attention_unfused=unfused_path),
        job.sets["example"],
        job.provider,
        budget_s=opts.budget_s / 2,
        atol=opts.atol,
        rtol=opts.rtol,
    )
    changed = tuned.best != tuned.default
    if changed:
        _replace_staged(staged.path, ir.load(tuned.model), job.external)
    unfused_kept = tuned.best.startswith(autotune.ATTENTION_UNFUSED)
    return dataclasses.replace(
        staged,
        fusions=unfused_fusions if unfused_kept else staged.fusions,
        verified=None if changed else staged.verified,
        tuned=tuned,
    )


def half(job: Job, ref: RawModel, staged: Staged, work: Path) -> Staged:
    """Convert the staged model to float16 or bfloat16 (:func:`normexport.precision.to_half`),
    the norms the fusions refused kept in float32, and put it in the staged model's place,
    checked."""
    path = work / "half" / staged.path.name
    path.parent.mkdir()
    report = precision.to_half(
        staged.path,
        path,
        precision=job.opts.precision,
        provider=job.provider,
        keep_io_types=job.opts.keep_io_types,
        refused=staged.fusions.refused,
        external_data=job.external,
    )
    move_onto(path, staged.path)
    checker = check_output(staged.path, *ref.checker)
    return dataclasses.replace(staged, checker=checker, verified=None, precision=report)


def int8(
    job: Job,
    ref: RawModel,
    staged: Staged,
    judge: Judge,
    work: Path,
    faster: Callable[[Path, Path], bool] | None = None,
) -> Staged:
    """Quantize the staged model by ONNX Runtime's tools (:func:`normexport.precision.int8.
    quantize`), norms and Softmax kept float; where it has convs int8 may be slower for
    (:func:`normexport.precision.int8.slow_convs`) and ``faster`` is given (whether the model
    at the first path is faster than the one at the second: the latency verdict's, None
    without it), quantize it again with them float too and keep that one where ``faster``
    says so (else every conv is int8: ONNX Runtime's own choice). Judge it by the int8 budget;
    where it fails, measure what each linear layer costs the output (one at a time,
    :func:`normexport.precision.int8_budget.layer_costs`) and keep the costliest in float, one
    more at a time, until it passes, at most
    :data:`~normexport.precision.int8_budget.MAX_KEPT_FOR_BUDGET`; out of budget even then, the
    float32 model stays staged and the report says why. The float32 model is kept beside it
    (:attr:`Staged.float32`) for the latency verdict.

    Raises:
        UsageError: the model passes protobuf's 2 GiB limit (ONNX Runtime's quantizer takes
            one protobuf); a model below opset 13 that ONNX's version converter cannot lift.
    """
    name, opts, folder = staged.path.name, job.opts, work / "int8"
    float32 = _float32_copy(job, staged.path, folder / "float32" / name)
    kept = quant.kept_ops(float32, staged.fusions.refused)
    calibration = job.calibration if opts.precision == "int8" else []
    cache = folder / "calibration.json"
    candidate = opened(runtime.check_session, job.provider)
    model = folder / "model" / name

    def quantized() -> tuple[str, ParityResult]:
        progress.step(f"quantizing ({len(kept)} node(s) kept float)")
        for path in (model, files.data_path(model)):
            path.unlink(missing_ok=True)
        names = [k.node for k in kept]
        how = quant.quantize(
            float32, model, precision=opts.precision, calibration=calibration, kept=names,
            external_data=job.external, cache=cache,
        )  # fmt: skip
        return how, judge(model, candidate, precision=opts.precision)

    quantizer, verdict = quantized()
    slow = quant.slow_convs(float32)
    if slow and faster is not None:
        chosen = _slow_convs_float(model, slow, kept, quantized, faster)
        quantizer, verdict = chosen or (quantizer, verdict)
    if not verdict.passed:
        costs = budget.layer_costs(
            float32, precision=opts.precision, calibration=calibration,
            feeds=list(job.sets.values()), kept=[k.node for k in kept],
            candidates=budget.linear_nodes(float32, [k.node for k in kept]), cache=cache,
        )  # fmt: skip
        for worst in budget.costliest(float32, *costs):
            kept.append(worst)
            quantizer, verdict = quantized()
            if verdict.passed:
                break
    report = quant.Int8Report(opts.precision, quantizer, _calibration_source(job), kept)
    if verdict.passed:
        move_onto(model, staged.path)
        checker = check_output(staged.path, *ref.checker)
        return dataclasses.replace(
            staged, checker=checker, verified=verdict, precision=report, float32=float32
        )
    report.published = "fp32"
    report.why_float32 = (
        f"int8 stayed out of its budget with {len(kept)} node(s) kept float "
        f"(worst output rel L2 {max(e.rel_l2_err for e in verdict.worst().values()):.3g}): "
        "float32 published"
    )
    return dataclasses.replace(staged, precision=report)


def _slow_convs_float(
    model: Path,
    slow: list[quant.KeptFloat32],
    kept: list[quant.KeptFloat32],
    quantized: Callable[[], tuple[str, ParityResult]],
    faster: Callable[[Path, Path], bool],
) -> tuple[str, ParityResult] | None:
    """The int8 model at ``model`` quantized again (``quantized``) with the convs of ``slow``
    float too (appended to ``kept``) and kept where ``faster`` times it faster than the one
    with every conv int8: its quantizer and verdict; else the model with every conv int8 put
    back at ``model``, ``kept`` as it was, and None."""
    every = model.parent.with_name("every_conv") / model.name
    every.parent.mkdir()
    move_onto(model, every)
    kept += slow
    chosen = quantized()
    progress.step(f"int8 with {len(slow)} conv(s) float, against every conv int8")
    if faster(model, every):
        return chosen
    del kept[-len(slow) :]
    move_onto(every, model)
    return None


def _float32_copy(job: Job, staged: Path, path: Path) -> Path:
    """The staged float32 model written to ``path`` with every node named (ONNX Runtime's
    quantizer excludes nodes by name) at opset 13 at least
    (:func:`normexport.precision.int8.per_channel_opset`)."""
    path.parent.mkdir(parents=True)
    proto = quant.per_channel_opset(load_for_conversion(staged, job.opts.precision))
    name_nodes(proto.graph)
    location = files.data_path(path).name
    onnx.save(proto, path, save_as_external_data=job.external, location=location)
    return path


def _calibration_source(job: Job) -> str | None:
    """Where int8's calibration samples came from, in words (None for ``int8-dynamic``); said
    on the progress display where they are the generated inputs."""
    if job.opts.precision != "int8":
        return None
    count = f", {len(job.calibration)} sample(s)"
    if job.opts.calibration is not None:
        return f"{job.opts.calibration}{count}"
    progress.say(
        "int8 calibrated on the generated inputs: its accuracy depends on real data, give "
        "samples with --calibration"
    )
    return "the generated input sets" + count


def _replace_staged(staged: Path, chosen: ir.Model, external: bool) -> None:
    """Write ``chosen`` in the staged model's place (and its external data file's)."""
    kept = staged.with_name("tuned") / staged.name
    kept.parent.mkdir()
    files.save_model(chosen, kept, external_data=external)
    fusion.check(kept, full_check=False)
    move_onto(kept, staged)


def move_onto(source: Path, staged: Path) -> None:
    """Move the model at ``source`` (and its external data file, named after it) onto
    ``staged``: both have the same file name, so the data file's name in the model holds."""
    for path in (staged, files.data_path(staged)):
        path.unlink(missing_ok=True)
    os.replace(source, staged)
    if files.data_path(source).exists():
        os.replace(files.data_path(source), files.data_path(staged))
