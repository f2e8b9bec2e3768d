"""Building the variants of one model and timing them (and PyTorch eager) at every point of a
sweep: :func:`bench_model`."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir

import fusion
from normexport import runtime
from normexport.bench import variants
from normexport.bench.bench_options import BenchOptions, sweep_points
from normexport.bench.floor import norm_floor
from normexport.bench.results import BenchResult, BenchVariant, Floor, Machine, Point, VsBest
from normexport.errors import one_line
from normexport.io.eager import Eager
from normexport.latency.measure import (
    Ratio,
    Timing,
    latency_threads,
    paired_ratio,
    runner,
    time_interleaved,
)
from normexport.runtime.fusion_policy import fusion_policy
from normexport.verdict.parity import closeness

#: Name of the PyTorch eager entry among the variants' timings.
EAGER = "pytorch_eager"

#: Suffix of the CPU-provider copies of a CUDA comparison's entries.
CPU_SUFFIX = "@cpu"


def bench_model(
    raw: ir.Model | Path,
    example: dict[str, np.ndarray],
    options: BenchOptions | None = None,
    *,
    module=None,
    extra: dict[str, variants.Variant] | None = None,
) -> BenchResult:
    """Build the variants of ``raw`` and time them (and eager) at each (batch, seq) point.

    Args:
        raw: the export before any optimizer (dynamic axes where the sweep changes sizes), as
            an .onnx file or in memory. The variants are written to a temporary folder.
        example: example inputs by graph input name; resized per point by
            :func:`resize_inputs` (None keeps the example's size).
        options: the points, provider and budget (default:
            :class:`~normexport.bench.bench_options.BenchOptions`).
        module: the PyTorch model for the eager entry, or None.
        extra: models of the caller's own to time beside the variants
            (:meth:`normexport.bench.variants.Variant.extra`); not counted as optimizers in
            ``normexport_vs_best``.

    Returns:
        The :class:`~normexport.bench.results.BenchResult` (``model`` and ``provider_note``
        unset); a variant that fails to build or run is recorded with its error there.
    """
    opts = options or BenchOptions()
    points = sweep_points(list(opts.batches), list(opts.seqs), opts.sweep)
    only = list(opts.only) if opts.only else None
    with tempfile.TemporaryDirectory(prefix="normexport-bench-") as folder:
        policy = fusion_policy(opts.target, opts.provider, latency_threads())
        built = variants.build_variants(raw, opts.provider, Path(folder), policy=policy, only=only)
        built |= (cpu_baseline(built) if opts.with_cpu else {}) | (extra or {})
        return _bench_points(built, points, example, module, opts)


def _bench_points(
    built: dict[str, variants.Variant],
    points: list[tuple[int | None, int | None]],
    example: dict[str, np.ndarray],
    module,
    opts: BenchOptions,
) -> BenchResult:
    """Time ``built`` at each point, then the floor; see :func:`bench_model`."""
    sessions: dict[str, object] = {}
    timed = []
    budget_s = opts.budget_s / len(points)
    for batch, seq in points:
        feeds = resize_inputs(example, batch, seq)
        timed.append(_bench_point(built, sessions, feeds, module, opts, budget_s, (batch, seq)))
    ran = [(p.batch, p.seq) for p in timed if variants.REFERENCE_VARIANT in p.timings]
    floor, floor_error = None, None
    if opts.floor and ran:  # at the first size normexport's model ran at
        floor, floor_error = _floor(built, resize_inputs(example, *ran[0]), opts)
    return BenchResult(
        machine=Machine.probe(opts.provider),
        variants={k: BenchVariant(v, _ran_norm_ops(v, opts.provider)) for k, v in built.items()},
        points=timed,
        floor=floor,
        floor_error=floor_error,
        options=opts,
        eager=module is not None,
    )


def _floor(
    built: dict[str, variants.Variant], feeds: dict, opts: BenchOptions
) -> tuple[Floor | None, str | None]:
    """:func:`~normexport.bench.floor.norm_floor` of normexport's model, and the error (one
    line) where it failed: recorded, not raised."""
    try:
        budget_s = max(2.0, opts.budget_s / 10)
        model = built[variants.REFERENCE_VARIANT].model
        return norm_floor(model, feeds, opts.provider, budget_s=budget_s), None
    except Exception as err:  # the floor is a side measurement: record, go on
        return None, one_line(err)


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


def _runners(
    built: dict[str, variants.Variant],
    sessions: dict,
    feeds: dict[str, np.ndarray],
    module,
    opts: BenchOptions,
) -> tuple[dict, dict[str, list], dict[str, str]]:
    """Each entry's zero-argument run, its outputs at ``feeds``, and the error of each that
    could not be made to run (eager: an exported program specialized to one shape, say)."""
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
            call, get = runner(sessions[name], feeds, io_binding=io_binding)
            outputs[name] = get()
            runners[name] = call
        except Exception as err:
            errors[name] = one_line(err)
    return runners, outputs, errors


def _bench_point(
    built: dict[str, variants.Variant],
    sessions: dict,
    feeds: dict[str, np.ndarray],
    module,
    opts: BenchOptions,
    budget_s: float,
    point: tuple[int | None, int | None],
) -> Point:
    """Time every variant at one input size (the sweep's ``point``), in ``budget_s`` seconds;
    see :func:`bench_model`."""
    runners, outputs, errors = _runners(built, sessions, feeds, module, opts)
    reference = EAGER if EAGER in outputs else "ort_raw" if "ort_raw" in outputs else None
    diffs = _diffs(outputs, reference, errors)
    timings = (
        time_interleaved(runners, budget_s=budget_s, min_runs=opts.min_runs) if runners else {}
    )
    return Point(
        batch=point[0],
        seq=point[1],
        inputs={k: list(v.shape) for k, v in feeds.items()},
        timings=timings,
        errors=errors,
        ratio_to_normexport=_ratios(timings, variants.REFERENCE_VARIANT),
        ratio_to_eager=_ratios(timings, EAGER),
        reference=reference,
        max_abs_diff=diffs,
        normexport_vs_best=_vs_best(timings),
    )


def _diffs(outputs: dict[str, list], reference: str | None, errors: dict[str, str]) -> dict:
    """Max |output - reference's output| per variant (None, with an error recorded, where the
    outputs differ in structure); empty without a reference."""
    diffs = {}
    if reference is None:
        return diffs
    for name, out in outputs.items():
        try:
            diffs[name] = max(
                closeness(g, r).max_abs_err for g, r in zip(out, outputs[reference], strict=True)
            )
        except (ValueError, TypeError) as err:  # different output count or shape
            diffs[name] = None
            errors.setdefault(name, f"outputs differ in structure: {err}")
    return diffs


def _ratios(timings: dict[str, Timing], base: str) -> dict[str, Ratio]:
    if base not in timings:
        return {}
    return {k: paired_ratio(t, timings[base]) for k, t in timings.items() if k != base}


def _vs_best(timings: dict[str, Timing]) -> VsBest | None:
    """normexport against the fastest other optimizer's variant (see
    :class:`~normexport.bench.results.VsBest`)."""
    ref = variants.REFERENCE_VARIANT
    others = {k: t for k, t in timings.items() if k in variants.VARIANTS and k != ref}
    if ref not in timings or not others:
        return None
    best = min(others, key=lambda k: others[k].median_ms)
    return VsBest(best, paired_ratio(timings[ref], others[best]))
