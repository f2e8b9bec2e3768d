"""Does the order in which ONNX Runtime sessions are opened bias an interleaved comparison?

An A/A test: two "variants" that are the same ONNX file, so their true time ratio is 1. For
each model, ``--repeats`` times, with fresh sessions each time, on the CPU provider (2 intra-op
threads, spinning off, :func:`normexport.latency.measure.time_interleaved`, rounds in random
order):

- ``in_order``: one session of each, ``a`` opened first, ``b`` second (how the main job opened
  the raw model and then the optimized one);
- ``abba``: two sessions of each, opened ``a, b, b, a`` and timed in turn
  (:func:`normexport.latency.measure.counterbalanced`, :func:`~normexport.latency.measure.rotating`;
  how the main job and the decoders benchmark open them now).

Each repeat gives the paired ratio ``b / a`` with its 95% interval. A design without bias gives
ratios spread around 1; one whose ratios fall on one side at every repeat favours the variant
opened second. The models are the zoo's PyTorch models exported with ``torch.onnx.export``'s
defaults (a CNN, a MiniLM encoder, a tiny LLaMA) and an ONNX-only one (PP-OCR's classifier).

    python benchmarks/session_order.py [--models resnet-small,minilm,llama-tiny,ppocr-cls]
                                       [--repeats 6] [--budget 3] [--out DIR]

Writes ``session_order_cpu.json`` and ``session_order_cpu.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

import models
from normexport import runtime
from normexport.bench.results import Machine
from normexport.io.files import save_figure
from normexport.io.quiet import quiet_torch
from normexport.latency.measure import (
    counterbalanced,
    paired_ratio,
    rotating,
    runner,
    time_interleaved,
)

THREADS = 2
DESIGNS = {"in_order": 1, "abba": 2}  # sessions of each variant


def model_file(name: str, folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The zoo model ``name`` as an ONNX file in ``folder`` and its example inputs."""
    zoo = models.load(name)
    path = folder / f"{name}.onnx"
    if zoo.module is None:
        shutil.copyfile(zoo.onnx_path, path)
        return path, zoo.inputs
    tensors = tuple(torch.from_numpy(a) for a in zoo.inputs.values())
    with quiet_torch():
        program = torch.onnx.export(zoo.module, tensors, input_names=list(zoo.inputs))
    program.save(str(path), external_data=True)
    return path, zoo.inputs


def b_over_a(path: Path, feeds: dict, copies: int, budget_s: float) -> dict:
    """``b / a`` for two variants that are ``path``, ``copies`` sessions each (ABBA)."""
    open_one = functools.partial(runtime.make_session, path, "cpu", spinning=False, threads=THREADS)
    opened = counterbalanced({"a": open_one, "b": open_one}, copies)
    calls = {
        name: rotating([runner(s, feeds, io_binding=False)[0] for s in sessions])
        for name, sessions in opened.items()
    }
    timings = time_interleaved(calls, budget_s=budget_s)
    return paired_ratio(timings["b"], timings["a"]).to_dict()


def _chart(results: dict, path: Path) -> None:
    """Each repeat's ``b / a`` per model and design."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, color, design in zip((-0.1, 0.1), ("tab:red", "tab:blue"), DESIGNS, strict=True):
        for x, entry in enumerate(results["models"].values()):
            values = [r["median"] for r in entry[design]]
            label = design if x == 0 else None
            ax.scatter([x + offset] * len(values), values, s=14, color=color, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(results["models"])), list(results["models"]))
    ax.set_ylabel("b / a (same file)")
    ax.set_title("A/A on ONNX Runtime CPU: b opened second (in_order) or ABBA")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Run the A/A test; write JSON and PNG; print each model's ratios."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet-small,minilm,llama-tiny,ppocr-cls")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--budget", type=float, default=3.0, help="timing seconds per repeat")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    console = Console()
    results = {"machine": Machine.probe("cpu").to_dict(), "threads": THREADS, "models": {}}
    with tempfile.TemporaryDirectory(prefix="session-order-") as tmp:
        for name in args.models.split(","):
            path, feeds = model_file(name, Path(tmp))
            entry = {design: [] for design in DESIGNS}
            for _ in range(args.repeats):
                for design, copies in DESIGNS.items():
                    entry[design].append(b_over_a(path, feeds, copies, args.budget))
            results["models"][name] = entry
            for design in DESIGNS:
                ratios = " ".join(f"{r['median']:.3f}" for r in entry[design])
                console.print(f"{name} {design}: b / a = {ratios}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "session_order_cpu.json").write_text(json.dumps(results, indent=1))
    _chart(results, args.out / "session_order_cpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
