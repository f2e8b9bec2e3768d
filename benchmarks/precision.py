"""Half precision: normexport's ``--precision fp16`` against the generic float16 converters.

For a representative subset of the gallery's norms (:data:`GALLERY_CASES`: hand-written
LayerNorm and RMSNorm forms, look-alikes the fusions refuse, BatchNorm folds; dynamo exporter,
opset 18) and the demo models (:data:`models.ZOO`, saved and exported the way ``make demo``
does: :func:`models.demo.save_model_file`, :func:`normexport.pipeline.prepare`), the float32
model before normexport's passes goes through each converter, with its defaults:

- ``onnxconverter_common``: ``onnxconverter_common.float16.convert_float_to_float16(model)``;
- ``ort_float16``: ``onnxruntime.transformers.float16.convert_float_to_float16(model)`` (its
  default op block list);
- ``onnxslim_fp16``: ``onnxslim.slim(model, dtype="fp16")`` (onnxslim's graph passes, then
  onnxconverter-common's converter);
- ``normexport``: ``fusion.optimize`` then :func:`normexport.precision.to_half` (what
  ``--precision fp16`` writes; inputs and outputs float16, like the others' defaults);
- ``normexport_target_onnx``: the same with ``--target onnx`` (default-domain ops only, no
  ONNX Runtime contrib op), so that ``onnx.reference`` can run it too.

``float32`` (the model before any converter) is there for size and latency. Each model runs on
ONNX Runtime's CPU provider (its graph optimizations on, as deployed; intra-op threads fixed by
``--threads``) on a random input set and on the overflow probe
(:func:`normexport.precision.overflow_set`: one feature in eight about 1e3; for models with
integer inputs only, hidden states with such outliers fed at the embedding lookup, every model
cut there as :mod:`normexport.verdict.hidden_probe` cuts it, against the float32 model cut there in
float64). Measured per model and input set: NaN / Inf count of the outputs, the
worst relative L2 error of an output against the float64 oracle (the float32 model with every
tensor in float64, :func:`normexport.verdict.oracle.onnx_float64`), the model's size (bytes,
external data included) and its CPU latency (median of interleaved runs,
:func:`normexport.latency.measure.time_interleaved`).

ONNX Runtime's CPU provider has few float16 kernels: it inserts casts to float32 around the
others itself, which can keep a generic converter's model finite on CPU where a float16 device
would overflow. So, for the gallery's norms (small) and the token-id models' hidden-state
probe, each model also runs on ``onnx.reference`` (the ONNX spec's numpy evaluator, which
computes float16 ops in float16 as written): the CPU-independent evidence, side by side
(``reference`` in the JSON, with ``overflow_inside``: the NaN / +Inf values its intermediate
tensors hold, an overflow the outputs hide where ``1 / sqrt(inf)`` is 0; ``E`` where it has no
kernel for an op, e.g. ONNX Runtime's com.microsoft ones).

Writes ``precision_cpu.json`` and ``precision_cpu.png`` to ``--out`` and prints the table.

    python benchmarks/precision.py [--only ln_pow_reciprocal,crepe-tiny] [--threads 1]
                                   [--budget 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import reference_kernels
import torch
from onnx.reference import ReferenceEvaluator
from rich.console import Console
from rich.table import Table

import fusion
import models
from models.demo import save_model_file
from models.norms import GALLERY
from normexport import precision, report, runtime
from normexport.arguments import options_from_args
from normexport.bench.results import Machine
from normexport.cli import build_parser
from normexport.errors import one_line
from normexport.io import files
from normexport.io.export import export_module
from normexport.io.inputs import id_ranges, input_sets
from normexport.latency.measure import time_interleaved
from normexport.pipeline.prepare import by_feed_name, prepare
from normexport.verdict import blocks, hidden_probe, oracle, parity

#: Gallery entries benchmarked (dynamo exporter, opset 18).
GALLERY_CASES = (
    "ln_var_div_eps1e-8",
    "ln_pow_reciprocal",
    "ln_mul_rsqrt_weight_only",
    "ln_unbiased_var",
    "ln_eps_outside_sqrt",
    "rms_llama",
    "rms_t5",
    "rms_div_sqrt",
    "rms_eps_outside_sqrt",
    "bn_conv2d",
    "bn_linear",
    "bn_head_avgpool",
)
GALLERY_OPSET = 18
#: Converter name -> what it runs (for the JSON).
CONVERTERS = {
    "float32": "the float32 model before any converter (size and latency baseline)",
    "onnxconverter_common": "onnxconverter_common.float16.convert_float_to_float16(model)",
    "ort_float16": "onnxruntime.transformers.float16.convert_float_to_float16(model)",
    "onnxslim_fp16": 'onnxslim.slim(model, dtype="fp16")',
    "normexport": "fusion.optimize(model); normexport.precision.to_half (--precision fp16)",
    "normexport_target_onnx": (
        "the same with --target onnx: default-domain ops only, so that onnx.reference runs it"
    ),
}


def _onnxconverter_common(raw: Path, out: Path) -> None:
    from onnxconverter_common import float16

    onnx.save(float16.convert_float_to_float16(onnx.load(raw)), out)


def _ort_float16(raw: Path, out: Path) -> None:
    from onnxruntime.transformers import float16

    onnx.save(float16.convert_float_to_float16(onnx.load(raw)), out)


def _onnxslim_fp16(raw: Path, out: Path) -> None:
    import onnxslim

    onnx.save(onnxslim.slim(onnx.load(raw), dtype="fp16"), out)


def _normexport(raw: Path, out: Path, target: str = "ort") -> None:
    model = ir.load(raw)
    found = fusion.optimize(model, target=target)
    optimized = out.with_name("optimized.onnx")
    files.save_model(model, optimized, external_data=False)
    precision.to_half(
        optimized,
        out,
        provider="cpu",
        keep_io_types=False,
        refused=found.refused,
        external_data=False,
    )


BUILDERS: dict[str, Callable[[Path, Path], None]] = {
    "onnxconverter_common": _onnxconverter_common,
    "ort_float16": _ort_float16,
    "onnxslim_fp16": _onnxslim_fp16,
    "normexport": _normexport,
    "normexport_target_onnx": lambda raw, out: _normexport(raw, out, target="onnx"),
}


def build(raw: Path, folder: Path) -> dict[str, Path | str]:
    """Each converter's model of the float32 model at ``raw``: name -> path, or the error."""
    out: dict[str, Path | str] = {"float32": raw}
    for name, builder in BUILDERS.items():
        path = folder / f"{name}.onnx"
        try:
            with warnings.catch_warnings():  # onnxconverter-common warns for each clamped value
                warnings.simplefilter("ignore")
                builder(raw, path)
        except Exception as err:  # a converter that fails is a result
            out[name] = one_line(err)
        else:
            out[name] = path
    return out


def _errors(outs: list[np.ndarray], ref: list[np.ndarray]) -> dict:
    """NaN/Inf count over the outputs and the worst relative L2 error of a finite output."""
    nonfinite = sum(int(np.count_nonzero(~np.isfinite(o))) for o in outs)
    rel = []
    for got, want in zip(outs, ref, strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            rel.append(float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)))
    return {"nonfinite": nonfinite, "rel_l2": max(rel)}


def _reference_run(path: Path, feeds: dict) -> tuple[list[np.ndarray], int]:
    """``path`` on ``onnx.reference`` (float16 computed in float16, norms' statistics in their
    ``stash_type``), feeds cast like ORT's: its outputs, and how many NaN / +Inf values its
    intermediate float tensors hold (an overflow the outputs may hide: ``1 / sqrt(inf)`` is 0;
    -Inf is left out, attention masks hold it by design)."""
    model = onnx.load(path)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    feeds = {
        k: v.astype(np.float16) if types.get(k) == onnx.TensorProto.FLOAT16 else v
        for k, v in feeds.items()
    }
    evaluator = ReferenceEvaluator(model, new_ops=reference_kernels.reference_ops())
    with np.errstate(all="ignore"):
        values = evaluator.run(None, feeds, intermediate=True)
    inside = sum(
        int(np.count_nonzero(np.isnan(v) | (v == np.inf)))
        for v in values.values()
        if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating)
    )
    return [values[o.name] for o in model.graph.output], inside


def measure(
    built: dict[str, Path | str], sets: dict[str, dict], ref: dict, args, on_reference: bool
) -> dict:
    """Errors per input set (ORT CPU, and ``onnx.reference`` where asked), size and latency of
    each converter's model."""
    result, sessions = {}, {}
    for name, path in built.items():
        if isinstance(path, str):
            result[name] = {"error": path}
            continue
        try:
            session = runtime.make_session(path, "cpu", spinning=False, threads=args.threads)
        except Exception as err:  # ORT rejecting a converter's model is a result
            result[name] = {"error": one_line(err)}
            continue
        sessions[name] = session
        row = {"bytes": precision.model_bytes(path), "sets": {}}
        for set_name, feeds in sets.items():
            outs = session.run(None, precision.cast_feeds(session, feeds))
            row["sets"][set_name] = _errors(outs, ref[set_name])
            if on_reference:
                try:
                    outs, inside = _reference_run(path, feeds)
                    row["sets"][set_name]["reference"] = _errors(outs, ref[set_name])
                    row["sets"][set_name]["reference"]["overflow_inside"] = inside
                except Exception as err:  # no reference kernel for an op (com.microsoft)
                    row["sets"][set_name]["reference"] = {"error": one_line(err)[:200]}
        result[name] = row
    feeds = next(iter(sets.values()))
    calls = {
        n: (lambda s=s: s.run(None, precision.cast_feeds(s, feeds))) for n, s in sessions.items()
    }
    timings = time_interleaved(calls, warmup=3, min_runs=10, budget_s=args.budget)
    for name, timing in timings.items():
        result[name]["latency"] = timing.to_dict()
    return result


def _oracle_outputs(raw: Path, sets: dict, work: Path, loaded=None) -> dict:
    """The float64 oracle's outputs on every input set: the PyTorch model in float64 where
    there is one (``loaded``), else the float32 ONNX model with its tensors in float64 (as
    ``normexport`` chooses its oracle, :mod:`normexport.verdict.oracle`)."""
    found, example = None, next(iter(sets.values()))
    if loaded is not None and loaded.module is not None:
        found = oracle.pytorch_float64(loaded, example, list(example))
    if found is None or found.run is None:
        session = runtime.make_session(raw, "cpu", optimization_level=runtime.AS_WRITTEN)

        def as_written(feeds):
            return runtime.run(session, feeds)

        found = oracle.onnx_float64(raw, as_written, example, work, "the float32 model")
    if found.run is None:
        raise RuntimeError(f"no float64 oracle: {found.notes}")
    return {name: found.run(feeds) for name, feeds in sets.items()}


def _sets(example: dict[str, np.ndarray], raw: ir.Model | None = None) -> dict[str, dict]:
    """A random input set (token ids within ``raw``'s embedding tables) and the overflow
    probe; ``example`` keyed by the graph's input names."""
    ranges = id_ranges(raw) if raw is not None else None
    random = input_sets(example, n_random=1, id_ranges=ranges)["random_0"]
    return {"random": random, **precision.overflow_set(example)}


def gallery_case(name: str, args, work: Path) -> dict:
    """One gallery entry, exported by the dynamo exporter at :data:`GALLERY_OPSET`."""
    entry = next(e for e in GALLERY if e.name == name)
    example = entry.example()
    raw = export_module(
        entry.build(), (example,), opset=GALLERY_OPSET, input_names=["x"], exporter="dynamo"
    ).model
    path = work / "raw.onnx"
    files.save_model(raw, path, external_data=False)
    sets = _sets({"x": example.numpy()})
    ref = _oracle_outputs(path, sets, work)
    return measure(build(path, work), sets, ref, args, on_reference=True)


def demo_case(name: str, args, work: Path) -> dict:
    """One demo model, saved and exported the way ``make demo`` does."""
    zoo = models.load(name)
    path, flags = save_model_file(zoo, work)
    inputs = work / "inputs.npz"
    np.savez(inputs, **zoo.inputs)
    argv = [str(path), "--inputs", str(inputs), *flags]
    opts = options_from_args(build_parser().parse_args(argv))
    prepared = prepare(opts)
    raw = work / "raw.onnx"
    files.save_model(prepared.raw, raw, external_data=False)
    names = [v.name for v in prepared.raw.graph.inputs if not v.is_initializer()]
    sets = _sets(by_feed_name(prepared.example, names), prepared.raw)
    ref = _oracle_outputs(raw, sets, work, prepared.loaded)
    built = build(raw, work)
    result = measure(built, sets, ref, args, on_reference=False)
    lookups = hidden_probe.embedding_lookups(prepared.raw)
    if precision.OVERFLOW_PROBE not in sets and lookups:
        _hidden_probe(built, lookups, sets["random"], result, work / "hidden", args)
    return result


def _hidden_probe(
    built: dict, lookups: list, example: dict, result: dict, work: Path, args
) -> None:
    """The overflow probe of a token-id model (:mod:`normexport.verdict.hidden_probe`): each model
    cut at its embedding lookups, fed hidden states with outliers, against the float32 model cut
    there in float64; into ``result``'s rows (``error_hidden_probe`` where a cut fails)."""
    work.mkdir()
    values = [lookup.value for lookup in lookups]
    cut: dict[str, Path | str] = {}
    for name, path in built.items():
        if isinstance(path, Path) and "sets" in result[name]:
            cut[name] = work / f"{name}.onnx"
            try:
                files.save_model(blocks.cut(path, values), cut[name], external_data=True)
            except ValueError as err:  # a converter renamed or folded the lookup
                result[name]["error_hidden_probe"] = one_line(err)
                del cut[name]
    read = {v.name for v in ir.load(cut["float32"]).graph.inputs}
    feeds = hidden_probe.hidden_states(lookups, example)
    sets = {precision.OVERFLOW_PROBE: {k: v for k, v in feeds.items() if k in read}}
    ref = _oracle_outputs(cut["float32"], sets, work)
    for name, row in measure(cut, sets, ref, args, on_reference=True).items():
        row_sets = result[name].setdefault("sets", {})
        row_sets.update(row.get("sets", {}))
        if "error" in row:
            result[name]["error_hidden_probe"] = row["error"]


def _cell(row: dict, set_name: str, key: str | None = None) -> str:
    if "error" in row:
        return "E"
    found = row["sets"].get(set_name)
    if found is None:
        return "n/a"
    if key and key not in found:
        return "-"
    found = found[key] if key else found
    if "error" in found:
        return "E"
    bad = f"[bold red]{found['nonfinite']} NaN/Inf[/] " if found["nonfinite"] else ""
    inside = found.get("overflow_inside")
    inner = f" [red]({inside} inside)[/]" if inside else ""
    return f"{bad}{found['rel_l2']:.2g}{inner}"


def render(results: dict, console: Console) -> None:
    """One line per (case, converter): errors, onnx.reference's on the probe, size, latency."""
    table = Table(title="float16 converters (ORT CPU; rel L2 vs float64 oracle)")
    for col in ("case", "converter", "random", "probe", "probe onnx.reference", "KiB", "ms"):
        table.add_column(col, justify="left" if col in ("case", "converter") else "right")
    for case, rows in results.items():
        for conv, row in rows.get("converters", {}).items():
            ms = row.get("latency", {}).get("median_ms")
            table.add_row(
                case,
                conv,
                _cell(row, "random"),
                _cell(row, precision.OVERFLOW_PROBE),
                _cell(row, precision.OVERFLOW_PROBE, "reference") if row.get("sets") else "",
                f"{row['bytes'] / 1024:.0f}" if "bytes" in row else "",
                f"{ms:.3g}" if ms else "",
            )
        if "error" in rows:
            table.add_row(case, "[red]error[/]", rows["error"][:60], "", "", "", "")
    console.print(table)


def _error_panel(ax, results: dict, cases: list[str], set_name: str, key: str | None) -> None:
    """Bars of each converter's worst relative L2 error on ``set_name`` (``key``: the
    ``onnx.reference`` run), NaN / Inf hatched at 1."""
    width = 0.8 / len(CONVERTERS)
    for i, conv in enumerate(CONVERTERS):
        xs, ys, bad = [], [], []
        for j, case in enumerate(cases):
            found = results[case]["converters"][conv].get("sets", {}).get(set_name, {})
            found = found.get(key, {}) if key else found
            if "rel_l2" in found:
                xs.append(j + i * width)
                ys.append(1.0 if found["nonfinite"] else max(found["rel_l2"], 1e-8))
                bad.append(found["nonfinite"] > 0)
        bars = ax.bar(xs, ys, width, label=conv)
        for bar, b in zip(bars, bad, strict=True):
            if b:
                bar.set_hatch("xx")
    ax.axhline(parity.FP16_MAX_REL_L2, color="black", linewidth=1, linestyle="--")
    ax.set_yscale("log")
    ax.set_ylabel("rel L2 vs float64\n(hatched: NaN/Inf)")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases, rotation=30, ha="right")


def chart(results: dict, path: Path) -> None:
    """Errors per case and converter (random inputs and the overflow probe on ORT CPU, the probe
    on onnx.reference; the dashed line is the parity bound), and latency relative to
    normexport's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c, r in results.items() if "converters" in r]
    fig, axes = plt.subplots(4, 1, figsize=(max(9, 0.8 * len(cases)), 15))
    panels = (
        ("random inputs, ORT CPU", "random", None),
        ("overflow probe, ORT CPU", precision.OVERFLOW_PROBE, None),
        ("overflow probe, onnx.reference (float16 as written, norms in stash_type)",
         precision.OVERFLOW_PROBE, "reference"),
    )  # fmt: skip
    for ax, (title, set_name, key) in zip(axes[:3], panels, strict=True):
        _error_panel(ax, results, cases, set_name, key)
        ax.set_title(title)
    ax, width = axes[3], 0.8 / len(CONVERTERS)
    for i, conv in enumerate(CONVERTERS):
        xs, ys = [], []
        for j, case in enumerate(cases):
            rows = results[case]["converters"]
            mine, base = rows[conv].get("latency"), rows["normexport"].get("latency")
            if mine and base:
                xs.append(j + i * width)
                ys.append(mine["median_ms"] / base["median_ms"])
        ax.bar(xs, ys, width, label=conv)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_ylabel("CPU latency / normexport's\n(median)")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases, rotation=30, ha="right")
    axes[0].legend(fontsize=7, ncol=5)
    fig.tight_layout()
    files.save_figure(fig, path)


def _versions() -> dict:
    out = {}
    for dist in ("onnxconverter-common", "onnxslim", "onnxruntime-gpu", "onnxruntime", "onnx"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every case; write ``precision_cpu.json`` / ``.png``."""
    p = argparse.ArgumentParser(prog="python benchmarks/precision.py", description=__doc__)
    p.add_argument("--only", help="comma-separated gallery entries / zoo names (default: all)")
    p.add_argument("--threads", type=int, default=1, help="ORT intra-op threads")
    p.add_argument("--budget", type=float, default=2.0, help="timing seconds per case")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    console = Console(highlight=False, width=200)
    cases = [(n, gallery_case) for n in GALLERY_CASES] + [(n, demo_case) for n in models.ZOO]
    only = set(args.only.split(",")) if args.only else None
    results = {}
    for name, run in cases:
        if only and name not in only:
            continue
        console.print(f"[bold]{name}[/]")
        with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
            try:
                results[name] = {"converters": run(name, args, Path(tmp))}
            except Exception as err:  # e.g. a data wheel not installed: the others still run
                results[name] = {"error": one_line(err)}
    render(results, console)
    machine = Machine.probe("cpu").to_dict() | {"threads": args.threads}
    machine["versions_fp16"] = _versions()
    data = {"machine": machine, "converters": CONVERTERS, "cases": results}
    report.write_json(data, args.out / "precision_cpu.json")
    chart(results, args.out / "precision_cpu.png")
    console.print(f"wrote {args.out / 'precision_cpu.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
