"""The attention fusion policy's choices A/B on whole models (issue 52): each model's graph
passes under the CPU provider's policy against the same passes with one choice flipped, timed
interleaved on ONNX Runtime.

- ``swinv2``, ``edgenext`` (timm's SwinV2-Tiny and EdgeNeXt-XX-Small, :data:`families.FAMILIES`):
  their attention scaled per head fused (the policy's file) against it left decomposed (the
  same passes with those ``sdpa_fused`` rewrites left out, as before the scale moved into Q);
- ``yolov8n``, ``yolo11n``: YOLO's transposed attention (``q^T @ k``, ``v @ attn^T``) left
  decomposed (the CPU policy's file, ``sdpa_transposed=False``) against it fused
  (``sdpa_transposed=True``, the CUDA policy's choice).

Each model is built, randomized and exported as ``families.py`` does; both files come from
``fusion.optimize`` on the export under ``fusion_policy("ort", provider, 2)``
(``policy`` the policy's file, ``flipped`` the other), and are timed with the raw export and an
A/A control as :func:`families.measure` times its variants (``--copies`` sessions each opened
ABBA, interleaved in random order per round, 2 intra-op threads, spinning off); the ratio
``flipped / policy`` above 1 means the policy's choice is faster.

    python benchmarks/attention_ab.py [--models swinv2,yolo11n] [--budget 20] [--copies 2]

Writes ``attention_ab_<provider>.json`` and ``.png`` to ``--out`` (default
``benchmarks/results``) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import families
import onnx_ir as ir
import outside
import torch
from rich.console import Console
from rich.table import Table

import fusion
from normexport.bench.render import fmt_ratio
from normexport.runtime.fusion_policy import fusion_policy

#: Per model, the choice flipped: ``"per_head"`` (the per-head scaled attention left out) or
#: ``"transposed"`` (YOLO's transposed attention fused).
MODELS = {"swinv2": "per_head", "edgenext": "per_head", "yolov8n": "transposed",
          "yolo11n": "transposed"}  # fmt: skip


def _files(raw: Path, folder: Path, flip: str, provider: str) -> dict:
    """The policy's file and the flipped one, from ``raw``; what each fused."""
    policy = fusion_policy("ort", provider, families.THREADS)
    made = {}
    for name in ("policy", "flipped"):
        model = ir.load(raw)
        chosen, exclude = policy, ()
        if name == "flipped" and flip == "transposed":
            chosen = dataclasses.replace(policy, sdpa_transposed=True)
        if name == "flipped" and flip == "per_head":
            exclude = [f for f in made["policy"]["report"].fused if f.kind == "sdpa_fused"]
        done = fusion.optimize(model, chosen, exclude=exclude)
        path = folder / f"{name}.onnx"
        ir.save(model, path)
        made[name] = {"path": path, "report": done}
    return made


def bench(name: str, args: argparse.Namespace) -> dict:
    """Build, export, pass and time model ``name``; its JSON entry."""
    family = families.FAMILIES[name]
    torch.manual_seed(0)
    module, example = family.build(**family.config)
    module = families.randomize(module)
    with tempfile.TemporaryDirectory(prefix="attention-ab-") as tmp:
        folder = Path(tmp)
        families.export(module, example, folder / "raw.onnx")
        names = [v.name for v in ir.load(folder / "raw.onnx").graph.inputs]
        feeds = dict(zip(names, (t.numpy() for t in example), strict=True))
        made = _files(folder / "raw.onnx", folder, MODELS[name], args.provider)
        entry = {"flipped": MODELS[name], "library": family.library, "config": family.config}
        entry["sdpa_fused"] = {k: v["report"].counts["sdpa_fused"] for k, v in made.items()}
        codes = {k: {f"{r.family}/{r.code}" for r in v["report"].refused} for k, v in made.items()}
        entry["refused"] = {k: sorted(c) for k, c in codes.items()}
        paths = {"ort_raw": folder / "raw.onnx", "normexport": made["policy"]["path"]}
        paths |= {"flipped": made["flipped"]["path"], families.CONTROL: made["policy"]["path"]}
        entry |= families.measure(paths, feeds, args.provider, args.budget, args.copies)
    return entry


def print_table(results: dict, console: Console) -> None:
    """Per model: what was flipped, the attentions fused in each file, the ratios."""
    table = Table(title="time / the policy's file's time (95% interval); > 1: the policy wins")
    for column in ("model", "flipped", "sdpa policy / flipped", "flipped", "raw", "A/A"):
        table.add_column(column)
    for name, entry in results["models"].items():
        if "ratio_to_normexport" not in entry:
            table.add_row(name, entry.get("failed", ""), "", "", "", "")
            continue
        r, fused = entry["ratio_to_normexport"], entry["sdpa_fused"]
        table.add_row(
            name, entry["flipped"], f"{fused['policy']} / {fused['flipped']}",
            fmt_ratio(r["flipped"]), fmt_ratio(r["ort_raw"]), fmt_ratio(r[families.CONTROL]),
        )  # fmt: skip
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    """Run the A/B; write the JSON and the chart; print the table."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/attention_ab.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    families.add_timing_arguments(p)
    args = p.parse_args(argv)
    names = families.chosen(p, args.models, MODELS)
    console = Console(highlight=False, width=200)
    results = families.header(args, console)
    if results is None:
        return 2
    results["variants"] = {
        "ort_raw": "the export as is",
        "normexport": "fusion.optimize under the provider's policy",
        "flipped": "the same with the choice flipped (see flipped)",
        families.CONTROL: "other sessions of the policy's file",
    }
    outside.use()
    torch.set_num_threads(families.THREADS)
    families.run_models(names, lambda name: bench(name, args), results, console)
    stem = args.out / f"attention_ab_{args.provider}"
    title = "Attention policy A/B: above 1, the policy's choice is faster"
    families.save(results, stem, title, ["flipped", "ort_raw", families.CONTROL])
    print_table(results, console)
    console.print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
