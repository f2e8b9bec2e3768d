"""``normexport bench`` over every model of the zoo (:data:`models.ZOO`), on one provider.

Each model is saved the way ``make demo`` saves it (:func:`models.demo.save_model_file`: a
pickled module, a state_dict, TorchScript, a torch.export program or the shipped .onnx) with
its real example inputs, then ``normexport bench`` runs on it in this process with a batch
sweep (``--batch`` plus the example's own batch) and, for the sequence models (a symbolic axis 1:
minilm, llama-tiny), a sequence-length sweep (``--seq``) as a cross (the batches at the first
length, the lengths at batch 1), with a fixed timing budget per model. Writes
``demo_<model>_<provider>.json`` / ``.png`` per model and ``demo_models_<provider>.json`` /
``.png`` (a summary: each variant's time over normexport's at every batch) to ``--out``, and
prints the summary table. The summary covers
every zoo model with a result file in ``--out``, so one model can be re-run with ``--only``.

Issue 4's target: on every model, normexport is never slower than the best other optimizer's
variant by more than the spread (the 95% interval of the paired ratio reaches 1).

    python benchmarks/demo_models.py [--provider auto] [--batch 1,8,64] [--seq 16,128,512]
                                     [--budget 30] [--min-runs 10] [--only a,b]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import models
from models.demo import save_model_file
from normexport import report, runtime
from normexport.bench import command
from normexport.bench.measure import EAGER
from normexport.bench.render import fmt_ratio
from normexport.bench.results import Machine
from normexport.errors import UsageError
from normexport.io.files import save_figure


def bench_zoo_model(name: str, args: argparse.Namespace, console: Console) -> dict:
    """Save zoo model ``name`` to a file and run ``normexport bench`` on it; return its JSON."""
    zoo = models.load(name)
    provider, _ = runtime.resolve_provider(args.provider)
    stem = f"demo_{name}_{provider}"
    with tempfile.TemporaryDirectory() as tmp:
        path, flags = save_model_file(zoo, Path(tmp))
        inputs = Path(tmp) / "inputs.npz"
        np.savez(inputs, **zoo.inputs)
        own = next(iter(zoo.inputs.values())).shape[0]
        batches = sorted({*(int(b) for b in args.batch.split(",")), own})
        sequence = any(1 in axes for axes in (zoo.dynamic_axes or {}).values())
        argv = [
            str(path), "--inputs", str(inputs), *flags, "--provider", args.provider,
            "--batch", ",".join(map(str, batches)), "--budget", str(args.budget),
            "--min-runs", str(args.min_runs),
            *(["--seq", args.seq, "--sweep", "cross"] if sequence and args.seq else []),
            "--json", str(args.out / f"{stem}.json"), "--chart", str(args.out / f"{stem}.png"),
        ]  # fmt: skip
        console.rule(f"normexport bench {name}")
        command.run(command.build_parser().parse_args(argv), console)
    return json.loads((args.out / f"{stem}.json").read_text())


def summary_rows(results: dict[str, dict]) -> list[dict]:
    """One row per (model, point): median ms per variant, and normexport against the best other
    optimizer's variant (paired ratio, 95% interval, within the spread or not)."""
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append({"model": name, "error": r["error"]})
            continue
        for p in r["points"]:
            vs = p["normexport_vs_best"]
            rows.append(
                {
                    "model": name,
                    "inputs": p["inputs"],
                    "seq": p.get("seq"),
                    "median_ms": {k: t["median_ms"] for k, t in p["latency_ms"].items()},
                    "ratio_to_normexport": p["ratio_to_normexport"],
                    "errors": p["errors"],
                    "normexport_vs_best": vs,
                }
            )
    return rows


def print_summary(rows: list[dict], provider: str, console: Console) -> None:
    """The summary table: ms per variant, and normexport / best other with its interval."""
    names = list(dict.fromkeys(k for row in rows for k in row.get("median_ms", {})))
    table = Table(title=f"demo models on {provider}: median ms per call; normexport / best other")
    for col in ("model", "inputs", *names, "normexport / best", "within spread"):
        table.add_column(col, justify="left" if col in ("model", "inputs") else "right")
    for row in rows:
        if "error" in row:
            table.add_row(row["model"], row["error"], *[""] * (len(names) + 2))
            continue
        vs = row["normexport_vs_best"]
        shapes = " ".join("x".join(map(str, s)) for s in row["inputs"].values())
        table.add_row(
            row["model"],
            shapes,
            *[_ms_cell(row, n) for n in names],
            f"{fmt_ratio(vs['ratio'])} vs {vs['best_other']}" if vs else "-",
            ("yes" if vs["within_spread"] else "NO") if vs else "-",
        )
    console.print(table)


def _ms_cell(row: dict, name: str) -> str:
    """A variant's median ms; "err" if it failed, "-" if it was not run (no PyTorch model)."""
    if name in row["median_ms"]:
        return f"{row['median_ms'][name]:.3f}"
    return "err" if name in row["errors"] else "-"


def main(argv: list[str] | None = None) -> int:
    """Bench every zoo model; write per-model and summary JSON + PNG."""
    p = argparse.ArgumentParser(prog="python benchmarks/demo_models.py", description=__doc__)
    p.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--batch", default="1,8,64", help="batch sizes to sweep")
    p.add_argument("--seq", default="16,128,512", help="sequence lengths (sequence models)")
    p.add_argument("--budget", type=float, default=30.0, help="timing seconds per model")
    p.add_argument("--min-runs", type=int, default=10, help="timed rounds per point at least")
    p.add_argument("--only", help="comma-separated zoo names (default: all)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    console = Console(highlight=False, width=200)
    provider, _ = runtime.resolve_provider(args.provider)
    results = {}
    for name in args.only.split(",") if args.only else models.ZOO:
        try:
            results[name] = bench_zoo_model(name, args, console)
        except (UsageError, FileNotFoundError) as err:  # e.g. a data wheel not installed
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            console.print(f"[red]{name}: {err}[/]")
    for name in models.ZOO:  # earlier runs' results for the models not run this time
        earlier = args.out / f"demo_{name}_{provider}.json"
        if name not in results and earlier.exists():
            results[name] = json.loads(earlier.read_text())
    results = {name: results[name] for name in models.ZOO if name in results}
    rows = summary_rows(results)
    print_summary(rows, runtime.PROVIDERS[provider][0], console)
    stem = args.out / f"demo_models_{provider}"
    machine = Machine.probe(provider).to_dict()
    report.write_json({"machine": machine, "rows": rows}, stem.with_suffix(".json"))
    _chart(rows, runtime.PROVIDERS[provider][0], stem.with_suffix(".png"))
    console.print(f"wrote {stem}.json and .png")
    return 0


def _chart(rows: list[dict], provider: str, path: Path) -> None:
    """Each variant's time over normexport's (median, 95% CI) per model and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    shapes = [next(iter(r["inputs"].values())) for r in rows]  # batch is axis 0, seq axis 1
    labels = [
        f"{r['model']} b{shape[0]}" + (f" s{shape[1]}" if r.get("seq") else "")
        for r, shape in zip(rows, shapes, strict=True)
    ]
    names = list(dict.fromkeys(k for r in rows for k in r["ratio_to_normexport"]))
    names = [n for n in names if n != EAGER] + [n for n in names if n == EAGER]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        med, lo, hi, xs = [], [], [], []
        for j, r in enumerate(rows):
            q = r["ratio_to_normexport"].get(n)
            if q:
                xs.append(j + i * width)
                med.append(q["median"])
                lo.append(q["median"] - q["ci_low"])
                hi.append(q["ci_high"] - q["median"])
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=n)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels, rotation=35, ha="right")
    ax.set_ylabel(f"time / normexport's (median, 95% CI), {provider}")
    ax.set_title("demo models: > 1 means slower than normexport")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
