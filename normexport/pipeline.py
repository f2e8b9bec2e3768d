"""The main job: load, export, optimize, prove parity, time, write model and report."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch

import fusion
from fusion._ir import opset_version
from normexport import autotune, explain, runtime, variants
from normexport import inputs as inputs_mod
from normexport.errors import UsageError
from normexport.export import ExportError, export_module
from normexport.files import atomic_path
from normexport.latency import time_interleaved
from normexport.load import LoadedModel, load_model
from normexport.parity import DEFAULT_ATOL, DEFAULT_RTOL, check_parity


@dataclasses.dataclass
class Options:
    """What the user asked for; the CLI flags of the same names fill it.

    Attributes:
        model: the model file.
        output: where to write the optimized model (default: MODEL stem + ``.opt.onnx``).
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

    The optimized model is written even when parity fails; ``report["parity"]["passed"]``
    says whether it did.

    Raises:
        UsageError: a user mistake: unreadable file, missing or bad option.
    """
    output = Path(opts.output) if opts.output else default_output(Path(opts.model))
    if output.exists() and output.resolve() == Path(opts.model).resolve():
        raise UsageError(f"-o {output} is the input file; normexport never overwrites its input")
    loaded, example, raw, exporter = prepare(opts)
    provider, provider_note = runtime.resolve_provider(opts.provider)
    raw_bytes = ir.to_proto(raw).SerializeToString()
    ops_before = fusion.norm_ops(raw)
    already = explain.already_fused(raw)

    feed_names = [v.name for v in raw.graph.inputs if not v.is_initializer()]
    sets = inputs_mod.input_sets(_by_feed_name(example, feed_names))
    optimized = raw  # optimized in place; the raw model lives on as raw_bytes
    skip = variants.skip_fusion(opts.target, provider)
    fusions = fusion.optimize(optimized, target=opts.target, skip=skip)
    fusion.check(optimized)
    tuned = None
    if opts.autotune:
        unfused = unfused_fusions = None
        if fusions.counts["attention_fused"]:  # fused attention is a speed choice per shape
            unfused = ir.from_proto(onnx.load_from_string(raw_bytes))
            unfused_fusions = fusion.optimize(
                unfused, target=opts.target, skip=skip, attention=False
            )
        tuned = autotune.autotune(
            autotune.candidates(optimized, target=opts.target, attention_unfused=unfused),
            sets["example"],
            provider,
            budget_s=opts.budget_s / 2,
            atol=opts.atol,
            rtol=opts.rtol,
        )
        optimized = ir.from_proto(onnx.load_from_string(tuned.model))
        fusion.check(optimized)
        if tuned.best.startswith(autotune.ATTENTION_UNFUSED):
            fusions = unfused_fusions
    disabled = tuned.disabled_optimizers if tuned else ()
    with atomic_path(output) as tmp:
        ir.save(optimized, tmp)

    # Spinning off: these sessions are timed interleaved with each other and with PyTorch.
    raw_session = runtime.make_session(raw_bytes, provider, spinning=False)
    opt_session = runtime.make_session(
        output, provider, spinning=False, disabled_optimizers=disabled
    )

    def candidate(feeds):
        return runtime.run(opt_session, feeds)

    if loaded.module is not None:
        eager = _eager(loaded)

        def reference(feeds):
            return eager([feeds[name] for name in feed_names])

        reference_kind = "pytorch"
    else:

        def reference(feeds):
            return runtime.run(raw_session, feeds)

        reference_kind = "onnx"
    output_names = [o.name for o in opt_session.get_outputs()]
    parity = check_parity(
        candidate,
        reference,
        sets,
        output_names,
        reference_kind=reference_kind,
        atol=opts.atol,
        rtol=opts.rtol,
    )
    raw_vs_reference = None
    if reference_kind == "pytorch":
        raw_check = check_parity(
            lambda feeds: runtime.run(raw_session, feeds),
            reference,
            {"example": sets["example"]},
            output_names,
            reference_kind=reference_kind,
            atol=opts.atol,
            rtol=opts.rtol,
        )
        raw_vs_reference = {k: v.max_abs_err for k, v in raw_check.worst().items()}

    latency = None
    if opts.benchmark:
        feeds = sets["example"]
        timed = {
            "ort_raw": lambda: runtime.run(raw_session, feeds),
            "ort_optimized": lambda: runtime.run(opt_session, feeds),
        }
        if loaded.module is not None:
            timed = {"pytorch_eager": lambda: eager([feeds[n] for n in feed_names])} | timed
        latency = {
            k: v.to_dict() for k, v in time_interleaved(timed, budget_s=opts.budget_s).items()
        }

    return {
        "model": str(opts.model),
        "kind": loaded.kind,
        "exporter": exporter,
        "opset": opset_version(optimized),
        "target": opts.target,
        "output": str(output),
        "inputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in example.items()},
        "fusions": fusions.to_dict() | {"already_fused": already},
        "norm_ops": {"before": ops_before, "after": fusion.norm_ops(optimized)},
        "parity": parity.to_dict() | {"raw_export_max_abs_err": raw_vs_reference},
        "provider": runtime.PROVIDERS[provider][0],
        "provider_note": provider_note,
        "latency_ms": latency,
        "autotune": tuned.to_dict() if tuned else None,
        "versions": {
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
    }


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
    loaded = load_model(
        opts.model,
        trust_pickle=opts.trust_pickle,
        model_class=opts.model_class,
        model_kwargs=opts.model_kwargs,
    )
    example = _example_inputs(loaded, opts)
    raw, exporter = _raw_onnx(loaded, example, opts)
    return loaded, example, raw, exporter


def _example_inputs(loaded: LoadedModel, opts: Options) -> dict[str, np.ndarray]:
    """Example inputs by name: from ``--inputs``, ``--input-shape``, the file, or the graph."""
    specs = [inputs_mod.parse_input_shape(s) for s in opts.input_shape]
    if opts.inputs is not None:
        try:
            with np.load(opts.inputs) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError) as err:
            raise UsageError(f"--inputs {opts.inputs}: cannot read it as .npz ({err})") from None
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
    return exported.model, exported.exporter


def _eager(loaded: LoadedModel):
    """A function: list of input arrays -> list of PyTorch output arrays (float32 eager)."""
    module = loaded.module
    if isinstance(module, torch.export.ExportedProgram):
        module = module.module()

    def call(arrays: list[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            out = module(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])
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
