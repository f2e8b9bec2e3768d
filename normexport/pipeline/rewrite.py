"""The stages that make the output: take the reference, run the passes (the rewrites that ONNX
Runtime rejects or that change the function undone), autotune, convert to half precision.

Every model lives on file in the run's scratch folder; each stage returns a new
:class:`Staged` that names the file it stands for.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

import fusion
from normexport import precision, progress, runtime
from normexport.errors import InputFileError, RunTimedOut, UsageError, one_line
from normexport.io import files
from normexport.pipeline.job import Job
from normexport.tuning import autotune
from normexport.verdict import rollback
from normexport.verdict.checker import Checker, check_output, checker_level
from normexport.verdict.parity import ParityResult, Recorded
from normexport.verdict.references import Judge


@dataclasses.dataclass(frozen=True)
class Reference:
    """The model the output is compared with, on file.

    Attributes:
        path: the input file (ONNX input) or the raw export saved in the scratch folder.
        raw: it, run as written (:func:`normexport.runtime.check_session`, opened on demand,
            its outputs recorded per input set; ``raw.close()`` frees its session).
        checker: how far the ONNX checker accepts it, and its complaint
            (:func:`normexport.verdict.checker.checker_level`; ``("full", None)`` for an export).
    """

    path: Path
    raw: Recorded
    checker: tuple[str, str | None] = ("full", None)


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
        precision: the half-precision conversion's report, where it ran.
    """

    path: Path
    fusions: fusion.FusionReport
    checker: Checker
    verified: ParityResult | None = None
    rollback: rollback.Outcome | None = None
    tuned: autotune.AutotuneResult | None = None
    precision: precision.PrecisionReport | None = None

    @property
    def disabled(self) -> tuple[str, ...]:
        """ORT optimizers the output's sessions must disable (autotune's choice)."""
        return self.tuned.disabled_optimizers if self.tuned else ()


def reference(job: Job, raw: ir.Model, work: Path) -> Reference:
    """The model the output is compared with, on file: for ONNX input the input itself (loaded
    as written, run once on the example, checked; its session freed), else the raw export
    saved into ``work``.

    Raises:
        InputFileError: ONNX Runtime cannot load the input file.
        UsageError: ONNX Runtime cannot run the input file as given.
    """
    if job.loaded.kind != "onnx":
        path = work / "raw.onnx"
        files.save_model(raw, path, external_data=True)
        return Reference(path, _recorded(runtime.OnDemand(path, job.provider)))
    path = Path(job.opts.model)
    session = runtime.OnDemand(path, job.provider)
    _opens(session, path)
    recorded = _recorded(session)
    try:
        _runs_as_given(recorded, job.sets["example"], path, _hint(job.opts))
    finally:
        recorded.close()
    return Reference(path, recorded, checker_level(path))


def _recorded(session: runtime.OnDemand) -> Recorded:
    """The model of ``session`` run as written, its outputs recorded; ``close()`` frees it."""
    run = functools.partial(runtime.run, quiet=True, kept=True)
    return Recorded(lambda feeds: run(session.open(), feeds), session.close)


def _opens(session: runtime.OnDemand, path: Path) -> None:
    """Open the input file's session: a file ONNX Runtime cannot load is the user's to fix.

    Raises:
        InputFileError: ONNX Runtime cannot load ``path``.
    """
    try:
        session.open()
    except runtime.ProviderUnavailable:
        raise
    except Exception as err:  # ORT raises its own error types for a bad file
        raise InputFileError(
            f"{path}: ONNX Runtime cannot load this model ({one_line(err)}); normexport "
            "optimizes models that ONNX Runtime runs: fix or re-export it"
        ) from None


def _hint(opts: Any) -> str:
    """What to check where the input file fails on the example inputs: the inputs the user
    gave, the sizes of the symbolic axes, or the file itself."""
    if opts.input_shape or opts.inputs:
        return "check --input-shape / --inputs against the model's inputs"
    if getattr(opts, "dim", None):
        return (
            "check that the --dim sizes agree with one another (a mask over the past and the "
            "new tokens has as many positions as the two together)"
        )
    return "fix or re-export it"


def _runs_as_given(raw: Recorded, feeds: dict[str, np.ndarray], path: Path, hint: str) -> None:
    """Run the input file once on the example inputs, before anything is optimized: a model
    that ONNX Runtime loads but cannot run (an invalid node, inputs of the wrong shape) is the
    user's to fix, not a parity failure. ``hint``: what to check (:func:`_hint`).

    Raises:
        UsageError: ONNX Runtime fails on it, naming the inputs that were given.
    """
    try:
        raw(feeds)  # the failure is reported once, by us
    except RunTimedOut as err:  # said as it is: the model ran, too long
        raise RunTimedOut(f"{path}: {err}") from None
    except Exception as err:  # ORT's own error types
        shapes = " ".join(f"{k}={'x'.join(map(str, v.shape))}:{v.dtype}" for k, v in feeds.items())
        raise UsageError(
            f"{path}: ONNX Runtime cannot run this model as given on inputs {shapes} "
            f"({one_line(err)}); {hint}"
        ) from None


def rewrite(job: Job, raw: ir.Model, ref: Reference, judge: Judge, work: Path) -> Staged:
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


def _passes(job: Job, raw: ir.Model, ref: Reference) -> fusion.FusionReport:
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
    job: Job, ref: Reference, work: Path, folder: str, always: frozenset[fusion.Fused] = frozenset()
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


def tune(job: Job, ref: Reference, staged: Staged) -> Staged:
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


def half(job: Job, ref: Reference, staged: Staged, work: Path) -> Staged:
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
