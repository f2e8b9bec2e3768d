"""The main job: load, export, optimize, prove parity, time, write model and report."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch

import fusion
from fusion._ir import opset_version
from normexport import precision as precision_mod
from normexport import runtime
from normexport.arguments import Options, check_options, dynamic_axes
from normexport.errors import InputFileError, UsageError, one_line
from normexport.io import files
from normexport.io import inputs as inputs_mod
from normexport.io.eager import Eager
from normexport.io.export import ExportError, export_module
from normexport.io.load import LoadedModel, load_model
from normexport.report import (
    Checker,
    Fusions,
    InputInfo,
    Latency,
    NormOps,
    Report,
    Versions,
    explain,
)
from normexport.runtime.latency import time_interleaved
from normexport.tuning import autotune, variants
from normexport.verdict import hidden_probe
from normexport.verdict import oracle as oracle_mod
from normexport.verdict import parity as parity_mod
from normexport.verdict import rollback as rollback_mod
from normexport.verdict.parity import ParityResult, check_parity

__all__ = ["Options", "Prepared", "Report", "default_output", "prepare", "run"]


def default_output(model_path: Path) -> Path:
    """``dir/name.pt`` -> ``dir/name.opt.onnx``: the last suffix is replaced, so
    ``ch_ppocr_mobile_v2.0_cls_infer.onnx`` -> ``ch_ppocr_mobile_v2.0_cls_infer.opt.onnx``."""
    return model_path.with_name(model_path.stem + ".opt.onnx")


@dataclasses.dataclass(frozen=True)
class ExportInfo:
    """Which exporter made the raw model.

    Attributes:
        exporter: ``"dynamo"``, ``"torchscript"``, or ``"none"`` for ONNX input.
        fallback_reason: why the dynamo exporter failed where the TorchScript one was used
            (one line), else None.
        warnings: the TorchScript tracer's warnings (``file:line: message``), each once.
    """

    exporter: str
    fallback_reason: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


class Prepared(NamedTuple):
    """The loaded model, its example inputs, and its ONNX form before normexport's passes."""

    loaded: LoadedModel
    example: dict[str, np.ndarray]
    raw: ir.Model
    export: ExportInfo


@dataclasses.dataclass
class _Job:
    """What the stages of :func:`run` hand on to each other."""

    opts: Options
    output: Path
    provider: str
    provider_note: str | None
    loaded: LoadedModel
    example: dict[str, np.ndarray]
    export: ExportInfo
    raw: ir.Model | None  # in memory until the optimized model is staged, then None
    feed_names: list[str]
    sets: dict[str, dict[str, np.ndarray]]
    ops_before: dict[str, int]
    already: list
    external: bool
    raw_path: Path | None = None
    reference_session: Any = None  # ONNX input: the input file, as written
    input_checker: tuple[str, str | None] = ("full", None)
    staged: Path | None = None
    fusions: fusion.FusionReport | None = None
    checker: Checker | None = None
    tuned: autotune.AutotuneResult | None = None
    precision: precision_mod.PrecisionReport | None = None
    written: list[Path] = dataclasses.field(default_factory=list)
    references: dict | None = None  # check_parity's reference arguments, each run remembered
    verified: ParityResult | None = None  # the staged model's float32 verdict, while it holds
    rollback: rollback_mod.Outcome | None = None

    @property
    def disabled(self) -> tuple[str, ...]:
        """ORT optimizers the output's sessions must disable (autotune's choice)."""
        return self.tuned.disabled_optimizers if self.tuned else ()


def run(opts: Options) -> Report:
    """Run the main job and return the report (see README, "The report").

    Stages: plan the outputs, :func:`prepare` (load, example inputs, export), take the
    reference, optimize and check (the rewrites that ONNX Runtime rejects or that change the
    function undone: :mod:`normexport.verdict.rollback`), autotune (on request), convert to half
    precision (on request, :mod:`normexport.precision`), publish, parity, latency (on
    request). Works from
    files: an ONNX input is read lazily (its external data stays on disk until a pass needs
    it), the raw export and every intermediate model live in a scratch folder
    beside the output, the checker and every ONNX Runtime session open files by path, and the
    output is written with its own external data file (``OUT.onnx.data``) when the input had one
    or the model is large (:func:`normexport.io.files.wants_external_data`); no model is ever one
    protobuf in memory (the float16 converter alone takes one, and refuses models over 2 GiB).
    The optimized model is written even when parity fails;
    ``report.parity.passed`` says whether it did.

    Raises:
        UsageError: a user mistake: unreadable or invalid file, missing or bad option, an
            output path that would overwrite the input.
    """
    output, writes = plan_outputs(opts)
    provider, provider_note = runtime.resolve_provider(opts.provider)
    job = _start(opts, output, writes, (provider, provider_note), prepare(opts))
    with files.work_folder(output) as work:
        _reference(job, work)
        _optimize(job, work)
        if opts.autotune:
            _autotune(job)
        if opts.precision != "fp32":
            _half(job, work)
        _publish(job)
        parity = _parity(job, work)
        if opts.precision != "fp32" and precision_mod.OVERFLOW_PROBE not in job.sets:
            _hidden_probe(job, parity, work)
        latency = _latency(job) if opts.benchmark else None
    return _report(job, parity, latency)


def plan_outputs(opts: Options) -> tuple[Path, dict[str, list[Path]]]:
    """The output path, and every file the run writes by the option that names it, checked
    before any work: each writable, none on the input, none written twice.

    Raises:
        UsageError: see :func:`normexport.io.files.check_writable` and :func:`refuse_overwriting`.
    """
    if opts.output is None and opts.module is not None:
        raise UsageError("an in-memory module has no file to write beside: give output=PATH")
    output = Path(opts.output) if opts.output else default_output(Path(opts.model))
    writes = {"-o": [output, files.data_path(output)]}
    if opts.report is not None:
        writes["--report"] = [Path(opts.report), Path(opts.report).with_suffix(".png")]
    for flag, paths in writes.items():
        for path in paths:
            files.check_writable(path, flag, given=flag != "-o" or opts.output is not None)
    if opts.module is None:
        refuse_overwriting([Path(opts.model)], writes)  # before the export (minutes)
    return output, writes


def _start(opts, output, writes, provider, prepared: Prepared) -> _Job:
    """The job's state after :func:`prepare`: input files checked against the outputs, feed
    names, the input sets for parity, what the raw model holds."""
    loaded, example, raw, export = prepared
    refuse_overwriting(input_files(loaded), writes)
    feed_names = [v.name for v in raw.graph.inputs if not v.is_initializer()]
    sets = inputs_mod.input_sets(
        _by_feed_name(example, feed_names), id_ranges=inputs_mod.id_ranges(raw)
    )
    if opts.precision != "fp32":
        sets |= precision_mod.overflow_set(sets["example"])
    return _Job(
        opts,
        output,
        *provider,
        loaded,
        example,
        export,
        raw,
        feed_names,
        sets,
        ops_before=fusion.norm_ops(raw),
        already=explain.already_fused(raw),
        external=files.wants_external_data(raw),
    )


def _reference(job: _Job, work: Path) -> None:
    """The model the output is compared with, on file: for ONNX input the input itself (loaded
    as written, run once, checked), else the raw export saved into ``work``."""
    if job.loaded.kind == "onnx":
        path = Path(job.opts.model)
        job.raw_path = path
        job.reference_session = _input_session(path, job.provider)
        _runs_as_given(job.reference_session, job.sets["example"], path, job.opts)
        job.input_checker = _checker_level(path)
    else:
        job.raw_path = work / "raw.onnx"
        files.save_model(job.raw, job.raw_path, external_data=True)


def _optimize(job: _Job, work: Path) -> None:
    """Run the passes on the raw model in place (it lives on in ``raw_path``), stage the result
    in ``work``, check it (:func:`normexport.verdict.rollback.check`) and, where it fails, put the
    model without the rewrites responsible in its place
    (:func:`normexport.verdict.rollback.roll_back`); the undone rewrites join the fusion report's
    refusals.

    Raises:
        normexport.verdict.rollback.RollbackFailed: the model fails its check with no rewrite at
        all.
    """
    opts = job.opts
    skip = variants.skip_fusion(opts.target, job.provider)
    job.fusions = fusion.optimize(job.raw, target=opts.target, skip=skip)
    job.staged = work / job.output.name
    files.save_model(job.raw, job.staged, external_data=job.external)
    job.raw = None
    builds = itertools.count(1)

    def build(excluded):
        model = ir.load(job.raw_path)
        report = fusion.optimize(model, target=opts.target, skip=skip, exclude=excluded)
        path = work / f"rollback-{next(builds)}" / job.output.name
        path.parent.mkdir()
        files.save_model(model, path, external_data=job.external)
        return path, report

    verdicts: dict[Path, ParityResult] = {}

    def check(path):
        level, judge = job.input_checker[0], functools.partial(_check, job, work)
        rejection, verdicts[path] = rollback_mod.check(path, job.provider, level, judge)
        return rejection

    outcome = rollback_mod.roll_back(job.staged, job.fusions, build, check)
    if outcome.undone:
        _move_onto(outcome.path, job.staged)
        job.fusions = outcome.report
        job.fusions.extend(rollback_mod.refusals(outcome.undone))
    if outcome.undone or outcome.unexplained:
        job.rollback = outcome
    job.verified = verdicts.get(outcome.path)
    level, problem = job.input_checker
    if level == "none":  # not checked as the input was: the levels the output passes
        job.checker = _check_output(job.staged, level, problem)
    else:  # rollback.check has checked it at the input's level
        job.checker = Checker(level, problem, level)


def _half(job: _Job, work: Path) -> None:
    """Convert the staged model to float16 or bfloat16 (:func:`normexport.precision.to_half`),
    the norms the fusions refused kept in float32, and put it in the staged model's place,
    checked."""
    half = work / "half" / job.staged.name
    half.parent.mkdir()
    job.precision = precision_mod.to_half(
        job.staged,
        half,
        precision=job.opts.precision,
        provider=job.provider,
        keep_io_types=job.opts.keep_io_types,
        refused=job.fusions.refused,
        external_data=job.external,
    )
    _move_onto(half, job.staged)
    job.verified = None
    job.checker = _check_output(job.staged, *job.input_checker)


def _publish(job: _Job) -> None:
    """Move the staged model onto the output; from here on it is read from its file."""
    job.raw = None
    job.written = files.publish_model(job.staged, job.output)


def _report(job: _Job, parity: ParityResult, latency: Latency | None) -> Report:
    """The typed report of a finished job."""
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
        files_written=list(job.written),
        inputs={k: InputInfo(list(v.shape), str(v.dtype)) for k, v in job.example.items()},
        fusions=Fusions.from_fusion_report(job.fusions, job.already),
        norm_ops=NormOps(job.ops_before, fusion.norm_ops(optimized)),
        onnxruntime_ops=fusion.onnxruntime_ops(optimized),
        checker=job.checker,
        parity=parity,
        provider=runtime.PROVIDERS[job.provider][0],
        provider_note=job.provider_note,
        notes=list(job.loaded.notes),
        latency=latency,
        autotune=job.tuned,
        precision=job.precision,
        versions=Versions(torch.__version__, onnx.__version__, onnxruntime.__version__),
        rollback=job.rollback,
    )


def refuse_overwriting(inputs: list[Path], outputs: dict[str, list[Path]]) -> None:
    """Refuse a run whose output files would land on its input files, or on each other.

    Paths are compared after resolving (symbolic links, ``..``, a folder not made yet), so
    ``-o new_dir/../m.onnx`` is caught as ``m.onnx``.

    Args:
        inputs: the files read (the model and its external data files).
        outputs: the option that names them (``-o``, ``--report``) -> the files it writes.

    Raises:
        UsageError: an output is an input file, or two options write the same file.
    """
    read = {Path(os.path.realpath(p)): p for p in inputs}
    seen: dict[Path, str] = {}
    for flag, paths in outputs.items():
        for path in paths:
            real = Path(os.path.realpath(path))
            if real in read:
                raise UsageError(
                    f"{flag} {path} would overwrite the input file {read[real]}; normexport "
                    "never overwrites its input: choose another output path"
                )
            if real in seen and seen[real] != flag:
                raise UsageError(f"{flag} {path} is also written by {seen[real]}: choose another")
            seen[real] = flag


def input_files(loaded: LoadedModel) -> list[Path]:
    """The model file and, for ONNX, the external data files its tensors live in."""
    found = [Path(loaded.path)]
    if loaded.onnx_model is not None:
        for graph in loaded.onnx_model.graphs():
            for value in graph.initializers.values():
                tensor = value.const_value
                if isinstance(tensor, ir.ExternalTensor):
                    found.append(Path(tensor.base_dir) / tensor.location)
    return list(dict.fromkeys(found))


def _input_session(path: Path, provider: str):
    """The parity reference for an ONNX input: the file as given, run with ONNX Runtime's
    graph optimizations off. A file ONNX Runtime cannot load is the user's to fix.

    Raises:
        UsageError: ONNX Runtime cannot load ``path``.
    """
    try:
        return runtime.make_session(
            path, provider, optimization_level=runtime.AS_WRITTEN, spinning=False
        )
    except runtime.ProviderUnavailable:
        raise
    except Exception as err:  # ORT raises its own error types for a bad file
        raise UsageError(
            f"{path}: ONNX Runtime cannot load this model ({one_line(err)}); normexport "
            "optimizes models that ONNX Runtime runs: fix or re-export it"
        ) from None


def _runs_as_given(session, feeds: dict[str, np.ndarray], path: Path, opts: Options) -> None:
    """Run the input file once on the example inputs, before anything is optimized: a model
    that ONNX Runtime loads but cannot run (an invalid node, inputs of the wrong shape) is the
    user's to fix, not a parity failure.

    Raises:
        UsageError: ONNX Runtime fails on it, naming the inputs that were given.
    """
    try:
        runtime.run(session, feeds, quiet=True)  # the failure is reported once, by us
    except Exception as err:  # ORT's own error types
        given = " ".join(f"{k}={'x'.join(map(str, v.shape))}:{v.dtype}" for k, v in feeds.items())
        hint = (
            "check --input-shape / --inputs against the model's inputs"
            if opts.input_shape or opts.inputs
            else "fix or re-export it"
        )
        raise UsageError(
            f"{path}: ONNX Runtime cannot run this model as given on inputs {given} "
            f"({one_line(err)}); {hint}"
        ) from None


def _checker_level(path: Path) -> tuple[str, str | None]:
    """How far the ONNX checker accepts the input file: ``"full"`` (with shape inference),
    ``"basic"`` or ``"none"``, and its complaint at the first level it fails (None)."""
    problem = None
    for level, full in (("full", True), ("basic", False)):
        try:
            fusion.check(path, full_check=full)
            return level, problem
        except Exception as err:  # ValidationError, InferenceError: the checker's verdict
            problem = problem or one_line(err)
    return "none", problem


def _check_output(path: Path, input_level: str, input_problem: str | None) -> Checker:
    """Check the output file at the level the input passed.

    An output that fails a level its input passed is normexport's bug (the error propagates:
    exit 3). Where the input already fails the checker (old exporters' files: nodes out of
    order, initializers not listed as inputs at IR version 3, ONNX Runtime's own ops), the
    output is checked fully anyway and the report says what each got; ONNX Runtime loading it
    is then the test.

    Returns:
        The levels each got, with the checker's complaints.
    """
    if input_level != "none":
        fusion.check(path, full_check=input_level == "full")
        return Checker(input_level, input_problem, input_level)
    return Checker("none", input_problem, *_checker_level(path))


def _autotune(job: _Job) -> None:
    """Time the exact alternatives of the staged output (and, where attention was fused, of the
    model without it) and put the fastest in the staged model's place; the job's fusion report
    becomes that of the model kept."""
    opts, staged = job.opts, job.staged
    unfused_path = unfused_fusions = None
    if job.fusions.counts["attention_fused"]:  # fused attention is a speed choice per shape
        unfused = ir.load(job.raw_path)
        skip = variants.skip_fusion(opts.target, job.provider)
        unfused_fusions = fusion.optimize(unfused, target=opts.target, skip=skip, attention=False)
        unfused_path = staged.with_name(autotune.ATTENTION_UNFUSED + ".onnx")
        files.save_model(unfused, unfused_path, external_data=True)
    tuned = autotune.autotune(
        autotune.candidates(staged, target=opts.target, attention_unfused=unfused_path),
        job.sets["example"],
        job.provider,
        budget_s=opts.budget_s / 2,
        atol=opts.atol,
        rtol=opts.rtol,
    )
    if tuned.best != tuned.default:
        _replace_staged(staged, ir.load(tuned.model), job.external)
        job.verified = None
    if tuned.best.startswith(autotune.ATTENTION_UNFUSED):
        job.fusions = unfused_fusions
    job.tuned = tuned


def _replace_staged(staged: Path, chosen: ir.Model, external: bool) -> None:
    """Write ``chosen`` in the staged model's place (and its external data file's)."""
    kept = staged.with_name("tuned") / staged.name
    kept.parent.mkdir()
    files.save_model(chosen, kept, external_data=external)
    fusion.check(kept, full_check=False)
    _move_onto(kept, staged)


def _move_onto(source: Path, staged: Path) -> None:
    """Move the model at ``source`` (and its external data file, named after it) onto
    ``staged``: both have the same file name, so the data file's name in the model holds."""
    for path in (staged, files.data_path(staged)):
        path.unlink(missing_ok=True)
    os.replace(source, staged)
    if files.data_path(source).exists():
        os.replace(files.data_path(source), files.data_path(staged))


def _parity(job: _Job, work: Path) -> ParityResult:
    """The parity verdict of the optimized model against the oracle (see
    :mod:`normexport.verdict.parity` and :mod:`normexport.verdict.oracle`), with the raw model (the
    raw export, or the input file as written) and PyTorch float32 compared with it too. Every ONNX
    model runs with ONNX Runtime's graph optimizations off, so that its own rewrites are not part of
    the comparison. Its ``raw_worst()`` is the raw model's worst error against the oracle over
    all input sets (None where no float64 oracle could be built for ONNX input).

    A float32 model that is still the one :func:`normexport.verdict.rollback.check` judged keeps
    that verdict (its runs are not repeated); autotune's choice or a half-precision model is judged
    anew.
    """
    if job.verified is not None:
        return dataclasses.replace(job.verified, strict=job.opts.strict)
    opt_session = runtime.make_session(
        job.output,
        job.provider,
        optimization_level=runtime.AS_WRITTEN,
        spinning=False,
        disabled_optimizers=job.disabled,
    )

    def candidate(feeds):
        return runtime.run(opt_session, precision_mod.cast_feeds(opt_session, feeds))

    names = [o.name for o in opt_session.get_outputs()]
    return _check(job, work, candidate, names, precision=job.opts.precision)


def _check(
    job: _Job, work: Path, candidate, output_names: list[str], precision: str = "fp32"
) -> ParityResult:
    """:func:`normexport.verdict.parity.check_parity` of ``candidate`` against the job's references
    (:func:`_references`, built once), by the rule for ``precision``.

    Raises:
        ValueError: the candidate returns other outputs (count or shapes) than the references.
    """
    if job.references is None:
        job.references = _references(job, work)
    return check_parity(
        candidate,
        sets=job.sets,
        output_names=output_names,
        atol=job.opts.atol,
        rtol=job.opts.rtol,
        max_rel_l2=parity_mod.HALF_MAX_REL_L2.get(precision),
        strict=job.opts.strict,
        **(job.references | _rounding(precision)),
    )


def _rounding(precision: str) -> dict:
    """The half-precision parity rule's input rounding for ``precision`` as
    :func:`check_parity`'s ``round_inputs`` (fp32: none; the references' own, the float32
    rule's one-ulp move, stands)."""
    if precision == "fp32":
        return {}
    return {"round_inputs": functools.partial(precision_mod.rounded_feeds, precision=precision)}


def _hidden_probe(job: _Job, parity: ParityResult, work: Path) -> None:
    """Add the hidden-state overflow probe (:mod:`normexport.verdict.hidden_probe`) to ``parity``,
    for a model without float inputs, where it has embedding lookups."""
    found = hidden_probe.check(
        job.raw_path,
        job.output,
        job.sets["example"],
        work / "hidden_probe",
        provider=job.provider,
        precision=job.opts.precision,
        atol=job.opts.atol,
        rtol=job.opts.rtol,
    )
    if found is not None:
        parity.add(found)


def _references(job: _Job, work: Path) -> dict:
    """:func:`check_parity`'s reference arguments: the oracle (``reference``), the raw model
    where it is not the oracle itself, PyTorch float32 where it is not, the notes, and which
    float32 run the export check judges (``judge_export``; None for ONNX input). Each model is
    run once per input set however many candidates are compared with it
    (:func:`normexport.verdict.parity.remembered`), the oracle on inputs moved by one ulp too (the
    float32 rule's ``round_inputs``, :func:`normexport.verdict.parity.ulp_perturbed`)."""
    raw_session = job.reference_session or runtime.make_session(
        job.raw_path, job.provider, optimization_level=runtime.AS_WRITTEN, spinning=False
    )

    def raw(feeds):
        return runtime.run(raw_session, feeds)

    raw = parity_mod.remembered(raw)
    if job.loaded.module is None:
        found = oracle_mod.onnx_float64(
            job.raw_path, raw, job.sets["example"], work, "the input graph"
        )
        if found.run is None:  # compared with the input file itself, tolerance only
            notes = [*found.notes, "the reference is the input file as written, in float32"]
            return dict(reference=raw, reference_kind="onnx", oracle_kind="onnx", notes=notes)
        return {
            "reference": parity_mod.remembered(found.run),
            "reference_kind": "onnx",
            "raw": raw,
            "oracle_kind": found.kind,
            "notes": found.notes,
            "round_inputs": parity_mod.remembered(parity_mod.ulp_perturbed),
        }
    eager = Eager(job.loaded.module)

    def pytorch(feeds):
        return eager([feeds[name] for name in job.feed_names])

    pytorch = parity_mod.remembered(pytorch)
    found = _pytorch_oracle(job, raw, work)
    return {
        "reference": parity_mod.remembered(found.run) if found.run else pytorch,
        "reference_kind": "pytorch",
        "raw": raw,
        "pytorch": pytorch if found.run else None,
        "oracle_kind": found.kind,
        "notes": found.notes,
        # the oracle from the raw export judges PyTorch float32, any other the raw export
        "judge_export": "pytorch" if found.kind.startswith("onnx") else "raw",
        "round_inputs": parity_mod.remembered(parity_mod.ulp_perturbed),
    }


def _pytorch_oracle(job: _Job, raw, work: Path) -> oracle_mod.Oracle:
    """The PyTorch model in float64; where that cannot run, the raw export in float64; where
    neither can, None (PyTorch float32 is the reference), with every reason in the notes."""
    example = job.sets["example"]
    found = oracle_mod.pytorch_float64(job.loaded, example, job.feed_names)
    if found.run is not None:
        return found
    export = oracle_mod.onnx_float64(job.raw_path, raw, example, work, "the raw export")
    notes = [*found.notes, *export.notes]
    if export.run is None:
        notes.append("the reference is PyTorch float32")
        return oracle_mod.Oracle(None, "pytorch_float32", notes)
    return oracle_mod.Oracle(export.run, export.kind, notes)


def latency_threads() -> int:
    """The thread count PyTorch and ONNX Runtime both get when timed: the cores this process
    may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _latency(job: _Job) -> Latency:
    """PyTorch eager (where there is a module), the raw export and the optimized model on the
    example inputs, timed interleaved in ORT_ENABLE_ALL sessions (what a deployment runs); ms.
    PyTorch and ONNX Runtime get the same number of threads (:func:`latency_threads`): each with
    its default beside the other's pool oversubscribes the cores and times the contention."""
    threads = latency_threads()
    feeds, provider = job.sets["example"], job.provider
    # Spinning off: these sessions are timed interleaved with each other and with PyTorch.
    raw_session = runtime.make_session(job.raw_path, provider, spinning=False, threads=threads)
    opt_session = runtime.make_session(
        job.output, provider, spinning=False, disabled_optimizers=job.disabled, threads=threads
    )
    opt_feeds = precision_mod.cast_feeds(opt_session, feeds)
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


def prepare(opts: Options) -> Prepared:
    """Load the model (or take ``opts.module``), settle its example inputs, export it (or take
    the ONNX as it is).

    Returns:
        ``(loaded, example inputs by name, ONNX model before normexport's passes, export)``;
        ``export.exporter`` is ``"dynamo"``, ``"torchscript"`` or ``"none"`` for ONNX input.

    Raises:
        UsageError: see :func:`run`.
    """
    check_options(opts)
    if opts.module is not None:
        loaded = LoadedModel(Path(opts.model), "nn_module", module=opts.module)
    else:
        loaded = load_model(
            opts.model,
            trust_pickle=opts.trust_pickle,
            model_class=opts.model_class,
            model_kwargs=opts.model_kwargs,
        )
    if loaded.kind == "onnx":
        _require_external_data(loaded)
    example = _example_inputs(loaded, opts)
    raw, export = _raw_onnx(loaded, example, opts)
    return Prepared(loaded, example, raw, export)


def _require_external_data(loaded: LoadedModel) -> None:
    """Check that every external data file an ONNX input names is there, and big enough.

    Raises:
        UsageError: one is missing or shorter than a tensor in it says.
    """
    needed: dict[Path, list[str]] = {}
    for graph in loaded.onnx_model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                end = tensor.offset + (tensor.length or tensor.nbytes)
                path = Path(tensor.base_dir) / tensor.location
                if not path.is_file() or path.stat().st_size < end:
                    needed.setdefault(path, []).append(value.name)
    for path, names in needed.items():
        what = "is missing" if not path.exists() else "is shorter than its tensors say"
        raise UsageError(
            f"{loaded.path}: its external data file {path} {what} (tensors "
            f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); keep the data file "
            "that was written with the model beside it, under the name the model gives"
        )


def _example_inputs(loaded: LoadedModel, opts: Options) -> dict[str, np.ndarray]:
    """Example inputs by name: from ``--inputs``, ``--input-shape``, the file, or the graph."""
    specs = [inputs_mod.parse_input_shape(s) for s in opts.input_shape]
    if opts.inputs is not None:
        try:
            with np.load(opts.inputs) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError) as err:
            raise UsageError(f"--inputs {opts.inputs}: cannot read it as .npz ({err})") from None
        model = loaded.onnx_model if loaded.kind == "onnx" else loaded.module
        expected = inputs_mod.declared_dtypes(model, arrays)
        return inputs_mod.conform(arrays, expected, f"--inputs {opts.inputs}")
    rng = np.random.default_rng(0)
    if loaded.kind == "onnx":
        specs = inputs_mod.onnx_input_specs(loaded.onnx_model, specs, str(loaded.path))
    elif not specs and loaded.example_inputs is not None:
        return dict(loaded.example_inputs)
    elif not specs:
        raise UsageError(
            f"cannot guess the inputs of {loaded.path} ({loaded.kind.replace('_', ' ')}): add "
            "--input-shape for each input, e.g. --input-shape 1,3,224,224 or "
            "--input-shape input_ids=2x16:int64 (or --inputs FILE.npz)"
        )
    names = [s.name or (f"input_{i}" if len(specs) > 1 else "input") for i, s in enumerate(specs)]
    inputs_mod.check_size(specs, names)
    return {
        name: inputs_mod.random_array(dataclasses.replace(s, name=name), rng)
        for name, s in zip(names, specs, strict=True)
    }


def _raw_onnx(
    loaded: LoadedModel, example: dict[str, np.ndarray], opts: Options
) -> tuple[ir.Model, ExportInfo]:
    """The model before normexport's passes, and which exporter made it ("none" for ONNX)."""
    if loaded.kind == "onnx":
        for flag, value in (("--opset", opts.opset), ("--dynamic", opts.dynamic)):
            if value:
                raise UsageError(f"{flag} applies to PyTorch models; {loaded.path} is ONNX already")
        return loaded.onnx_model, ExportInfo("none")
    names = list(example)
    args = [torch.from_numpy(a) for a in example.values()]
    try:
        exported = export_module(
            loaded.module,
            args,
            opset=opts.opset,
            input_names=names,
            dynamic_axes=dynamic_axes(opts.dynamic, names),
            exporter=opts.exporter,
        )
    except ExportError as err:
        raise UsageError(f"{loaded.path}: could not export to ONNX: {err}") from None
    _check_export(exported, loaded, opts)
    info = ExportInfo(exported.exporter, exported.fallback_reason, exported.warnings)
    return exported.model, info


def _check_export(exported, loaded: LoadedModel, opts: Options) -> None:
    """Refuse an export that cannot be what the user asked for: a graph with no outputs
    (``forward`` returned no tensor), or an opset other than ``--opset``.

    Raises:
        UsageError: naming the file or the option.
    """
    if not exported.model.graph.outputs:
        raise InputFileError(
            f"{loaded.path}: the model's forward() returns no tensor, so its ONNX graph has no "
            "outputs: return the tensor(s) the model computes"
        )
    got = opset_version(exported.model)
    if opts.opset is not None and got != opts.opset:
        raise UsageError(
            f"--opset {opts.opset}: the {exported.exporter} exporter cannot export at that "
            f"opset (it wrote opset {got}); choose another --opset, or another --exporter"
        )


def _by_feed_name(example: dict[str, np.ndarray], feed_names: list[str]) -> dict:
    """Example arrays keyed by the ONNX graph's input names (by name, else by position)."""
    if set(feed_names) <= set(example):
        return {name: example[name] for name in feed_names}
    if len(feed_names) != len(example):
        raise UsageError(
            f"the exported graph has inputs {feed_names} but {len(example)} example inputs "
            f"({list(example)}) were given"
        )
    return dict(zip(feed_names, example.values(), strict=True))
