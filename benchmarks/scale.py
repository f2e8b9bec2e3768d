"""Memory and time of normexport on large models: per stage, and against ONNX Runtime's own
offline optimizer on the same file.

Builds LLaMA-architecture decoders (transformers ``LlamaModel``, random weights, RMSNorm
scales randomized) in a temporary folder, deleted afterwards, exports each the way users do
(``torch.onnx.export`` with its defaults: dynamo, external data) and measures, each in a fresh
process so that nothing from the build or export is counted:

- normexport's stages on the file, in the order the CLI runs them: ``load`` (``onnx_ir.load``,
  lazy), ``optimize`` (:func:`fusion.optimize`, target ort), ``save`` (with external data,
  :func:`normexport.io.files.save_model`), ``check`` (:func:`fusion.check` on the saved file) and
  ``sessions`` (the two ONNX Runtime sessions parity opens: input and output, optimizations
  off); wall time (s) and peak resident memory (bytes) of each stage, the peak reset between
  stages (``/proc/self/clear_refs``), and the peak over load + optimize + save + check;
- ONNX Runtime's offline optimizer on the same file (an ORT_ENABLE_ALL CPU session writing its
  optimized model with external data), wall time and peak RSS;
- for the largest model, the whole CLI run (``normexport MODEL --no-benchmark --provider cpu``)
  in a subprocess: exit code, wall time, peak RSS.

Two families: ``layers`` (hidden 64, 2 to 128 layers: does time per node stay flat?) and
``1b`` (hidden 2048, 22 layers, intermediate 5632, 32 heads sharing 4 key/value heads, vocabulary
32000: TinyLlama's shape, 1.03 B parameters, 4.1 GB of float32 weights).

    python benchmarks/scale.py [--layers 2,8,32,128] [--no-1b] [--out benchmarks/results]

Writes ``scale.json`` and ``scale.png``. Needs about 20 GB of memory and of disk for the 1 B
model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}
LLAMA_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
LAYERS_1B = 22
SEQ = 16


def _peak_rss() -> int:
    """The process's peak resident set since the last reset, in bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    """Reset the peak-RSS mark to the current RSS (Linux: ``clear_refs`` 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _stage(results: dict, name: str, fn):
    resettable = _reset_peak()
    start = time.perf_counter()
    value = fn()
    results[name] = {
        "wall_s": time.perf_counter() - start,
        "peak_rss_bytes": _peak_rss(),
        "peak_reset": resettable,
    }
    return value


def run_stages(model_path: Path, out_dir: Path) -> dict:
    """normexport's stages on ``model_path`` in this process (see the module docstring)."""
    import onnx_ir as ir
    import onnxruntime as ort

    import fusion
    from normexport import runtime
    from normexport.io import files

    out = out_dir / "model.opt.onnx"
    results: dict = {"baseline_rss_bytes": _peak_rss()}
    _reset_peak()
    start = time.perf_counter()
    held = {"model": _stage(results, "load", lambda: ir.load(model_path))}
    nodes = len(held["model"].graph)
    report = _stage(results, "optimize", lambda: fusion.optimize(held["model"], target="ort"))
    _stage(results, "save", lambda: files.save_model(held["model"], out, external_data=True))
    _stage(results, "check", lambda: fusion.check(out))
    results["load_to_check"] = {
        "wall_s": sum(results[s]["wall_s"] for s in ("load", "optimize", "save", "check")),
        "peak_rss_bytes": max(results[s]["peak_rss_bytes"] for s in ("load", "optimize", "save")),
    }
    results["load_to_check"]["peak_rss_bytes"] = max(
        results["load_to_check"]["peak_rss_bytes"], results["check"]["peak_rss_bytes"]
    )
    del held["model"]
    off = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    _stage(
        results,
        "sessions",
        lambda: [runtime.make_session(p, "cpu", optimization_level=off) for p in (model_path, out)],
    )
    results["total_s"] = time.perf_counter() - start
    results["nodes"] = nodes
    results["fusions"] = {k: v for k, v in report.counts.items() if v}
    return results


def run_ort_offline(model_path: Path, out_dir: Path) -> dict:
    """ONNX Runtime's offline optimizer on ``model_path`` in this process."""
    from normexport import runtime

    baseline = _peak_rss()
    _reset_peak()
    start = time.perf_counter()
    runtime.make_session(model_path, "cpu", optimized_model_path=str(out_dir / "ort.onnx"))
    return {
        "wall_s": time.perf_counter() - start,
        "peak_rss_bytes": _peak_rss(),
        "baseline_rss_bytes": baseline,
    }


def _in_subprocess(kind: str, model_path: Path, out_dir: Path) -> dict:
    """Run :func:`run_stages` or :func:`run_ort_offline` in a fresh Python process."""
    result = subprocess.run(
        [sys.executable, __file__, f"--_{kind}", str(model_path), str(out_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _cli(model_path: Path, out_dir: Path) -> dict:
    """The whole CLI run (parity included, latency off) in a subprocess."""
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = subprocess.run(
        [sys.executable, "-m", "normexport", str(model_path)]
        + ["-o", str(out_dir / "cli.opt.onnx"), "--no-benchmark", "--provider", "cpu"],
        capture_output=True,
        text=True,
    )
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "exit_code": result.returncode,
        "wall_s": time.perf_counter() - start,
        # ru_maxrss of children is the largest child so far: exact when it is this one.
        "peak_rss_bytes": peak * 1024 if peak > before else None,
        "last_line": (result.stdout.strip() or result.stderr.strip()).splitlines()[-1],
    }


def build_and_export(config: dict, layers: int, folder: Path) -> tuple[Path, int, int]:
    """Export a random-weight LlamaModel of ``layers`` layers to ``folder/model.onnx`` (+ its
    external data) with torch.onnx.export's defaults.

    Returns:
        ``(path, parameters, weight bytes of the ONNX file)``.
    """
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**config, num_hidden_layers=layers, use_cache=False)
    model = transformers.LlamaModel(cfg).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.weight.copy_(1.0 + 0.5 * torch.randn(module.weight.shape))

    class Hidden(torch.nn.Module):  # the last hidden state, a tensor, not a ModelOutput
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).last_hidden_state

    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config["vocab_size"], (1, SEQ))
    path = folder / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(Hidden(model).eval(), (ids,), str(path), input_names=["input_ids"])
    data = path.with_name(path.name + ".data")
    return path, params, data.stat().st_size if data.exists() else path.stat().st_size


def measure(name: str, config: dict, layers: int, cli: bool) -> dict:
    """Build, export and measure one model; its folder is deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"scale-{name}-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        path, params, weight_bytes = build_and_export(config, layers, folder)
        entry = {
            "name": name,
            "layers": layers,
            "parameters": params,
            "weight_bytes": weight_bytes,
            "export_s": time.perf_counter() - start,
        }
        print(f"{name}: {params / 1e6:.1f} M parameters, exported", file=sys.stderr)
        for kind in ("stages", "ort_offline"):
            out = folder / kind
            out.mkdir()
            entry[kind] = _in_subprocess(kind, path, out)
            print(f"{name}: {kind} done", file=sys.stderr)
        if cli:
            entry["cli"] = _cli(path, folder)
        stages = entry["stages"]
        entry["optimize_us_per_node"] = stages["optimize"]["wall_s"] / stages["nodes"] * 1e6
        entry["load_to_check_rss_over_weights"] = (
            stages["load_to_check"]["peak_rss_bytes"] / weight_bytes
        )
        entry["ort_offline_rss_over_weights"] = (
            entry["ort_offline"]["peak_rss_bytes"] / weight_bytes
        )
        entry["load_to_check_s_over_ort_offline"] = (
            stages["load_to_check"]["wall_s"] / entry["ort_offline"]["wall_s"]
        )
        return entry


def write_chart(result: dict, path: Path) -> None:
    """Per-stage time and peak RSS of the largest model beside ORT's offline optimizer, and
    optimize time per node against layer count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from normexport.io.files import save_figure

    models = result["models"]
    big = max(models, key=lambda m: m["parameters"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = ["load", "optimize", "save", "check", "sessions"]
    stages = big["stages"]
    labels = [*names, "ORT offline"]
    walls = [stages[n]["wall_s"] for n in names] + [big["ort_offline"]["wall_s"]]
    rss = [stages[n]["peak_rss_bytes"] / 2**30 for n in names]
    rss.append(big["ort_offline"]["peak_rss_bytes"] / 2**30)
    colors = ["tab:blue"] * len(names) + ["tab:gray"]
    axes[0].bar(labels, walls, color=colors)
    axes[0].set_ylabel("wall time (s)")
    axes[1].bar(labels, rss, color=colors)
    axes[1].axhline(big["weight_bytes"] / 2**30, color="k", ls="--", label="weights")
    axes[1].axhline(1.5 * big["weight_bytes"] / 2**30, color="r", ls=":", label="1.5x weights")
    axes[1].set_ylabel("peak RSS (GiB)")
    axes[1].legend()
    for ax in axes[:2]:
        ax.set_title(f"{big['name']}: {big['parameters'] / 1e9:.2f} B parameters")
        ax.tick_params(axis="x", rotation=30)
    small = sorted((m for m in models if m["name"].startswith("layers")), key=lambda m: m["layers"])
    axes[2].plot([m["layers"] for m in small], [m["optimize_us_per_node"] for m in small], "o-")
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("layers (hidden 64)")
    axes[2].set_ylabel("optimize time per node (µs)")
    axes[2].set_ylim(bottom=0)
    axes[2].set_title("fusion.optimize scaling")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="2,8,32,128", help="layer counts of the hidden-64 family")
    p.add_argument("--no-1b", action="store_true", help="skip the 1 B-parameter model")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--_stages", nargs=2, type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_ort_offline", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._stages:
        print(json.dumps(run_stages(*args._stages)))
        return 0
    if args._ort_offline:
        print(json.dumps(run_ort_offline(*args._ort_offline)))
        return 0

    import onnxruntime
    import torch

    from normexport import report

    models = []
    result = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "seq": SEQ,
        "models": models,
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after each model: a later failure keeps what was measured
        report.write_json(result, args.out / "scale.json")

    for layers in (int(n) for n in args.layers.split(",") if n):
        models.append(measure(f"layers{layers}", LLAMA_SMALL, layers, cli=False))
        save()
    if not args.no_1b:
        models.append(measure("llama-1b", LLAMA_1B, LAYERS_1B, cli=True))
        save()
    write_chart(result, args.out / "scale.png")
    for m in models:
        s = m["stages"]
        print(
            f"{m['name']:>10}: {m['parameters'] / 1e6:8.1f} M params, {s['nodes']} nodes; "
            f"load..check {s['load_to_check']['wall_s']:.1f} s at "
            f"{m['load_to_check_rss_over_weights']:.2f}x weights RSS; ORT offline "
            f"{m['ort_offline']['wall_s']:.1f} s at {m['ort_offline_rss_over_weights']:.2f}x; "
            f"optimize {m['optimize_us_per_node']:.0f} us/node"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
