"""``normexport bench MODEL``: latency of every optimizer's variant of one model, swept over
batch (and sequence) sizes, on one execution provider, with PyTorch eager beside them.

What is timed, and how (see :mod:`normexport.runtime.latency` for the statistics):

- the variants of :data:`normexport.tuning.variants.VARIANTS`, each in its own ORT session on the
  provider :func:`normexport.runtime.resolve_provider` picked (a CPU run is never labelled
  CUDA; ``auto`` without CUDA prints one line saying so);
- with ``--cpu`` (the default on CUDA), the raw export and normexport's model once more on
  ORT's CPU provider (``ort_raw@cpu``, ``normexport@cpu``), in the same interleaved rounds;
- PyTorch eager on the same device, ``torch.inference_mode``, followed by
  ``torch.cuda.synchronize()`` on CUDA so that the clock stops when the result is ready;
- ``--io-binding`` (the default on CUDA): inputs copied to the device once and outputs kept
  there (:class:`normexport.runtime.BoundRun`), so host-device copies are not timed;
  ``--cuda-graph`` adds CUDA graph capture and replay (one session per input shape);
- all of them in one process, interleaved in rotated order, after a warm-up; per variant the
  median, p90, min-max and a 95% bootstrap interval of the median; ratios to normexport and to
  eager are medians of per-round ratios, with their own bootstrap interval;
- what ORT really ran: each variant's norm ops after ORT's session optimizations (ORT_ENABLE_ALL
  turns Add + LayerNormalization into SkipLayerNormalization on its own, for one);
- each variant's output is compared with the reference (eager, else the raw export) at every
  point, so that a fast but inexact optimizer shows as such;
- the floor: the first fused norm (:data:`fusion.registry.FUSED_NORM_OPS`) of normexport's
  model, alone, against one elementwise op (Relu: one read, one write) over the same tensor on
  the same provider: how far the norm is from the memory-bound limit.

A variant that fails to build or to run at some shape is recorded with its error; the rest of
the comparison goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch
from rich.console import Console
from rich.table import Table

import fusion
from fusion.base import Op
from fusion.registry import FUSED_NORM_OPS
from normexport import report, runtime
from normexport.arguments import add_model_arguments
from normexport.errors import UsageError, one_line
from normexport.io.eager import Eager
from normexport.io.files import save_figure
from normexport.io.load import detect_kind
from normexport.runtime.latency import Timing, paired_ratio, time_interleaved
from normexport.tuning import variants
from normexport.verdict.parity import closeness

#: Name of the PyTorch eager entry among the variants' timings.
EAGER = "pytorch_eager"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for ``normexport bench``."""
    p = argparse.ArgumentParser(
        prog="normexport bench",
        description="Time the raw export, ORT's offline optimization, onnxscript's "
        "optimize_for_ort, ORT's transformer optimizer and normexport's model of MODEL, with "
        "PyTorch eager, interleaved in one process, over a sweep of batch (and sequence) sizes.",
    )
    add_model_arguments(p)
    p.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--batch", default="1,8,64", metavar="B,B,...", help="batch sizes to sweep")
    p.add_argument(
        "--seq",
        metavar="S,S,...",
        help="sequence lengths to sweep (axis 1 of every input of rank >= 2; sequence models)",
    )
    p.add_argument(
        "--sweep",
        choices=["grid", "cross"],
        default="grid",
        help="grid: every (batch, seq) pair; cross: the batches at the first sequence length, "
        "then the sequence lengths at the first batch (fewer points for large models)",
    )
    p.add_argument(
        "--io-binding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="inputs and outputs resident on the device, copies not timed (default: on for "
        "CUDA, off for CPU)",
    )
    p.add_argument("--cuda-graph", action="store_true", help="CUDA graphs (CUDA provider only)")
    p.add_argument(
        "--variants",
        metavar="NAME,...",
        help=f"variants to time (default: all of {', '.join(variants.VARIANTS)})",
    )
    p.add_argument("--no-eager", action="store_true", help="leave PyTorch eager out")
    p.add_argument(
        "--cpu",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the raw export and normexport's model on ORT's CPU provider "
        "(default: on for CUDA)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the elementwise floor")
    p.add_argument(
        "--budget", type=float, default=20.0, metavar="SECONDS", help="timing seconds, in all"
    )
    p.add_argument(
        "--min-runs",
        type=int,
        default=20,
        metavar="N",
        help="timed rounds per point at least, whatever the budget (default 20)",
    )
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write the results as JSON")
    p.add_argument("--chart", type=Path, metavar="OUT.png", help="latency vs batch chart")
    return p


def _sizes(text: str | None, flag: str) -> list[int | None]:
    if not text:
        return [None]
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give sizes like 1,8,64") from None
    if any(s < 1 for s in sizes):
        raise UsageError(f"{flag} {text!r}: sizes must be positive")
    return sizes


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``normexport bench``; returns the exit code (0; errors raise)."""
    from normexport import pipeline

    batches, seqs, only = _sweep_arguments(args)
    opts = _pipeline_options(args, seqs)
    writes = {
        flag: [path] for flag, path in (("--json", args.json), ("--chart", args.chart)) if path
    }
    pipeline.refuse_overwriting([Path(args.model)], writes)
    loaded, example, raw, _ = pipeline.prepare(opts)
    pipeline.refuse_overwriting(pipeline.input_files(loaded), writes)
    if loaded.kind == "onnx":
        raw = Path(args.model)  # the variants are built from the file itself, not a copy
    provider, note = runtime.resolve_provider(args.provider)
    if note:
        console.print(f"[yellow]{note}[/]")
    if args.cuda_graph and provider != "cuda":
        raise UsageError("--cuda-graph needs the CUDA provider, and it is not in use here")
    options = BenchOptions(
        provider=provider,
        batches=batches,
        seqs=seqs,
        sweep=args.sweep,
        io_binding=args.io_binding if args.io_binding is not None else provider == "cuda",
        cuda_graph=args.cuda_graph,
        target=args.target,
        only=only,
        floor=not args.no_floor,
        budget_s=args.budget,
        min_runs=args.min_runs,
        with_cpu=provider != "cpu" if args.cpu is None else args.cpu,
    )
    module = None if args.no_eager else loaded.module
    result = bench_model(raw, example, options, module=module)
    result = {"model": str(args.model), "provider_note": note} | result
    _write_results(result, args, console)
    return 0


def _sweep_arguments(args: argparse.Namespace) -> tuple[list, list, list[str] | None]:
    """The batches, sequence lengths and variants that ``args`` ask for.

    Raises:
        UsageError: a bad ``--batch``, ``--seq``, ``--min-runs`` or ``--variants``, or
            ``--cuda-graph`` with ``--provider cpu``.
    """
    if args.cuda_graph and args.provider == "cpu":
        raise UsageError("--cuda-graph needs the CUDA provider, not --provider cpu")
    batches = _sizes(args.batch, "--batch")
    seqs = _sizes(args.seq, "--seq")
    if args.min_runs < 3:
        raise UsageError(f"--min-runs {args.min_runs}: give at least 3 (a median needs runs)")
    only = args.variants.split(",") if args.variants else None
    if only and (unknown := [v for v in only if v not in variants.VARIANTS]):
        raise UsageError(f"--variants: unknown {unknown}; choose from {list(variants.VARIANTS)}")
    return batches, seqs, only


def _pipeline_options(args: argparse.Namespace, seqs: list[int | None]):
    """How the pipeline loads and exports the model: dynamic batch (and sequence, when the
    sweep changes it) unless ``--dynamic`` says otherwise or the model is ONNX already."""
    from normexport import pipeline

    dynamic = args.dynamic
    if dynamic is None and detect_kind(args.model) != "onnx":
        dynamic = "batch,sequence" if seqs != [None] else "batch"
    return pipeline.Options(
        model=args.model,
        input_shape=args.input_shape,
        inputs=args.inputs,
        dynamic=dynamic,
        opset=args.opset,
        target=args.target,
        trust_pickle=args.trust_pickle,
        model_class=args.model_class,
        model_kwargs=args.model_kwargs,
        exporter=args.exporter,
    )


def _write_results(result: dict, args: argparse.Namespace, console: Console) -> None:
    """Print the tables; write ``--json`` and ``--chart`` where asked."""
    render(result, console)
    if args.json:
        report.write_json(result, args.json)
        console.print(f"results: {args.json}")
    if args.chart:
        write_chart(result, args.chart)
        console.print(f"chart: {args.chart}")


def machine(provider: str) -> dict:
    """What the numbers were measured on: CPU model and cores, GPU name on CUDA, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    out = {
        "cpu": cpu,
        "cpu_cores_visible": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "provider": runtime.PROVIDERS[provider][0],
        "versions": {
            "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__,
            "onnx": onnx.__version__,
        },
    }
    if provider == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown"
    return out


def resize_inputs(
    example: dict[str, np.ndarray], batch: int | None, seq: int | None
) -> dict[str, np.ndarray]:
    """The example inputs at another batch (axis 0) and sequence length (axis 1 of inputs of
    rank >= 2), repeating the example cyclically so that token ids and masks stay valid."""
    out = {}
    for name, a in example.items():
        for axis, size in ((0, batch), (1, seq)):
            if size is not None and a.ndim > axis and (axis == 0 or a.ndim >= 2):
                a = np.take(a, np.arange(size) % a.shape[axis], axis=axis)
        out[name] = np.ascontiguousarray(a)
    return out


def _max_abs_diff(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """The largest :attr:`~normexport.verdict.parity.Closeness.max_abs_err` over the outputs.

    Raises:
        ValueError: the output counts or shapes differ.
    """
    return max(closeness(g, r).max_abs_err for g, r in zip(got, ref, strict=True))


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What :func:`bench_model` times, where and for how long.

    Attributes:
        provider: ``"cpu"`` or ``"cuda"`` (already resolved).
        batches, seqs, sweep: the points, see :func:`sweep_points` (None keeps the example's
            size).
        io_binding, cuda_graph: see the module docstring.
        target: normexport's target.
        only: variants to build (default: all).
        floor: measure the elementwise floor.
        budget_s: timing seconds over all points.
        min_runs: timed rounds per point at least, whatever the budget.
        with_cpu: also time the raw export and normexport's model on ORT's CPU provider
            (:func:`cpu_baseline`), interleaved with the rest; for a CUDA comparison.
    """

    provider: str = "cpu"
    batches: Sequence[int | None] = (None,)
    seqs: Sequence[int | None] = (None,)
    sweep: str = "grid"
    io_binding: bool = False
    cuda_graph: bool = False
    target: str = "ort"
    only: Sequence[str] | None = None
    floor: bool = True
    budget_s: float = 20.0
    min_runs: int = 20
    with_cpu: bool = False

    def settings(self, eager: bool) -> dict:
        """The result's ``settings``: how it was timed, and whether eager ran beside."""
        keys = ("sweep", "min_runs", "with_cpu", "io_binding", "cuda_graph", "target", "budget_s")
        return {k: getattr(self, k) for k in keys} | {"eager": eager}


def bench_model(
    raw: ir.Model | Path,
    example: dict[str, np.ndarray],
    options: BenchOptions | None = None,
    *,
    module=None,
    extra: dict[str, variants.Variant] | None = None,
) -> dict:
    """Build the variants of ``raw`` and time them (and eager) at each (batch, seq) point.

    Args:
        raw: the export before any optimizer (dynamic axes where the sweep changes sizes), as
            an .onnx file or in memory. The variants are written to a temporary folder.
        example: example inputs by graph input name; resized per point by
            :func:`resize_inputs` (None keeps the example's size).
        options: the points, provider and budget (default: :class:`BenchOptions`).
        module: the PyTorch model for the eager entry, or None.
        extra: models of the caller's own to time beside the variants
            (:meth:`normexport.tuning.variants.Variant.extra`); not counted as optimizers in
            ``normexport_vs_best``.

    Returns:
        JSON-ready dict: ``machine``, ``settings``, ``variants`` (build info per variant),
        ``points`` (per point: ``batch``, ``seq``, ``inputs``, ``latency_ms`` per variant,
        ``errors``, ``ratio_to_normexport``, ``ratio_to_eager``, ``max_abs_diff`` vs
        ``reference``, ``normexport_vs_best``) and ``floor``.
    """
    opts = options or BenchOptions()
    points = sweep_points(list(opts.batches), list(opts.seqs), opts.sweep)
    only = list(opts.only) if opts.only else None
    with tempfile.TemporaryDirectory(prefix="normexport-bench-") as folder:
        built = variants.build_variants(
            raw, opts.provider, Path(folder), target=opts.target, only=only
        )
        built |= (cpu_baseline(built) if opts.with_cpu else {}) | (extra or {})
        result = _bench_points(built, points, example, module, opts)
        return result | {"settings": opts.settings(eager=module is not None)}


def _bench_points(
    built: dict[str, variants.Variant],
    points: list[tuple[int | None, int | None]],
    example: dict[str, np.ndarray],
    module,
    opts: BenchOptions,
) -> dict:
    """Time ``built`` at each point, then the floor; :func:`bench_model`'s result but
    ``settings``."""
    sessions: dict[str, object] = {}
    point_results = []
    budget_s = opts.budget_s / len(points)
    for batch, seq in points:
        feeds = resize_inputs(example, batch, seq)
        timed = _bench_point(built, sessions, feeds, module, opts, budget_s)
        point_results.append(timed | {"batch": batch, "seq": seq})
    ran = [
        pt for pt, r in zip(points, point_results, strict=True) if "normexport" in r["latency_ms"]
    ]
    floor_result = None
    if opts.floor and ran:  # at the first size normexport's model ran at
        floor_result = _floor(built, resize_inputs(example, *ran[0]), opts)
    return {
        "machine": machine(opts.provider),
        "provider": runtime.PROVIDERS[opts.provider][0],
        "variants": {
            k: v.to_dict() | {"ort_ran_norm_ops": _ran_norm_ops(v, opts.provider)}
            for k, v in built.items()
        },
        "points": point_results,
        "floor": floor_result,
    }


def _floor(built: dict[str, variants.Variant], feeds: dict, opts: BenchOptions) -> dict | None:
    """:func:`norm_floor` of normexport's model; an error is recorded, not raised."""
    try:
        budget_s = max(2.0, opts.budget_s / 10)
        return norm_floor(built["normexport"].model, feeds, opts.provider, budget_s=budget_s)
    except Exception as err:  # the floor is a side measurement: record, go on
        return {"error": one_line(err)}


def sweep_points(
    batches: list[int | None], seqs: list[int | None], sweep: str = "grid"
) -> list[tuple[int | None, int | None]]:
    """The (batch, seq) points of a sweep, in timing order (None: the example's own size).

    ``"grid"``: every pair, batch varying fastest. ``"cross"``: every batch at ``seqs[0]``,
    then every other sequence length at ``batches[0]``; the latency-vs-batch and
    latency-vs-sequence curves for far fewer points than the grid.

    Raises:
        ValueError: ``sweep`` is neither.
    """
    if sweep == "grid":
        return [(b, s) for s in seqs for b in batches]
    if sweep == "cross":
        return [(b, seqs[0]) for b in batches] + [(batches[0], s) for s in seqs[1:]]
    raise ValueError(f"unknown sweep {sweep!r}: 'grid' or 'cross'")


def _ran_norm_ops(variant: variants.Variant, provider: str) -> dict[str, int] | None:
    """Norm op counts of the graph ORT really runs for ``variant`` (after its session
    optimizations, written out with ``optimized_model_filepath``); None if it does not load."""
    if variant.model is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "session.onnx"
        try:
            runtime.make_session(
                variant.model,
                variant.provider or provider,
                optimization_level=variant.optimization_level,
                optimized_model_path=str(path),
            )
        except Exception:  # the timing step records why it does not load
            return None
        return fusion.norm_ops(ir.load(path))


def _session(variant: variants.Variant, provider: str, cuda_graph: bool):
    return runtime.make_session(
        variant.model,
        variant.provider or provider,
        optimization_level=variant.optimization_level,
        spinning=False,
        cuda_graph=cuda_graph,
    )


#: Suffix of the CPU-provider copies of a CUDA comparison's entries.
CPU_SUFFIX = "@cpu"


def cpu_baseline(built: dict[str, variants.Variant]) -> dict[str, variants.Variant]:
    """The raw export and normexport's model (as built for the comparison's provider) again, to
    run on ORT's CPU provider beside a CUDA comparison: ``ort_raw@cpu``, ``normexport@cpu``."""
    out = {}
    for name in ("ort_raw", variants.REFERENCE_VARIANT):
        v = built.get(name)
        if v is not None and v.model is not None:
            cpu_name = name + CPU_SUFFIX
            cpu_text = f"{v.description}, on ORT's CPU provider"
            out[cpu_name] = dataclasses.replace(
                v, name=cpu_name, provider="cpu", description=cpu_text
            )
    return out


def _bench_point(
    built: dict[str, variants.Variant],
    sessions: dict,
    feeds: dict[str, np.ndarray],
    module,
    opts: BenchOptions,
    budget_s: float,
) -> dict:
    """Time every variant at one input size, in ``budget_s`` seconds; see :func:`bench_model`."""
    runners, outputs, errors = {}, {}, {}
    if module is not None:
        try:
            eager = Eager(module, device="cuda" if opts.provider == "cuda" else "cpu")
            outputs[EAGER] = eager(list(feeds.values()))
            runners[EAGER] = eager.bind(list(feeds.values()))
        except Exception as err:  # e.g. an exported program specialized to one shape
            errors[EAGER] = one_line(err)
    for name, variant in built.items():
        if variant.model is None:
            errors[name] = f"not built: {variant.error}"
            continue
        graphed = opts.cuda_graph and variant.provider is None  # not the CPU baseline's copies
        try:
            if graphed or name not in sessions:  # a CUDA graph is captured for one shape
                sessions[name] = _session(variant, opts.provider, graphed)
            io_binding = opts.io_binding or graphed
            call, get = runtime.runner(sessions[name], feeds, io_binding=io_binding)
            outputs[name] = get()
            runners[name] = call
        except Exception as err:
            errors[name] = one_line(err)
    reference = EAGER if EAGER in outputs else "ort_raw" if "ort_raw" in outputs else None
    diffs = _diffs(outputs, reference, errors)
    timings = (
        time_interleaved(runners, budget_s=budget_s, min_runs=opts.min_runs) if runners else {}
    )
    return {
        "inputs": {k: list(v.shape) for k, v in feeds.items()},
        "latency_ms": {k: t.to_dict() for k, t in timings.items()},
        "errors": errors,
        "ratio_to_normexport": _ratios(timings, variants.REFERENCE_VARIANT),
        "ratio_to_eager": _ratios(timings, EAGER),
        "reference": reference,
        "max_abs_diff": diffs,
        "normexport_vs_best": _vs_best(timings),
    }


def _diffs(outputs: dict[str, list], reference: str | None, errors: dict[str, str]) -> dict:
    """Max |output - reference's output| per variant (None, with an error recorded, where the
    outputs differ in structure); empty without a reference."""
    diffs = {}
    if reference is None:
        return diffs
    for name, out in outputs.items():
        try:
            diffs[name] = _max_abs_diff(out, outputs[reference])
        except (ValueError, TypeError) as err:  # different output count or shape
            diffs[name] = None
            errors.setdefault(name, f"outputs differ in structure: {err}")
    return diffs


def _ratios(timings: dict[str, Timing], base: str) -> dict[str, dict]:
    if base not in timings:
        return {}
    return {k: paired_ratio(t, timings[base]).to_dict() for k, t in timings.items() if k != base}


def _vs_best(timings: dict[str, Timing]) -> dict | None:
    """normexport against the fastest other optimizer's variant: ratio and whether it is within
    the spread (the ratio's 95% interval reaches 1 or below)."""
    ref = variants.REFERENCE_VARIANT
    others = {k: t for k, t in timings.items() if k in variants.VARIANTS and k != ref}
    if ref not in timings or not others:
        return None
    best = min(others, key=lambda k: others[k].median_ms)
    ratio = paired_ratio(timings[ref], others[best])
    return {"best_other": best, "ratio": ratio.to_dict(), "within_spread": ratio.ci_low <= 1.0}


def _norm_input_shapes(model: Path, feeds, provider: str) -> tuple[ir.Model, ir.Node, dict]:
    """normexport's model, its first fused norm node, and that node's input shapes (probed by
    running a copy of the model with the node's inputs added as graph outputs)."""
    copy = ir.load(model)
    node = next((n for n in copy.graph if Op(n.op_type, n.domain) in FUSED_NORM_OPS), None)
    if node is None:
        return copy, None, {}
    probed = [
        v for v in node.inputs if v is not None and ir.convenience.get_const_tensor(v) is None
    ]
    extra = [v for v in probed if not v.is_graph_output() and not v.is_graph_input()]
    copy.graph.outputs.extend(extra)
    session = runtime.make_session(copy, provider, spinning=False)
    names = [o.name for o in session.get_outputs()]
    arrays = dict(zip(names, runtime.run(session, feeds), strict=True)) | feeds
    for value in extra:
        copy.graph.outputs.remove(value)
    return copy, node, {v.name: tuple(arrays[v.name].shape) for v in probed}


def norm_floor(model: Path, feeds: dict[str, np.ndarray], provider: str, budget_s: float = 3.0):
    """Time the first fused norm of the model file ``model`` alone and one Relu over its input
    tensor.

    Both run with IO binding on ``provider``, interleaved. Relu reads the tensor once and
    writes it once, the least any op over it can do: ``norm_over_floor`` says how far the norm
    is from that memory-bound limit.

    Returns:
        ``{"node", "op", "shape", "norm_ms", "elementwise_ms", "norm_over_floor"}`` (timings as
        :class:`normexport.runtime.latency.Timing` dicts, ms), or None when the model has no fused
        norm.
    """
    copy, node, shapes = _norm_input_shapes(model, feeds, provider)
    if node is None:
        return None
    x = node.inputs[0].name
    shape = shapes[x]
    single = variants.isolate_node(copy, node, shapes)
    rng = np.random.default_rng(0)
    norm_feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    relu = variants.op_model("Relu", shape)
    runners = {}
    for name, m, f in (
        ("norm", single, norm_feeds),
        ("elementwise", relu, {"x": norm_feeds[x]}),
    ):
        session = runtime.make_session(m, provider, spinning=False)
        runners[name] = runtime.runner(session, f, io_binding=True)[0]
    t = time_interleaved(runners, budget_s=budget_s)
    ratio = paired_ratio(t["norm"], t["elementwise"])
    return {
        "node": node.name,
        "op": node.op_type,
        "shape": list(shape),
        "provider": runtime.PROVIDERS[provider][0],
        "norm_ms": t["norm"].to_dict(),
        "elementwise_ms": t["elementwise"].to_dict(),
        "norm_over_floor": ratio.to_dict(),
    }


def fmt_ratio(r: dict | None) -> str:
    if not r:
        return "-"
    return f"{r['median']:.2f}x [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def render(result: dict, console: Console) -> None:
    """Print one table per point, then the floor."""
    m = result["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cpu_cores_visible']} cores"
    settings = result["settings"]
    console.print(
        f"[bold]{result.get('model', '')}[/] on [bold]{result['provider']}[/] ({where}); "
        f"io_binding={settings['io_binding']}, cuda_graph={settings['cuda_graph']}"
    )
    for name, v in result["variants"].items():
        if not v["built"]:
            console.print(f"[red]{name} not built[/]: {v['error']}")
            continue
        ops = ", ".join(f"{k} {n}" for k, n in v["norm_ops"].items()) or "no norm ops"
        ran = v.get("ort_ran_norm_ops")
        ran = "?" if ran is None else ", ".join(f"{k} {n}" for k, n in ran.items()) or "none"
        console.print(f"  {name}: {v['nodes']} nodes, {ops}; ORT ran: {ran}")
    for point in result["points"]:
        title = ", ".join(f"{k} {v}" for k, v in point["inputs"].items())
        table = Table(
            title=f"{title}: ms per call (median [95% CI], p90, min-max); ratios > 1: slower",
            title_justify="left",
        )
        cols = ("variant", "median", "p90", "min-max", "÷ normexport", "÷ eager", "max |Δ|")
        for col in cols:
            table.add_column(col, justify="left" if col == "variant" else "right")
        for name, t in point["latency_ms"].items():
            diff = point["max_abs_diff"].get(name)
            table.add_row(
                name,
                f"{t['median_ms']:.3f} [{t['ci_low_ms']:.3f}, {t['ci_high_ms']:.3f}]",
                f"{t['p90_ms']:.3f}",
                f"{t['min_ms']:.3f}-{t['max_ms']:.3f}",
                fmt_ratio(point["ratio_to_normexport"].get(name)),
                fmt_ratio(point["ratio_to_eager"].get(name)),
                "-" if diff is None else f"{diff:.2g}",
            )
        console.print(table)
        for name, err in point["errors"].items():
            console.print(f"[red]{name}[/]: {err}")
    floor = result.get("floor")
    if floor and "error" in floor:
        console.print(f"[red]floor not measured[/]: {floor['error']}")
    elif floor:
        console.print(
            f"floor: {floor['op']} over {floor['shape']} takes "
            f"{floor['norm_ms']['median_ms']:.3f} ms, one Relu over it "
            f"{floor['elementwise_ms']['median_ms']:.3f} ms: "
            f"{fmt_ratio(floor['norm_over_floor'])} the memory-bound floor"
        )


def write_chart(result: dict, path: Path, title: str | None = None) -> None:
    """Latency (median, 95% CI as error bars) against batch, one line per variant: one panel
    per sequence length that has two batches or more (or the only one); and against sequence
    length, one panel per batch that has two lengths or more. Log-log axes, provider in the
    axis label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]

    def size(p: dict, axis: int) -> int:  # the point's batch / seq as run
        return next(s[axis] for s in p["inputs"].values() if len(s) > axis)

    panels = []  # (x axis name, points, title suffix)
    seqs = list(dict.fromkeys(p["seq"] for p in points))
    for seq in seqs:
        pts = [p for p in points if p["seq"] == seq]
        if len(pts) > 1 or len(seqs) == 1:
            panels.append(("batch", pts, f", seq {seq}" if seq else ""))
    for batch in dict.fromkeys(p["batch"] for p in points):
        pts = [p for p in points if p["batch"] == batch]
        if len({p["seq"] for p in pts}) > 1:
            panels.append(("sequence", pts, f", batch {size(pts[0], 0)}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    names = list(dict.fromkeys(k for p in points for k in p["latency_ms"]))
    for ax, (xname, pts, suffix) in zip(axes[0], panels, strict=True):
        for name in names:
            xs, ys, lo, hi = [], [], [], []
            for p in pts:
                t = p["latency_ms"].get(name)
                if t is None:
                    continue
                xs.append(size(p, 0 if xname == "batch" else 1))
                ys.append(t["median_ms"])
                lo.append(t["median_ms"] - t["ci_low_ms"])
                hi.append(t["ci_high_ms"] - t["median_ms"])
            style = {"linewidth": 2.5, "color": "black"} if name == "normexport" else {}
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xname)
        ax.set_ylabel(f"ms per call (median, 95% CI), {result['provider']}")
        ax.set_title((title or Path(result.get("model", "")).name) + suffix)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
