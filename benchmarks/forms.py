"""Which exact form of a norm runs fastest on one ORT provider: the measurements behind the
defaults of :mod:`normexport.autotune`.

For each shape, three groups of one-op (or two-op) models over the same float32 input, timed
interleaved in one process (:func:`normexport.latency.time_interleaved`, IO binding so that only
the op is timed), each group with its elementwise floor:

- ``rmsnorm``: an RMSNorm as RMSNormalization (opset 23) or ORT's SimplifiedLayerNormalization;
  LayerNormalization (a LayerNorm, which does more work) and Relu for scale;
- ``skip_layernorm``: residual add + LayerNorm as SkipLayerNormalization (com.microsoft) or as
  Add + LayerNormalization, the latter under ORT_ENABLE_ALL (which fuses it back into
  SkipLayerNormalization) and with ORT's SkipLayerNormFusion disabled; Add for scale;
- ``skip_rmsnorm``: residual add + RMSNorm as SkipSimplifiedLayerNormalization, Add +
  SimplifiedLayerNormalization, Add + RMSNormalization; Add for scale.

Each form also records the ops ORT really ran (after its session optimizations).

    python benchmarks/forms.py [--provider auto] [--budget 6] [--out benchmarks/results]

Writes ``forms_<provider>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from rich.console import Console
from rich.table import Table

from normexport import bench, report, runtime, variants
from normexport.autotune import SKIP_FUSION
from normexport.files import save_figure
from normexport.latency import paired_ratio, time_interleaved

SHAPES = ((4, 256, 2048), (8, 512, 768), (1, 128, 768), (32, 128, 384))
#: Group -> [(label, op form, ORT transformers disabled)]; the first entry of each group is the
#: one the others are compared with, the last the floor.
GROUPS = {
    "rmsnorm": [
        ("RMSNormalization", "RMSNormalization", ()),
        ("SimplifiedLayerNormalization", "SimplifiedLayerNormalization", ()),
        ("LayerNormalization (a LayerNorm)", "LayerNormalization", ()),
        ("Relu (floor)", "Relu", ()),
    ],
    "skip_layernorm": [
        ("SkipLayerNormalization", "SkipLayerNormalization", ()),
        ("Add+LayerNormalization (ORT_ENABLE_ALL)", "Add+LayerNormalization", ()),
        (
            "Add+LayerNormalization (SkipLayerNormFusion off)",
            "Add+LayerNormalization",
            (SKIP_FUSION,),
        ),
        ("Add (floor)", "Add", ()),
    ],
    "skip_rmsnorm": [
        ("SkipSimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", ()),
        ("Add+SimplifiedLayerNormalization", "Add+SimplifiedLayerNormalization", ()),
        ("Add+RMSNormalization", "Add+RMSNormalization", ()),
        ("Add (floor)", "Add", ()),
    ],
}


def _ran(model: bytes, provider: str, disabled: tuple[str, ...]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ran.onnx"
        runtime.make_session(
            model, provider, optimized_model_path=str(path), disabled_optimizers=disabled
        )
        return [n.op_type for n in onnx.load(path).graph.node]


def measure_group(group: str, shape: tuple[int, ...], provider: str, budget_s: float) -> dict:
    """Time one group at one shape; ratios are per-round paired, to the group's first entry."""
    runners, ran = {}, {}
    for label, form, disabled in GROUPS[group]:
        model = variants.op_model(form, shape)
        session = runtime.make_session(
            model, provider, spinning=False, disabled_optimizers=disabled
        )
        feeds = variants.op_inputs(form, shape)
        runners[label] = runtime.runner(session, feeds, io_binding=True)[0]
        ran[label] = _ran(model, provider, disabled)
    timings = time_interleaved(runners, budget_s=budget_s)
    first = GROUPS[group][0][0]
    norms = [label for label, *_ in GROUPS[group][:-1]]
    return {
        "timings_ms": {k: t.to_dict() for k, t in timings.items()},
        "ratio_to_first": {
            k: paired_ratio(t, timings[first]).to_dict() for k, t in timings.items() if k != first
        },
        "ort_ran": ran,
        "fastest": min(norms, key=lambda k: timings[k].median_ms),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure every group at every shape; write JSON + PNG; print one table per group."""
    p = argparse.ArgumentParser(prog="python benchmarks/forms.py", description=__doc__)
    p.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--budget", type=float, default=6.0, help="timing seconds per group and shape")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    console = Console(highlight=False, width=160)
    provider, note = runtime.resolve_provider(args.provider)
    if note:
        console.print(note)
    results = {
        group: {
            "x".join(map(str, shape)): measure_group(group, shape, provider, args.budget)
            for shape in SHAPES
        }
        for group in GROUPS
    }
    for group, by_shape in results.items():
        table = Table(title=f"{group}: ms per call, median [95% CI]; ratio to the first form")
        table.add_column("form")
        for shape in by_shape:
            table.add_column(shape, justify="right")
        for label, *_ in GROUPS[group]:
            cells = []
            for r in by_shape.values():
                t = r["timings_ms"][label]
                ratio = r["ratio_to_first"].get(label)
                cells.append(
                    f"{t['median_ms']:.3f} [{t['ci_low_ms']:.3f}, {t['ci_high_ms']:.3f}]"
                    + (f" {bench.fmt_ratio(ratio)}" if ratio else "")
                )
            table.add_row(label, *cells)
        console.print(table)
        for shape, r in by_shape.items():
            console.print(f"  {shape}: fastest {r['fastest']}; ORT ran {r['ort_ran']}")
    out = {
        "machine": bench.machine(provider),
        "provider": runtime.PROVIDERS[provider][0],
        "provider_note": note,
        "method": "one process, interleaved rounds in rotated order, IO binding, warm-up 5 "
        "rounds, ORT intra-op spinning off; ratios are medians of per-round ratios with 95% "
        "bootstrap intervals",
        "groups": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"forms_{provider}"
    report.write_json(out, args.out / f"{name}.json")
    _chart(results, runtime.PROVIDERS[provider][0], args.out / f"{name}.png")
    console.print(f"wrote {args.out / name}.json and .png")
    return 0


def _chart(results: dict, provider: str, path: Path) -> None:
    """Grouped bars: median ms per form (95% CI whiskers), per shape; one panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2))
    for ax, (group, by_shape) in zip(axes, results.items(), strict=True):
        labels = [label for label, *_ in GROUPS[group]]
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            med = np.array([r["timings_ms"][label]["median_ms"] for r in by_shape.values()])
            lo = med - [r["timings_ms"][label]["ci_low_ms"] for r in by_shape.values()]
            hi = [r["timings_ms"][label]["ci_high_ms"] for r in by_shape.values()] - med
            xs = np.arange(len(by_shape)) + i * width
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=label)
        ax.set_xticks(np.arange(len(by_shape)) + 0.4 - width / 2, list(by_shape), fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(f"ms per call (median, 95% CI), {provider}")
        ax.set_title(group)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
