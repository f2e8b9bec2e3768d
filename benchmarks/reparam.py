"""Re-parameterizable models as users export them, against timm's own re-parameterization.

For each of timm's ``repvgg_a0``, ``mobileone_s0``, ``repvit_m0_9`` and ``fastvit_t8``
(random weights, every BatchNorm statistic and affine parameter randomized, eval mode), three
ONNX files at 1x3x160x160:

- ``raw``: the model in its train form (not re-parameterized) exported with
  ``torch.onnx.export(model, (x,), path)``'s defaults, as a user who forgot, or could not run,
  the model's re-parameterize step has it;
- ``normexport``: ``normexport raw.onnx`` (the pipeline as the CLI runs it, without latency);
- ``timm``: the same weights after ``timm.utils.model.reparameterize_model``, exported the same
  way: the ceiling.

Per model: nodes, Conv and BatchNormalization counts, normexport's parity verdict (against the
raw file in float64) and merges, and latency on ONNX Runtime's CPU provider (ORT_ENABLE_ALL, as
deployed, 2 intra-op threads, interleaved), with each variant's per-round paired time ratio to
timm's and its 95% interval. Issue 22's targets: no BatchNormalization left, nodes within 5% of
timm's, latency within 1.05x of it, parity passed. Writes ``reparam_cpu.json`` and
``reparam_cpu.png``.

timm is imported from ``{sys.prefix}/timm``, where ``make bench`` installs it with torchvision
outside the virtual environment's site-packages (:mod:`outside` says why, and defines the two
op schemas torchvision's import needs).

    python benchmarks/reparam.py [--only mobileone_s0] [--budget 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import outside
import torch
from rich.console import Console
from rich.table import Table

import normexport
from normexport import runtime
from normexport.io.files import save_figure
from normexport.io.quiet import quiet, quiet_torch, swallow_prints
from normexport.latency.measure import paired_ratio, time_interleaved

MODELS = ("repvgg_a0", "mobileone_s0", "repvit_m0_9", "fastvit_t8")
SHAPE = (1, 3, 160, 160)
THREADS = 2
VARIANTS = ("raw", "normexport", "timm")


def import_timm():
    """timm, from ``{sys.prefix}/timm`` (:func:`outside.use`), and its re-parameterization."""
    outside.use("timm")
    import timm
    from timm.utils.model import reparameterize_model

    return timm, reparameterize_model


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` in eval mode, every BatchNorm's statistics and affine parameters random."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=generator) * 2 - 1)
                m.running_var.copy_(torch.rand(n, generator=generator) * 1.5 + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(n, generator=generator) + 0.5)
                    m.bias.copy_(torch.rand(n, generator=generator) - 0.5)
    return model.eval()


def export(model: torch.nn.Module, args: tuple, path: Path) -> None:
    """``torch.onnx.export(model, args, path)`` with its defaults (dynamo), quietly."""
    with quiet("torch.onnx"), quiet_torch(), swallow_prints("stdout", "stderr"):
        torch.onnx.export(model, args, path)


def counts(path: Path) -> dict:
    ops = collections.Counter(
        n.op_type for n in onnx.load(path, load_external_data=False).graph.node
    )
    return {
        "nodes": sum(ops.values()),
        "Conv": ops["Conv"],
        "BatchNormalization": ops["BatchNormalization"],
    }


def measure(name: str, timm, reparameterize, folder: Path, budget_s: float) -> dict:
    """One model's three files, normexport's report, and their interleaved latency."""
    torch.manual_seed(0)
    model = randomized(timm.create_model(name, pretrained=False))
    paths = {v: folder / f"{v}.onnx" for v in VARIANTS}
    export(model, (torch.randn(SHAPE),), paths["raw"])
    export(reparameterize(model), (torch.randn(SHAPE),), paths["timm"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        report = normexport.optimize(
            paths["raw"], output=paths["normexport"], benchmark=False, provider="cpu"
        ).to_dict()
    feeds = {"x": np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)}
    sessions = {
        v: runtime.make_session(p, "cpu", spinning=False, threads=THREADS) for v, p in paths.items()
    }
    name_in = {v: s.get_inputs()[0].name for v, s in sessions.items()}
    timings = time_interleaved(
        {v: (lambda s=s, n=name_in[v]: s.run(None, {n: feeds["x"]})) for v, s in sessions.items()},
        budget_s=budget_s,
    )
    parity = report["parity"]
    return {
        "counts": {v: counts(p) for v, p in paths.items()},
        "parity_passed": parity["passed"],
        "oracle": parity["oracle"],
        "worst_rel_l2": max(e["rel_l2_err"] for errs in parity["sets"].values() for e in errs),
        "reparam_merged": report["fusions"]["reparam_merged"],
        "batchnorm_folded": report["fusions"]["batchnorm_folded"],
        "refused": [r["code"] for r in report["fusions"]["refused"]],
        "latency_ms": {v: t.to_dict() for v, t in timings.items()},
        "ratio_to_timm": {v: paired_ratio(timings[v], timings["timm"]).to_dict() for v in VARIANTS},
    }


def print_table(results: dict, console: Console) -> None:
    table = Table(title=f"Re-parameterizable models, ORT CPU, {THREADS} threads, {SHAPE}")
    for col in ("model", "nodes raw / normexport / timm", "BN left", "merges", "parity",
                "raw ÷ timm", "normexport ÷ timm"):  # fmt: skip
        table.add_column(col)
    for name, r in results.items():
        c = r["counts"]
        ratio = {v: r["ratio_to_timm"][v] for v in ("raw", "normexport")}
        cells = [
            f"{x['median']:.3f} [{x['ci_low']:.3f}, {x['ci_high']:.3f}]" for x in ratio.values()
        ]
        table.add_row(
            name,
            " / ".join(str(c[v]["nodes"]) for v in VARIANTS),
            str(c["normexport"]["BatchNormalization"]),
            str(r["reparam_merged"]),
            "pass" if r["parity_passed"] else "FAIL",
            *cells,
        )
    console.print(table)


def chart(results: dict, path: Path) -> None:
    """Each variant's time over timm's per model, with the 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(results)
    for i, variant in enumerate(("raw", "normexport")):
        r = [results[n]["ratio_to_timm"][variant] for n in names]
        med = [x["median"] for x in r]
        err = [
            [m - x["ci_low"] for m, x in zip(med, r, strict=True)],
            [x["ci_high"] - m for m, x in zip(med, r, strict=True)],
        ]
        xs = np.arange(len(names)) + (i - 0.5) * 0.35
        ax.bar(xs, med, 0.35, yerr=err, label=variant, color=("#999", "#2a6")[i])
    ax.axhline(1.0, color="#c33", lw=1, label="timm's re-parameterized model")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time / timm's (median, 95% CI)")
    ax.set_title(f"ORT CPU, {THREADS} threads, input {'x'.join(map(str, SHAPE))}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Measure every model; write the JSON and the chart."""
    p = argparse.ArgumentParser(prog="python benchmarks/reparam.py", description=__doc__)
    p.add_argument("--only", help="comma-separated timm model names (default: all four)")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timed runs per model")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    timm, reparameterize = import_timm()
    torch.set_num_threads(THREADS)
    results = {}
    for name in args.only.split(",") if args.only else MODELS:
        with tempfile.TemporaryDirectory(prefix="reparam-") as tmp:
            results[name] = measure(name, timm, reparameterize, Path(tmp), args.budget)
        print(name, json.dumps({k: results[name][k] for k in ("counts", "ratio_to_timm")}))
    print_table(results, Console(width=160))
    args.out.mkdir(parents=True, exist_ok=True)
    versions = {"torch": torch.__version__, "timm": timm.__version__}
    versions["onnxruntime"] = onnxruntime.__version__
    data = {"shape": SHAPE, "threads": THREADS, "versions": versions, "models": results}
    (args.out / "reparam_cpu.json").write_text(json.dumps(data, indent=1) + "\n")
    chart(results, args.out / "reparam_cpu.png")
    print(f"wrote {args.out / 'reparam_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
