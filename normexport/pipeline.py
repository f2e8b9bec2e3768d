"""The main job: load, export, optimize, prove parity, time, write model and report."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch

import fusion
from fusion._ir import opset_version
from normexport import autotune, explain, files, runtime, variants
from normexport import inputs as inputs_mod
from normexport.errors import InputFileError, UsageError, one_line
from normexport.export import ExportError, export_module
from normexport.latency import BUSY_SPREAD, time_interleaved
from normexport.load import LoadedModel, load_model
from normexport.parity import DEFAULT_ATOL, DEFAULT_RTOL, check_parity

#: ONNX Runtime's graph optimizations off: the model runs as written (parity verdicts).
AS_WRITTEN = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL


@dataclasses.dataclass
class Options:
    """What the user asked for; the CLI flags of the same names fill it.

    Attributes:
        model: the model file.
        output: where to write the optimized model (default: MODEL stem + ``.opt.onnx``).
        report: where the caller will write the JSON report (and ``.png`` chart beside it), or
            None; checked up front so that no output lands on the input or on another.
        input_shape: ``--input-shape`` specs, see :mod:`normexport.inputs`.
        inputs: an ``.npz`` file of example inputs by name (real data), or None.
        dynamic: ``--dynamic`` axes, e.g. ``batch``, ``batch,sequence`` or ``x:0,2``.
        opset: ai.onnx opset to export at (None: the exporter's default).
        target: ``ort`` or ``onnx`` (see :data:`fusion.TARGETS`).
        provider: ``auto``, ``cpu`` or ``cuda``.
        benchmark: time the variants.
        atol, rtol: parity tolerances (see :mod:`normexport.parity`).
        budget_s: seconds of timed runs to aim for.
        autotune: time the exact alternative forms of the optimized model (and the ORT
            session settings they need; where attention was fused, also the model without
            it) on ``provider`` and keep the fastest.
    """

    model: Path
    output: Path | None = None
    report: Path | None = None
    input_shape: list[str] = dataclasses.field(default_factory=list)
    inputs: Path | None = None
    dynamic: str | None = None
    opset: int | None = None
    target: str = "ort"
    provider: str = "auto"
    benchmark: bool = True
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    trust_pickle: bool = False
    model_class: str | None = None
    model_kwargs: str | None = None
    exporter: str = "auto"
    budget_s: float = 10.0
    autotune: bool = False


def default_output(model_path: Path) -> Path:
    """``dir/name.pt`` -> ``dir/name.opt.onnx``: the last suffix is replaced, so
    ``ch_ppocr_mobile_v2.0_cls_infer.onnx`` -> ``ch_ppocr_mobile_v2.0_cls_infer.opt.onnx``."""
    return model_path.with_name(model_path.stem + ".opt.onnx")


def run(opts: Options) -> dict:
    """Run the main job and return the report (see README, "The report").

    Works from files: an ONNX input is read lazily (its external data stays on disk until a
    pass needs it), the raw export and every intermediate model live in a scratch folder beside
    the output, the checker and every ONNX Runtime session open files by path, and the output
    is written with its own external data file (``OUT.onnx.data``) when the input had one or
    the model is large (:func:`normexport.files.wants_external_data`); no model is ever one
    protobuf in memory. The optimized model is written even when parity fails;
    ``report["parity"]["passed"]`` says whether it did.

    Raises:
        UsageError: a user mistake: unreadable or invalid file, missing or bad option, an
            output path that would overwrite the input.
    """
    model_path = Path(opts.model)
    output = Path(opts.output) if opts.output else default_output(model_path)
    writes = {"-o": [output, files.data_path(output)]}
    if opts.report is not None:
        writes["--report"] = [Path(opts.report), Path(opts.report).with_suffix(".png")]
    for flag, paths in writes.items():
        for path in paths:
            files.check_writable(path, flag)
    refuse_overwriting([model_path], writes)  # before the export, which can take minutes
    provider, provider_note = runtime.resolve_provider(opts.provider)
    loaded, example, raw, exporter = prepare(opts)
    refuse_overwriting(input_files(loaded), writes)
    ops_before = fusion.norm_ops(raw)
    already = explain.already_fused(raw)
    external = files.wants_external_data(raw)
    feed_names = [v.name for v in raw.graph.inputs if not v.is_initializer()]
    sets = inputs_mod.input_sets(
        _by_feed_name(example, feed_names), id_ranges=inputs_mod.id_ranges(raw)
    )
    with files.work_folder(output) as work:
        if loaded.kind == "onnx":
            raw_path = model_path
            reference_session = _input_session(model_path, provider)
            _runs_as_given(reference_session, sets["example"], model_path, opts)
            input_level, input_problem = _checker_level(model_path)
        else:
            raw_path = work / "raw.onnx"
            files.save_model(raw, raw_path, external_data=True)
            reference_session, input_level, input_problem = None, "full", None
        optimized = raw  # optimized in place; the raw model lives on in raw_path
        skip = variants.skip_fusion(opts.target, provider)
        fusions = fusion.optimize(optimized, target=opts.target, skip=skip)
        staged = work / output.name
        files.save_model(optimized, staged, external_data=external)
        checker = _check_output(staged, input_level, input_problem)
        tuned = None
        if opts.autotune:
            tuned, fusions = _autotune(opts, raw_path, staged, fusions, sets, provider, external)
        del optimized, raw  # the output is read from its file from here on
        written = files.publish_model(staged, output)
        disabled = tuned.disabled_optimizers if tuned else ()
        parity = _parity(
            loaded, sets, feed_names, raw_path, output, reference_session, provider, disabled, opts
        )
        latency = None
        if opts.benchmark:
            latency = _latency(
                loaded, sets["example"], feed_names, raw_path, output, provider, disabled, opts
            )
    optimized = ir.load(output)
    return {
        "model": str(opts.model),
        "kind": loaded.kind,
        "exporter": exporter,
        "opset": opset_version(optimized),
        "target": opts.target,
        "output": str(output),
        "files_written": [str(p) for p in written],
        "external_data": len(written) > 1,
        "inputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in example.items()},
        "fusions": fusions.to_dict(fusion.FUSION_KINDS) | {"already_fused": already},
        "norm_ops": {"before": ops_before, "after": fusion.norm_ops(optimized)},
        "checker": checker,
        "parity": parity,
        "provider": runtime.PROVIDERS[provider][0],
        "provider_note": provider_note,
        "notes": loaded.notes,
        "latency_ms": latency,
        "latency_conditions": latency_conditions(latency),
        "autotune": tuned.to_dict() if tuned else None,
        "versions": {
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
    }


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
        return runtime.make_session(path, provider, optimization_level=AS_WRITTEN, spinning=False)
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
    quiet = onnxruntime.RunOptions()
    quiet.log_severity_level = 4  # the failure is reported once, by us
    try:
        session.run(None, dict(feeds), quiet)
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


def _check_output(path: Path, input_level: str, input_problem: str | None) -> dict:
    """Check the output file at the level the input passed.

    An output that fails a level its input passed is normexport's bug (the error propagates:
    exit 3). Where the input already fails the checker (old exporters' files: nodes out of
    order, initializers not listed as inputs at IR version 3, ONNX Runtime's own ops), the
    output is checked fully anyway and the report says what each got; ONNX Runtime loading it
    is then the test.

    Returns:
        ``{"input": level, "input_problem", "output": level, "output_problem"}``.
    """
    if input_level != "none":
        fusion.check(path, full_check=input_level == "full")
        return {"input": input_level, "input_problem": input_problem, "output": input_level}
    output_level, output_problem = _checker_level(path)
    return {
        "input": "none",
        "input_problem": input_problem,
        "output": output_level,
        "output_problem": output_problem,
    }


def _autotune(opts, raw_path, staged, fusions, sets, provider, external):
    """Time the exact alternatives of the staged output (and, where attention was fused, of the
    model without it) and put the fastest in ``staged``'s place.

    Returns:
        ``(AutotuneResult, the fusion report of the model kept)``.
    """
    unfused_path = None
    unfused_fusions = None
    if fusions.counts["attention_fused"]:  # fused attention is a speed choice per shape
        unfused = ir.load(raw_path)
        unfused_fusions = fusion.optimize(
            unfused,
            target=opts.target,
            skip=variants.skip_fusion(opts.target, provider),
            attention=False,
        )
        unfused_path = staged.with_name(autotune.ATTENTION_UNFUSED + ".onnx")
        files.save_model(unfused, unfused_path, external_data=True)
    tuned = autotune.autotune(
        autotune.candidates(staged, target=opts.target, attention_unfused=unfused_path),
        sets["example"],
        provider,
        budget_s=opts.budget_s / 2,
        atol=opts.atol,
        rtol=opts.rtol,
    )
    if tuned.best != tuned.default:
        chosen = ir.load(tuned.model)
        kept = staged.with_name("tuned") / staged.name
        kept.parent.mkdir()
        files.save_model(chosen, kept, external_data=external)
        fusion.check(kept, full_check=False)
        for path in (staged, files.data_path(staged)):
            path.unlink(missing_ok=True)
        os.replace(kept, staged)
        if files.data_path(kept).exists():
            os.replace(files.data_path(kept), files.data_path(staged))
    if tuned.best.startswith(autotune.ATTENTION_UNFUSED):
        fusions = unfused_fusions
    return tuned, fusions


def _parity(
    loaded, sets, feed_names, raw_path, output, reference_session, provider, disabled, opts
):
    """The parity verdict of the optimized model against the oracle (see
    :mod:`normexport.parity`): the PyTorch model in float64 (or, for ONNX input, the input file),
    with the raw export (or the input file) and PyTorch float32 compared with it too. Both ONNX
    models run with ONNX Runtime's graph optimizations off, so that its own rewrites are not
    part of the comparison.

    Returns:
        :meth:`normexport.parity.ParityResult.to_dict`; its ``raw_export_max_abs_err`` is the
        raw export's worst error against the oracle over all input sets (None for ONNX input
        compared with itself).
    """
    opt_session = runtime.make_session(
        output,
        provider,
        optimization_level=AS_WRITTEN,
        spinning=False,
        disabled_optimizers=disabled,
    )

    def candidate(feeds):
        return runtime.run(opt_session, feeds)

    output_names = [o.name for o in opt_session.get_outputs()]
    common = {"atol": opts.atol, "rtol": opts.rtol}
    if loaded.module is None:
        result = check_parity(
            candidate,
            lambda feeds: runtime.run(reference_session, feeds),
            sets,
            output_names,
            reference_kind="onnx",
            oracle_kind="onnx",
            **common,
        )
        return result.to_dict()
    eager = _eager(loaded)

    def pytorch(feeds):
        return eager([feeds[name] for name in feed_names])

    oracle, oracle_kind, notes = _float64_oracle(loaded, sets["example"], feed_names)
    raw_session = runtime.make_session(
        raw_path, provider, optimization_level=AS_WRITTEN, spinning=False
    )
    result = check_parity(
        candidate,
        oracle or pytorch,
        sets,
        output_names,
        reference_kind="pytorch",
        raw=lambda feeds: runtime.run(raw_session, feeds),
        pytorch=pytorch if oracle else None,
        oracle_kind=oracle_kind,
        notes=notes,
        **common,
    )
    return result.to_dict()


def _float64_oracle(loaded: LoadedModel, example: dict, feed_names: list[str]):
    """The PyTorch model run in float64 (a deep copy, ``.double()``; float inputs cast,
    integer inputs as they are), tried on the example first.

    The copy holds the model's floating-point weights again at twice their float32 size; where
    that would take more than a quarter of this machine's memory
    (:data:`ORACLE_MEMORY_SHARE`), no copy is made.

    Returns:
        ``(feeds -> outputs, "pytorch_float64", [])``, or ``(None, "pytorch_float32", [why])``
        where no float64 copy could be made or run, would not fit, or its outputs are not
        float64 (a forward that casts to float32 itself).
    """
    needed, memory = _float64_copy_bytes(loaded), inputs_mod.memory_bytes()
    if memory is not None and needed > memory * ORACLE_MEMORY_SHARE:
        why = (
            f"a float64 copy of the model would take {needed / 2**30:.1f} GiB, over "
            f"{ORACLE_MEMORY_SHARE:.0%} of this machine's {memory / 2**30:.1f} GiB"
        )
        return None, "pytorch_float32", [why + "; the reference is PyTorch float32"]
    try:
        eager = _eager(loaded, float64=True)

        def oracle(feeds):
            return eager([feeds[name] for name in feed_names])

        outs = oracle(example)
    except Exception as err:  # whatever a model's float64 copy raises: fall back, and say so
        why = f"a float64 copy of the model could not be run ({one_line(err)})"
        return None, "pytorch_float32", [why + "; the reference is PyTorch float32"]
    narrow = [str(o.dtype) for o in outs if o.dtype.kind == "f" and o.dtype != np.float64]
    if narrow:
        why = f"the float64 copy of the model returns {', '.join(sorted(set(narrow)))} outputs"
        return None, "pytorch_float32", [why + "; the reference is PyTorch float32"]
    return oracle, "pytorch_float64", []


#: The largest share of physical memory the float64 oracle's copy of the model may take.
ORACLE_MEMORY_SHARE = 0.25


def _float64_copy_bytes(loaded: LoadedModel) -> int:
    """Bytes a float64 copy of the model's floating-point parameters and buffers takes."""
    module = loaded.module
    if isinstance(module, torch.export.ExportedProgram):
        tensors = [*module.state_dict.values(), *module.constants.values()]
    else:
        tensors = [*module.parameters(), *module.buffers()]
    return sum(
        8 * t.numel() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def latency_threads() -> int:
    """The thread count PyTorch and ONNX Runtime both get when timed: the cores this process
    may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _latency(loaded, feeds, feed_names, raw_path, output, provider, disabled, opts) -> dict:
    """PyTorch eager (where there is a module), the raw export and the optimized model, timed
    interleaved in ORT_ENABLE_ALL sessions (what a deployment runs); ms. PyTorch and ONNX
    Runtime get the same number of threads (:func:`latency_threads`): each with its default
    beside the other's pool oversubscribes the cores and times the contention."""
    threads = latency_threads()
    # Spinning off: these sessions are timed interleaved with each other and with PyTorch.
    raw_session = runtime.make_session(raw_path, provider, spinning=False, threads=threads)
    opt_session = runtime.make_session(
        output, provider, spinning=False, disabled_optimizers=disabled, threads=threads
    )
    timed = {
        "ort_raw": lambda: runtime.run(raw_session, feeds),
        "ort_optimized": lambda: runtime.run(opt_session, feeds),
    }
    if loaded.module is not None:
        eager = _eager(loaded)
        timed = {"pytorch_eager": lambda: eager([feeds[n] for n in feed_names])} | timed
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timings = time_interleaved(timed, budget_s=opts.budget_s)
    finally:
        torch.set_num_threads(before)
    return {k: v.to_dict() for k, v in timings.items()}


def latency_conditions(latency: dict | None) -> dict | None:
    """The thread counts used for timing, and the variants whose spread (p90 over median
    beyond :data:`BUSY_SPREAD`) says the machine was busy while they ran."""
    if not latency:
        return None
    threads = latency_threads()
    busy = [k for k, t in latency.items() if t["p90_ms"] > BUSY_SPREAD * t["median_ms"]]
    return {"pytorch_threads": threads, "onnxruntime_threads": threads, "busy": busy}


def prepare(opts: Options) -> tuple[LoadedModel, dict[str, np.ndarray], ir.Model, str]:
    """Load the model, settle its example inputs, export it (or take the ONNX as it is).

    Returns:
        ``(loaded, example inputs by name, ONNX model before normexport's passes, exporter)``;
        exporter is ``"dynamo"``, ``"torchscript"`` or ``"none"`` for ONNX input.

    Raises:
        UsageError: see :func:`run`.
    """
    if opts.target not in fusion.TARGETS:
        raise UsageError(f"--target {opts.target!r}: choose one of {', '.join(fusion.TARGETS)}")
    check_options(opts)
    loaded = load_model(
        opts.model,
        trust_pickle=opts.trust_pickle,
        model_class=opts.model_class,
        model_kwargs=opts.model_kwargs,
    )
    if loaded.kind == "onnx":
        _require_external_data(loaded)
    example = _example_inputs(loaded, opts)
    raw, exporter = _raw_onnx(loaded, example, opts)
    return loaded, example, raw, exporter


def check_options(opts: Options) -> None:
    """Refuse option values that cannot mean anything, before any work is done.

    Raises:
        UsageError: naming the option and its valid range.
    """
    for flag, value in (("--atol", opts.atol), ("--rtol", opts.rtol)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} {value}: give a finite tolerance >= 0, e.g. {flag} 1e-4")
    if not (math.isfinite(opts.budget_s) and opts.budget_s > 0):
        raise UsageError(f"--budget {opts.budget_s}: give a number of seconds > 0")
    # ONNX Runtime guarantees opset 7 and up; the newest is what this onnx and ORT both load
    if opts.opset is not None and not 7 <= opts.opset <= runtime.max_opset():
        raise UsageError(
            f"--opset {opts.opset}: give an ai.onnx opset from 7 to {runtime.max_opset()}"
        )


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


def _dynamic_axes(spec: str | None, names: list[str]) -> dict[str, dict[int, str]] | None:
    """``--dynamic`` -> ``{input: {axis: name}}``.

    ``batch`` marks axis 0 of every input, ``batch,sequence`` axes 0 and 1, and
    ``NAME:0,2`` the listed axes of one input (several such specs separated by ``;``).
    """
    if not spec:
        return None
    words = {"batch": 0, "sequence": 1}
    axes: dict[str, dict[int, str]] = {}
    for part in spec.split(";"):
        if ":" in part:
            name, _, dims = part.partition(":")
            if name not in names:
                raise UsageError(f"--dynamic {spec!r}: no input named {name!r} (inputs: {names})")
            try:
                axes[name] = {int(d): f"{name}_dim{d}" for d in dims.split(",")}
            except ValueError:
                raise UsageError(f"--dynamic {spec!r}: axes must be integers") from None
            continue
        for word in part.split(","):
            if word not in words:
                raise UsageError(
                    f"--dynamic {spec!r}: use batch, sequence, batch,sequence or NAME:0,1"
                )
            for name in names:
                axes.setdefault(name, {})[words[word]] = word
    return axes


def _raw_onnx(
    loaded: LoadedModel, example: dict[str, np.ndarray], opts: Options
) -> tuple[ir.Model, str]:
    """The model before normexport's passes, and which exporter made it ("none" for ONNX)."""
    if loaded.kind == "onnx":
        for flag, value in (("--opset", opts.opset), ("--dynamic", opts.dynamic)):
            if value:
                raise UsageError(f"{flag} applies to PyTorch models; {loaded.path} is ONNX already")
        return loaded.onnx_model, "none"
    names = list(example)
    args = [torch.from_numpy(a) for a in example.values()]
    try:
        exported = export_module(
            loaded.module,
            args,
            opset=opts.opset,
            input_names=names,
            dynamic_axes=_dynamic_axes(opts.dynamic, names),
            exporter=opts.exporter,
        )
    except ExportError as err:
        raise UsageError(f"{loaded.path}: could not export to ONNX: {err}") from None
    _check_export(exported, loaded, opts)
    return exported.model, exported.exporter


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


def _eager(loaded: LoadedModel, float64: bool = False):
    """A function: list of input arrays -> list of PyTorch output arrays (float32 eager, or a
    float64 deep copy of the model with float inputs cast to float64).

    An exported program is called the way it was exported: its example inputs' structure
    (positional and keyword arguments, non-tensor values such as ``use_cache=False``) with the
    given arrays in place of its tensors, in order.
    """
    module, structure = loaded.module, None
    if isinstance(module, torch.export.ExportedProgram):
        structure = module.example_inputs
        module = module.module()
    if float64:
        with warnings.catch_warnings():  # .double() reads .grad of every parameter
            warnings.simplefilter("ignore")
            module = copy.deepcopy(module).double()

    def tensor(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.double() if float64 and t.is_floating_point() else t

    def call(arrays: list[np.ndarray]) -> list[np.ndarray]:
        tensors = [tensor(a) for a in arrays]
        args, kwargs = tensors, {}
        if structure is not None:
            given = iter(tensors)
            args, kwargs = torch.utils._pytree.tree_map(
                lambda x: next(given) if isinstance(x, torch.Tensor) else x, structure
            )
        with torch.inference_mode():
            out = module(*args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves(out)
        return [t.detach().cpu().numpy() for t in leaves if isinstance(t, torch.Tensor)]

    return call


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
