"""How the float64 oracle should run its input sets: one at a time on the session's default
intra-op threads (the build before this choice), one at a time on one thread, or as many at once
as there are cores, one thread each (:attr:`normexport.runtime.plan.MemoryPlan.oracle_runs`).

For each file (``--files``; by default the CNNs of ``benchmarks/oracle.py``, built in a temporary
folder), the oracle is built as the reference stage builds it
(:func:`normexport.verdict.oracle.onnx_float64`, the file as written for its self-check) and
records ``--sets`` input sets of the example's shapes (random normal float inputs), each
variant's sessions opened once, the variants interleaved in random order for ``--rounds``
rounds (:func:`normexport.latency.measure.time_interleaved`, one round = every set once); the
default variant timed twice (A/A). Reported: each variant's median seconds per round and its
ratio to the default with a 95% bootstrap interval.

    python benchmarks/oracle_runs.py [--files A.onnx B.onnx] [--sets 8] [--rounds 7]

Writes ``oracle_runs_cpu.json`` and ``oracle_runs_cpu.png`` in ``--out`` (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime
import oracle  # the CNNs of benchmarks/oracle.py

from normexport import runtime
from normexport.io.files import save_figure
from normexport.latency.measure import latency_threads, paired_ratio, time_interleaved
from normexport.verdict.oracle import onnx_float64
from normexport.verdict.parity import Recorded

ROOT = Path(__file__).resolve().parents[1]
#: The default variant's name (the build before ``oracle_runs``).
DEFAULT = "one at a time, default threads"


def _feeds(path: Path, sets: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``sets`` random input sets of the file's inputs (symbolic axes 1, float normal)."""
    rng = np.random.default_rng(seed)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    found = []
    for _ in range(sets):
        feeds = {}
        for i in session.get_inputs():
            shape = [d if isinstance(d, int) else 1 for d in i.shape]
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        found.append(feeds)
    return found


def _noop() -> None:
    """The sessions stay open across rounds: nothing to close."""


def variants(path: Path, sets: list, work: Path, cores: int) -> dict:
    """Variant name -> a zero-argument call recording every set after the example with a
    fresh :class:`Recorded` on that variant's oracle (its session opened once, kept open)."""
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    as_written = lambda feeds: runtime.run(session, feeds)  # noqa: E731
    made = {}
    for name, one_thread, at_once in (
        (DEFAULT, False, 1),
        (f"{DEFAULT} (A/A)", False, 1),
        ("one at a time, 1 thread", True, 1),
        (f"{cores} at once, 1 thread each", True, cores),
    ):
        folder = work / str(len(made))
        folder.mkdir()
        found = onnx_float64(path, as_written, sets[0], folder, "the file", 2 if one_thread else 1)
        concurrent = found.concurrent if at_once > 1 else None
        recorded = (found.run, _noop, concurrent)
        made[name] = lambda r=recorded, n=at_once: Recorded(*r).record(sets[1:], at_once=n)
    return made


def measure(path: Path, sets: int, rounds: int, work: Path) -> dict:
    """One file's timings (seconds per round) and ratios to :data:`DEFAULT`."""
    cores = latency_threads()
    calls = variants(path, _feeds(path, sets), work, cores)
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
