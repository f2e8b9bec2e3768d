"""Memory and time of normexport on large models: the whole CLI per stage, ONNX Runtime's session
options, the passes alone, and ONNX Runtime's own offline optimizer on the same file.

Builds LLaMA-architecture decoders (transformers ``LlamaModel``, random weights, RMSNorm
scales randomized) in a temporary folder, deleted afterwards, exports each the way users do
(``torch.onnx.export`` with its defaults: dynamo, external data) and measures, each in a fresh
process so that nothing from the build or export is counted:

- normexport's passes on the file (in-process): ``load`` (``onnx_ir.load``, lazy),
  ``optimize`` (:func:`fusion.optimize`, target ort), ``save`` (with external data,
  :func:`normexport.io.files.save_model`), ``check`` (:func:`fusion.check` on the saved file);
  wall time (s) and peak resident memory (bytes) of each, the peak reset between them
  (``/proc/self/clear_refs``);
- ONNX Runtime's offline optimizer on the same file (an ORT_ENABLE_ALL CPU session writing its
  optimized model with external data), wall time and peak RSS;
- for the large models, the whole CLI run from another folder (``normexport MODEL -o OUT
  --provider cpu --report R.json``), parity on and latency off (``--no-benchmark``), then with
  latency: exit code, wall time, the process's peak RSS (its ``VmHWM`` at exit), and the
  report's ``cost`` (each stage's wall time and peak RSS, :mod:`normexport.progress`);
- for the large models, the user's case: the whole CLI again (``--no-benchmark``) in a memory
  cgroup limited below the weights (:data:`LIMIT`, ``--limit``), made as a container runtime
  makes one (:mod:`cgroup`, as root: at the root of the hierarchy), with the page cache warm
  (the file just written) and cold: the memory plan, parity block by block (each block's time
  and worst error), the group's peak usage and anonymous memory, and OOM kills;
- for the large models, one ONNX Runtime session under each set of options
  (:data:`SESSION_OPTIONS`): load time, first run, peak RSS with its anonymous and file-backed
  parts, in a process capped at :data:`CAP_SHARE` of the machine's memory (a set that needs
  more fails there instead of starving the machine).

Families: ``layers`` (hidden 64, 2 to 128 layers: does time per node stay flat?), ``1b``
(hidden 2048, 22 layers, intermediate 5632, 32 heads sharing 4 key/value heads, vocabulary
32000: TinyLlama's shape, 1.03 B parameters, 4.1 GB of float32 weights) and ``3b-fp16`` (hidden
3072, 30 layers, intermediate 8192, 24 heads sharing 8, vocabulary 32000: 3.1 B parameters,
6.2 GB of float16 weights), ``2.7b-fp16`` (the same with 26 layers: 2.7 B parameters, 5.4 GB),
and ``2.7b-fp16-optimizer-off``: the same model exported with the exporter's optimizer off
(``optimize=False``: a ``Transpose`` of every linear weight at run time, the ``Constant``
nodes kept), as users export it too.

``--limited-only`` measures the large models under the memory limit alone (the build, then the
CLI in the limited group, warm and cold): the other measures of a large model run it with no
limit (the CLI, ONNX Runtime's offline optimizer, the session options: several times its
weights each, ``scale.json``), too much beside other work on a shared machine.

    python benchmarks/scale.py [--layers 2,8,32,128] [--big 1b,3b-fp16,2.7b-fp16]
        [--limit 4294967296] [--limited-only] [--out benchmarks/results]

Writes ``scale.json`` and ``scale.png``. Needs about 20 GB of memory, and 25 GB of disk for
the 3 B model (its file, the optimized copy, the run's scratch folder).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
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
LLAMA_3B = {
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}
#: The large models: name -> (config, layers, weight dtype, the exporter's optimizer on).
BIG = {
    "1b": (LLAMA_1B, 22, "float32", True),
    "3b-fp16": (LLAMA_3B, 30, "float16", True),
    "2.7b-fp16": (LLAMA_3B, 26, "float16", True),
    "2.7b-fp16-optimizer-off": (LLAMA_3B, 26, "float16", False),
}
#: The memory limit (bytes) of the CLI run in a memory cgroup, below the large models' weights.
LIMIT = 4 * 2**30
SEQ = 16
#: ONNX Runtime session options measured on the large models: name -> how the session is made
#: (``level``: graph optimization level; ``prepacking``; ``priority``: the priority-based
#: execution order; ``arena``: the CPU memory arena). ``deployed`` is what latency times,
#: ``as_written`` what parity opened before, ``check`` what it opens now
#: (:func:`normexport.runtime.check_session`).
SESSION_OPTIONS = {
    "deployed": {"level": "ORT_ENABLE_ALL", "prepacking": True, "priority": False, "arena": True},
    "as_written": {
        "level": "ORT_DISABLE_ALL",
        "prepacking": True,
        "priority": False,
        "arena": True,
    },
    "no_prepacking": {
        "level": "ORT_DISABLE_ALL",
        "prepacking": False,
        "priority": False,
        "arena": True,
    },
    "check": {"level": "ORT_DISABLE_ALL", "prepacking": False, "priority": True, "arena": True},
    "check_no_arena": {
        "level": "ORT_DISABLE_ALL",
        "prepacking": False,
        "priority": True,
        "arena": False,
    },
}
#: The share of the machine's memory a session-options process may take (RLIMIT_AS).
CAP_SHARE = 0.8


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
    """normexport's passes on ``model_path`` in this process (see the module docstring)."""
    import onnx_ir as ir

    import fusion
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
    results["total_s"] = time.perf_counter() - start
    results["nodes"] = nodes
    results["fusions"] = {k: v for k, v in report.counts.items() if v}
    return results


def run_ort_offline(model_path: Path, out_dir: Path) -> dict:
    """ONNX Runtime's offline optimizer on ``model_path`` in this process."""
    from normexport import runtime

    cap = _cap()
    baseline = _peak_rss()
    _reset_peak()
    start = time.perf_counter()
    result = {"cap_bytes": cap, "baseline_rss_bytes": baseline}
    try:
        runtime.make_session(model_path, "cpu", optimized_model_path=str(out_dir / "ort.onnx"))
    except Exception as err:  # ORT's own error types: out of memory under the cap
        result["error"] = " ".join(str(err).split())[-300:]
    return result | {"wall_s": time.perf_counter() - start, "peak_rss_bytes": _peak_rss()}


def _cap() -> int:
    """Cap this process's address space at :data:`CAP_SHARE` of the machine's memory: a
    measurement that needs more fails here (an allocation error) instead of starving the
    machine. Returns the cap in bytes."""
    cap = int(CAP_SHARE * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def run_session(model_path: Path, name: str) -> dict:
    """One ONNX Runtime session of ``model_path`` under :data:`SESSION_OPTIONS` ``name``, in
    this process capped at :data:`CAP_SHARE` of the machine's memory: load time, first run,
    peak RSS and its anonymous and file-backed parts after the run (bytes)."""
    import numpy as np
    import onnxruntime as ort

    chosen = SESSION_OPTIONS[name]
    cap = _cap()
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, chosen["level"])
    options.enable_cpu_mem_arena = chosen["arena"]
    if not chosen["prepacking"]:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if chosen["priority"]:
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    result = {"cap_bytes": cap}
    try:
        start = time.perf_counter()
        session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        result["load_s"] = time.perf_counter() - start
        ids = np.zeros((1, SEQ), dtype=np.int64)
        start = time.perf_counter()
        session.run(None, {"input_ids": ids})
        result["first_run_s"] = time.perf_counter() - start
    except Exception as err:  # ORT's own error types: out of memory under the cap
        result["error"] = " ".join(str(err).split())[-300:]
    status = Path("/proc/self/status").read_text().splitlines()
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if "kB" in line}
    result |= {
        "peak_rss_bytes": fields["VmHWM"],
        "anon_rss_bytes": fields["RssAnon"],
        "file_rss_bytes": fields["RssFile"],
    }
    return result


def _in_subprocess(kind: str, *args) -> dict:
    """Run :func:`run_stages`, :func:`run_ort_offline` or :func:`run_session` in a fresh
    Python process."""
    result = subprocess.run(
        [sys.executable, __file__, f"--_{kind}", *map(str, args)], capture_output=True, text=True
    )
    if result.returncode != 0:  # killed, or aborted by an allocation under the cap
        last = (result.stderr.strip() or "no output").splitlines()[-1]
        return {"error": f"exit code {result.returncode}: {last}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_cli(hwm_file: Path, argv: list[str]) -> int:
    """The CLI (:func:`normexport.cli.main`) on ``argv`` in this process; at the end its peak
    resident set (``VmHWM``) is written to ``hwm_file``. A child's ``wait4`` peak is no
    measure here: Linux carries the parent's peak across ``exec`` into it."""
    from normexport import cli

    try:
        return cli.main(argv)
    finally:
        hwm_file.write_text(str(_peak_rss()))


def _cli(model_path: Path, folder: Path, benchmark: bool, group=None) -> dict:
    """The whole CLI run in a subprocess, from ``folder`` (not the model's), its output
    written there and deleted afterwards: exit code, wall time, the process's peak RSS, the
    report's ``cost``, memory plan and verdict (with each block's, where parity ran by
    blocks); ``group``: a :class:`cgroup.Group` the subprocess runs in."""
    out = folder / "cli"
    out.mkdir()
    argv = [str(model_path), "-o", str(out / "m.onnx"), "--provider", "cpu"]
    argv += ["--report", str(out / "report.json")] + ([] if benchmark else ["--no-benchmark"])
    hwm = out / "peak_rss"
    start = time.perf_counter()
    child = subprocess.run(
        [sys.executable, __file__, "--_cli", str(hwm), *argv],
        cwd=folder,
        capture_output=True,
        text=True,
        preexec_fn=group.enter if group else None,
    )
    output = (child.stdout + child.stderr).strip()
    entry = {
        "latency": benchmark,
        "exit_code": child.returncode,
        "wall_s": time.perf_counter() - start,
        "peak_rss_bytes": int(hwm.read_text()) if hwm.exists() else None,
        "last_line": output.splitlines()[-1] if output else "",
    }
    report = out / "report.json"
    if report.exists():
        found = json.loads(report.read_text())
        entry["cost"] = found["cost"]
        entry["parity_passed"] = found["parity"]["passed"]
        entry["latency_apart"] = (found["latency_conditions"] or {}).get("apart")
        entry["memory"] = found["memory"]
        entry["blocks"] = [
            {k: b[k] for k in ("index", "nodes", "weight_bytes", "spans", "seconds", "passed")}
            | {"worst_local_rel_l2": (b["worst_local"] or {}).get("rel_l2_err")}
            for b in found["parity"]["blocks"] or []
        ]
    shutil.rmtree(out)
    return entry


def _cli_limited(model_path: Path, folder: Path, limit: int) -> dict:
    """The user's case: the CLI without latency (``--no-benchmark``, parity by the memory
    plan) in a memory cgroup limited to ``limit`` bytes, made as a container runtime makes a
    pod's (:mod:`cgroup`: at the root of the hierarchy), first with the page cache warm (the
    model file just written by the export), then cold (dropped); each with the group's peak
    usage and anonymous memory and OOM kills, or why it could not run."""
    import cgroup

    found = {}
    for cache in ("warm", "cold"):
        try:
            with cgroup.limited(limit, cache=cache) as group:
                entry = _cli(model_path, folder, benchmark=False, group=group)
                found[cache] = entry | {"cgroup": group.stats()}
        except OSError as err:
            found[cache] = {"error": str(err)}
    return found


def build_and_export(
    config: dict, layers: int, folder: Path, dtype: str = "float32", optimize: bool = True
) -> tuple[Path, int, int]:
    """Export a random-weight LlamaModel of ``layers`` layers with ``dtype`` weights
    (``"float32"`` or ``"float16"``, built in that type: no float32 copy is ever held) to
    ``folder/model.onnx`` (+ its external data) with torch.onnx.export's defaults, its own
    graph optimizer off where ``optimize`` is False.

    Returns:
        ``(path, parameters, weight bytes of the ONNX file)``.
    """
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**config, num_hidden_layers=layers, use_cache=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        model = transformers.LlamaModel(cfg).eval()
    finally:
        torch.set_default_dtype(default)
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
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(
            Hidden(model).eval(), (ids,), str(path), input_names=["input_ids"], optimize=optimize
        )
    data = path.with_name(path.name + ".data")
    return path, params, data.stat().st_size if data.exists() else path.stat().st_size


def measure(
    name: str,
    config: dict,
    layers: int,
    dtype: str = "float32",
    big: int | None = None,
    *,
    optimize: bool = True,
    limited_only: bool = False,
) -> dict:
    """Build, export (the exporter's optimizer on or off: ``optimize``) and measure one model;
    its folder is deleted afterwards. ``big`` (a memory limit, bytes): the session options and
    the whole CLI too, and the CLI under that memory limit; ``limited_only``: that last
    alone."""
    with tempfile.TemporaryDirectory(prefix=f"scale-{name}-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        path, params, weight_bytes = build_and_export(
            config, layers, folder / "model", dtype, optimize
        )
        entry = {
            "name": name,
            "layers": layers,
            "dtype": dtype,
            "exporter_optimize": optimize,
            "parameters": params,
            "weight_bytes": weight_bytes,
            "export_s": time.perf_counter() - start,
        }
        print(f"{name}: {params / 1e6:.1f} M parameters, exported", file=sys.stderr)
        if big and limited_only:
            entry["cli_limited"] = _cli_limited(path, folder, big)
            return entry
        for kind in ("stages", "ort_offline"):
            out = folder / kind
            out.mkdir()
            entry[kind] = _in_subprocess(kind, path, out)
            shutil.rmtree(out)
            print(f"{name}: {kind} done", file=sys.stderr)
        if big:
            entry["sessions"] = {o: _in_subprocess("session", path, o) for o in SESSION_OPTIONS}
            entry["cli"] = [_cli(path, folder, benchmark=b) for b in (False, True)]
            entry["cli_limited"] = _cli_limited(path, folder, big)
            print(f"{name}: sessions and CLI done", file=sys.stderr)
        stages = entry["stages"]
        entry["optimize_us_per_node"] = stages["optimize"]["wall_s"] / stages["nodes"] * 1e6
        offline = entry["ort_offline"]
        entry["ort_offline_rss_over_weights"] = (
            None if "error" in offline else offline["peak_rss_bytes"] / weight_bytes
        )
        for run in entry.get("cli", []):
            run["rss_over_weights"] = (run["peak_rss_bytes"] or 0) / weight_bytes
        return entry


def write_chart(result: dict, path: Path) -> None:
    """For each large model, the whole CLI's peak RSS per stage (parity only, and with
    latency) against the weights and the targets; the session options' peak RSS; and the
    passes' time per node against layer count."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from normexport.io.files import save_figure

    models = result["models"]
    big = [m for m in models if "cli" in m or "cli_limited" in m]
    fig = Figure(figsize=(5 * (len(big) + 2), 4.5))
    axes = fig.subplots(1, len(big) + 2)
    for ax, model in zip(axes, big, strict=False):
        weights = model["weight_bytes"] / 2**30
        limited = model.get("cli_limited", {})
        runs = [*model.get("cli", []), *(run for run in limited.values() if "cost" in run)]
        width = 0.8 / len(runs)
        for k, run in enumerate(runs):
            stages = run.get("cost", {}).get("stages", [])
            label = "with latency" if run["latency"] else "parity only"
            if "cgroup" in run:
                cache = "warm" if run is limited.get("warm") else "cold"
                label = f"under a {run['cgroup']['limit_bytes'] / 2**30:g} GiB cgroup, {cache}"
                ax.axhline(run["cgroup"]["limit_bytes"] / 2**30, color="r", lw=1)
            xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(stages))]
            ax.bar(xs, [s["peak_rss_bytes"] / 2**30 for s in stages], width=width, label=label)
        longest = max((r.get("cost", {}).get("stages", []) for r in runs), key=len)
        ax.set_xticks(range(len(longest)), [s["name"] for s in longest], rotation=30)
        for factor, style in ((1.0, "--"), (1.5, ":"), (2.0, "-.")):
            ax.axhline(factor * weights, color="k", ls=style, lw=1, label=f"{factor:g}x weights")
        ax.set_ylabel("peak RSS (GiB)")
        ax.set_title(f"normexport CLI, {model['name']} ({model['parameters'] / 1e9:.2f} B)")
        ax.legend(fontsize=7)
    ax = axes[len(big)]
    for i, model in enumerate(m for m in big if "sessions" in m):
        names = list(model["sessions"])
        peaks = [model["sessions"][n].get("peak_rss_bytes", 0) for n in names]
        peaks = [peak / model["weight_bytes"] for peak in peaks]
        width = 0.8 / len(big)
        xs = [j + (i - (len(big) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, peaks, width=width, label=model["name"])
        ax.set_xticks(range(len(names)), names, rotation=30)
    ax.set_ylabel("one session's peak RSS / weights")
    ax.set_title("ONNX Runtime session options (CPU)")
    ax.legend(fontsize=7)
    ax = axes[-1]
    small = sorted((m for m in models if m["name"].startswith("layers")), key=lambda m: m["layers"])
    ax.plot([m["layers"] for m in small], [m["optimize_us_per_node"] for m in small], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("layers (hidden 64)")
    ax.set_ylabel("optimize time per node (µs)")
    ax.set_ylim(bottom=0)
    ax.set_title("fusion.optimize scaling")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="2,8,32,128", help="layer counts of the hidden-64 family")
    p.add_argument("--big", default=",".join(BIG), help=f"large models to run, of {list(BIG)}")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument(
        "--limit", type=int, default=LIMIT, help="memory cgroup limit (bytes) of the last CLI run"
    )
    p.add_argument(
        "--limited-only",
        action="store_true",
        help="large models: only the CLI under the memory limit (see the module docstring)",
    )
    p.add_argument("--_stages", nargs=2, type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_ort_offline", nargs=2, type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_session", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--_cli", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._cli:
        return run_cli(Path(args._cli[0]), args._cli[1:])
    for kind, fn in (("_stages", run_stages), ("_ort_offline", run_ort_offline)):
        if getattr(args, kind):
            print(json.dumps(fn(*getattr(args, kind))))
            return 0
    if args._session:
        print(json.dumps(run_session(Path(args._session[0]), args._session[1])))
        return 0

    import onnxruntime
    import torch

    from normexport import report

    out = args.out / "scale.json"
    measured = [f"layers{n}" for n in args.layers.split(",") if n]
    measured += [f"llama-{n}" for n in args.big.split(",") if n]
    earlier = json.loads(out.read_text())["models"] if out.exists() else []
    models = [m for m in earlier if m["name"] not in measured]  # kept from an earlier run
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
        models.append(measure(f"layers{layers}", LLAMA_SMALL, layers))
        save()
    for name in (n for n in args.big.split(",") if n):
        config, layers, dtype, optimize = BIG[name]
        models.append(
            measure(
                f"llama-{name}", config, layers, dtype, big=args.limit, optimize=optimize,
                limited_only=args.limited_only,
            )
        )  # fmt: skip
        save()
    write_chart(result, args.out / "scale.png")
    for m in models:
        line = f"{m['name']:>14}: {m['parameters'] / 1e6:8.1f} M params"
        if "stages" in m:
            line += f", {m['stages']['nodes']} nodes; optimize "
            line += f"{m['optimize_us_per_node']:.0f} us/node; ORT offline "
            offline = m["ort_offline_rss_over_weights"]
            line += f"{offline:.2f}x the weights" if offline else m["ort_offline"]["error"][:60]
        for run in m.get("cli", []):
            what = "with latency" if run["latency"] else "parity only"
            line += f"; CLI {what}: exit {run['exit_code']}, {run['wall_s']:.1f} s at "
            line += f"{run['rss_over_weights']:.2f}x the weights"
        for cache, limited in m.get("cli_limited", {}).items():
            if "exit_code" in limited:
                group = limited["cgroup"]
                line += f"; under {group['limit_bytes'] / 2**30:.1f} GiB, {cache}: exit "
                line += f"{limited['exit_code']}, {limited['wall_s']:.1f} s, "
                line += f"{len(limited.get('blocks', []))} blocks, peak anonymous "
                line += f"{group['peak_anon_bytes'] / 2**30:.2f} GiB"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
