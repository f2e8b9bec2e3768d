"""How the float64 oracle should run its input sets: one at a time on ONNX Runtime's default
intra-op threads (one per core: the build before :data:`normexport.verdict.oracle.THREADS`),
one at a time on one thread (the choice), or as many at once as there are cores, one thread
each.

For each file (``--files``; by default the CNNs of ``benchmarks/oracle.py``, built in a temporary
folder), the oracle's float64 graph is built as the reference stage builds it
(:func:`normexport.verdict.oracle.to_float64`) and saved once; each variant opens its own
sessions of it (as the verdict opens them: :func:`normexport.runtime.check_session`) and runs
``--sets`` input sets of the file's input shapes (random normal, symbolic axes 1), the
variants interleaved in random order for ``--rounds`` rounds
(:func:`normexport.latency.measure.time_interleaved`, one round = every set once); the default
variant timed twice (A/A). Reported: each variant's median seconds per round and its ratio to
the default with a 95% bootstrap interval.

    python benchmarks/oracle_runs.py [--files A.onnx B.onnx] [--sets 8] [--rounds 7]

Writes ``oracle_runs_cpu.json`` and ``oracle_runs_cpu.png`` in ``--out`` (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime
import oracle  # the CNNs of benchmarks/oracle.py

from normexport import runtime
from normexport.io import files
from normexport.io.files import save_figure
from normexport.latency.measure import latency_threads, paired_ratio, time_interleaved
from normexport.verdict.oracle import to_float64

ROOT = Path(__file__).resolve().parents[1]
#: The default variant's name (the build before :data:`normexport.verdict.oracle.THREADS`).
DEFAULT = "one at a time, default threads"


def _feeds(path: Path, sets: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``sets`` random input sets of the float64 graph at ``path`` (symbolic axes 1; float
    inputs normal in float64, as the oracle widens them)."""
    rng = np.random.default_rng(seed)
    session = runtime.check_session(path, "cpu")
    found = []
    for _ in range(sets):
        feeds = {}
        for i in session.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in i.shape]
            dtype = np.float64 if i.type == "tensor(double)" else np.float32
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
        found.append(feeds)
    return found


def variants(path: Path, sets: list, cores: int) -> dict:
    """Variant name -> a zero-argument call running every set on that variant's sessions
    (opened once)."""
    default = [runtime.check_session(path, "cpu") for _ in range(2)]
    one = runtime.check_session(path, "cpu", threads=1)
    pool = ThreadPoolExecutor(cores)

    def in_turn(session) -> None:
        for feeds in sets:
            session.run(None, feeds)

    def at_once() -> None:
        list(pool.map(lambda feeds: one.run(None, feeds), sets))

    return {
        DEFAULT: lambda: in_turn(default[0]),
        f"{DEFAULT} (A/A)": lambda: in_turn(default[1]),
        "one at a time, 1 thread": lambda: in_turn(one),
        f"{cores} at once, 1 thread each": at_once,
    }


def measure(path: Path, sets: int, rounds: int, work: Path) -> dict:
    """One file's timings (seconds per round) and ratios to :data:`DEFAULT`: its float64 graph
    saved in ``work``."""
    cores = latency_threads()
    wide = to_float64(ir.load(path))
    wide.finish()
    saved = work / "float64.onnx"
    files.save_model(wide.model, saved, external_data=True)
    calls = variants(saved, _feeds(saved, sets), cores)
    timed = time_interleaved(calls, warmup=1, min_runs=rounds, max_runs=rounds, budget_s=0)
    base = timed[DEFAULT]
    return {
        "cores": cores,
        "sets": sets,
        "seconds_per_round": {k: t.median_ms / 1e3 for k, t in timed.items()},
        "ratio_to_default": {
            k: paired_ratio(t, base).to_dict() for k, t in timed.items() if k != DEFAULT
        },
    }


def chart(results: dict, path: Path) -> None:
    """Each file's ratio to the default, with its interval, per variant."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3 + len(results["files"])))
    labels, y = [], 0
    for name, found in results["files"].items():
        for variant, r in found["ratio_to_default"].items():
            ax.errorbar(
                r["median"],
                y,
                xerr=[[r["median"] - r["ci_low"]], [r["ci_high"] - r["median"]]],
                fmt="o",
            )
            labels.append(f"{name}: {variant}")
            y += 1
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("time to record the input sets / one at a time, default threads")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="*", type=Path, default=None)
    parser.add_argument("--sets", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    results = {
        "machine": {"cpus": os.cpu_count(), "onnxruntime": onnxruntime.__version__},
        "files": {},
    }
    with tempfile.TemporaryDirectory(prefix="oracle-runs-") as tmp:
        folder = Path(tmp)
        files = args.files or [
            oracle.build_eeg(folder),
            oracle.build_yolox(folder),
            oracle.build_densenet(folder),
        ]
        for path in files:
            work = folder / f"work-{path.stem}"
            work.mkdir()
            results["files"][path.stem] = found = measure(path, args.sets, args.rounds, work)
            print(path.stem, json.dumps(found["seconds_per_round"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "oracle_runs_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, args.out / "oracle_runs_cpu.png")


if __name__ == "__main__":
    main()
