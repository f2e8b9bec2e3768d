"""Which optimizer fuses which spelling of a norm: the gallery through six tools.

Every entry of :data:`models.norms.GALLERY` is exported (dynamo exporter at opsets 18 and 23,
TorchScript exporter at opset 17, where the entry applies), and each tool optimizes the raw
export (built by :func:`normexport.bench.variants.build_variants`, which records a tool's exception
instead of stopping); each tool's model then runs in ORT (CPU) with ORT's own optimizations
off, so that the verdict is the tool's:

- ``ort_session``: ONNX Runtime's session-time optimizer (ORT_ENABLE_ALL, CPU), its result saved
  with ``optimized_model_filepath`` and inspected;
- ``onnxscript``: ``onnxscript.rewriter.ort_fusions.optimize_for_ort``;
- ``ort_transformers``: ``onnxruntime.transformers.optimizer.optimize_model``, model_type
  ``"bert"``, ``num_heads=0`` / ``hidden_size=0`` (inferred), ``opt_level=0``: its own Python
  fusions, without an ORT session pass that would credit it with ORT's;
- ``onnxslim``: ``onnxslim.slim(model)``, its defaults;
- ``onnxsim``: ``onnxsim.simplify(model)``, its defaults (its own output check off);
- ``normexport``: :func:`fusion.optimize` (``target="ort"``).

onnxslim and onnxsim come from the ``bench`` extra (``pip install -e '.[bench]'``, which
``make bench`` runs); where one is not installed, its column is ``E`` with the reason in the
JSON, and the other tools still run.

Each result gets one verdict:

- ``F`` fused: no op of the entry's decomposed form is left (:data:`models.norms.DECOMPOSED`:
  the norm became one op, the BatchNorm is gone) and the outputs match PyTorch;
- ``=`` kept: the exporter had already written the fused op (or folded the BatchNorm) and the
  tool kept it, outputs matching (no credit to the tool);
- ``.`` not fused: outputs match, the decomposed form is still there;
- ``R`` refused: a look-alike (an entry that must be refused) left alone, outputs matching;
- ``X`` wrong: outputs differ from PyTorch beyond the entry's tolerance on random inputs or on
  the eps probes (constant, zeros, 1e-4, 1e3), NaN/Inf where PyTorch has none, or a look-alike
  turned into a norm op;
- ``E`` error: the tool raised, or ORT (CPU) cannot load or run the model it wrote.

The table is printed (rich) and everything, with tool versions, goes to
``benchmarks/results/compare_fusers.json``.

    python benchmarks/compare_fusers.py [--only ln_module,rms_llama] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
from collections import Counter
from pathlib import Path

import onnx
import onnx_ir
import onnxruntime
import onnxscript
import torch
from rich.console import Console
from rich.table import Table

import fusion
from models.norms import DECOMPOSED, FOLDED, GALLERY, Entry, torch_outputs
from normexport import report, runtime
from normexport.bench.results import Machine
from normexport.bench.variants import Variant, build_variants
from normexport.errors import one_line
from normexport.io.export import ExportError, export_module
from normexport.io.inputs import input_sets
from normexport.verdict.parity import check_parity

#: Tool column -> (the variant of :mod:`normexport.bench.variants` that builds its model, what
#: it is).
TOOLS = {
    "ort_session": (
        "ort_offline",
        "ONNX Runtime's session optimizer (ORT_ENABLE_ALL, CPU), saved with "
        "optimized_model_filepath",
    ),
    "onnxscript": ("onnxscript_ort", "onnxscript.rewriter.ort_fusions.optimize_for_ort"),
    "ort_transformers": (
        "ort_transformers",
        "onnxruntime.transformers.optimizer.optimize_model(model_type='bert', num_heads=0, "
        "hidden_size=0, opt_level=0)",
    ),
    "onnxslim": ("onnxslim", "onnxslim.slim(model)"),
    "onnxsim": ("onnxsim", "onnxsim.simplify(model)"),
    "normexport": ("normexport", "fusion.optimize(model, target='ort')"),
}

#: Each tool's model runs with ORT's own optimizations off, so that a verdict is the tool's.
ORT_AS_WRITTEN = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL

#: (exporter, opset) columns, in order.
EXPORTS = (("dynamo", 18), ("torchscript", 17), ("dynamo", 23))

LEGEND = {
    "F": "fused: the norm became one op (BatchNorm folded), outputs match PyTorch",
    "=": "kept: the export already had the fused op / folded BatchNorm; the tool kept it",
    ".": "not fused: outputs match, the decomposed norm is still there",
    "R": "refused: a look-alike left alone, outputs match",
    "X": "wrong: outputs differ from PyTorch, or a look-alike was turned into a norm op",
    "E": "error: the tool raised, or ORT cannot load / run its model",
    "-": "this export does not apply to the entry",
}
STYLE = {"F": "green", "=": "dim green", ".": "yellow", "R": "cyan", "X": "bold red", "E": "red"}


def judge(entry: Entry, module: torch.nn.Module, raw: Counter, variant: Variant, sets) -> dict:
    """The verdict (see the module docstring) on one tool's model of one entry."""
    if variant.model is None:
        return {"verdict": "E", "error": variant.error}
    ops = Counter(n.op_type for n in onnx_ir.load(variant.model).graph)
    result = {"norm_ops": variant.norm_ops, "details": variant.details}
    try:
        session = runtime.make_session(variant.model, "cpu", optimization_level=ORT_AS_WRITTEN)
        parity = check_parity(
            lambda feeds: runtime.run(session, feeds),
            lambda feeds: torch_outputs(module, feeds),
            sets,
            ["y"],
            reference_kind="pytorch",
            atol=entry.atol,
            rtol=entry.rtol,
        )
    except Exception as err:  # ORT rejecting a tool's model is a result, not a crash
        return {**result, "verdict": "E", "error": one_line(err)}
    worst = parity.worst()["y"]
    result["max_abs_err"] = worst.max_abs_err
    result["failures"] = [probe for probe, _ in parity.failures()]
    new_norm_op = any(ops[op.op_type] > raw[op.op_type] for op in fusion.NORM_OPS)
    decomposed = DECOMPOSED[entry.family]
    if not parity.passed or (entry.expect is None and new_norm_op):
        verdict = "X"
    elif entry.expect is None:
        verdict = "R"
    elif decomposed & set(ops):
        verdict = "."
    else:
        verdict = "=" if not decomposed & set(raw) else "F"
    return {**result, "verdict": verdict}


def compare_entry(entry: Entry, exports: tuple[tuple[str, int], ...]) -> dict:
    """Every tool on every applicable export of ``entry``."""
    module = entry.build()
    example = entry.example()
    sets = input_sets({"x": example.numpy()}, n_random=2)
    out = {}
    for exporter, opset in exports:
        if (exporter, opset) not in entry.exports():
            continue
        key = f"{exporter}{opset}"
        try:
            raw = export_module(
                module, (example,), opset=opset, input_names=["x"], exporter=exporter
            ).model
        except ExportError as err:
            out[key] = {"export_error": str(err)}
            continue
        raw_ops = Counter(node.op_type for node in raw.graph)
        with tempfile.TemporaryDirectory(prefix="compare-fusers-") as tmp:
            only = [name for name, _ in TOOLS.values()]
            variants = build_variants(raw, "cpu", Path(tmp), only=only)
            out[key] = {
                "raw_norm_ops": fusion.norm_ops(raw),
                "tools": {
                    tool: judge(entry, module, raw_ops, variants[name], sets)
                    for tool, (name, _) in TOOLS.items()
                },
            }
    return out


def _cell(results: dict, tool: str, exports: tuple[tuple[str, int], ...]) -> str:
    marks = []
    for exporter, opset in exports:
        r = results.get(f"{exporter}{opset}")
        mark = "-" if r is None else ("E" if "export_error" in r else r["tools"][tool]["verdict"])
        marks.append(f"[{STYLE[mark]}]{mark}[/]" if mark in STYLE else mark)
    return " ".join(marks)


def _expectation(entry: Entry) -> str:
    if entry.expect is None:
        return f"refuse: {entry.refused}"
    if entry.expect == FOLDED:
        return "fold"
    return "fuse" if entry.dtype == torch.float32 else f"fuse ({entry.dtype})"


def summarize(rows: dict[str, dict]) -> dict:
    """Per tool and family: verdict counts over every (entry, export)."""
    summary: dict[str, dict[str, Counter]] = {t: {} for t in TOOLS}
    for row in rows.values():
        for results in row["exports"].values():
            for tool in TOOLS:
                verdict = "E" if "export_error" in results else results["tools"][tool]["verdict"]
                summary[tool].setdefault(row["family"], Counter())[verdict] += 1
    return {t: {f: dict(c) for f, c in by.items()} for t, by in summary.items()}


def render(rows: dict[str, dict], summary: dict, exports, console: Console) -> None:
    """The per-entry table, the legend and the summary."""
    columns = " ".join(f"{exporter[0]}{opset}" for exporter, opset in exports)
    table = Table(title=f"Gallery through {len(TOOLS)} optimizers (each cell: {columns})")
    table.add_column("entry")
    table.add_column("expected")
    for tool in TOOLS:
        table.add_column(tool, justify="center")
    for name, row in rows.items():
        cells = [_cell(row["exports"], tool, exports) for tool in TOOLS]
        table.add_row(name, row["expected"], *cells)
    console.print(table)
    for mark, meaning in LEGEND.items():
        console.print(f"  {mark}  {meaning}")
    table = Table(title="Summary: verdicts over every (entry, export)")
    table.add_column("tool")
    families = list(dict.fromkeys(row["family"] for row in rows.values()))
    for family in families:
        table.add_column(family)
    for tool, by_family in summary.items():
        table.add_row(
            tool,
            *(
                " ".join(f"{m}:{n}" for m, n in sorted(by_family.get(f, {}).items()))
                for f in families
            ),
        )
    console.print(table)


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Versions of every tool compared, and of what they ran on."""
    return {
        "normexport": importlib.metadata.version("normexport"),
        "onnxslim": _installed("onnxslim"),
        "onnxsim": _installed("onnxsim"),
        "onnxruntime": onnxruntime.__version__,
        "onnxscript": onnxscript.__version__,
        "onnx_ir": onnx_ir.__version__,
        "onnx": onnx.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison, print the tables, write the JSON."""
    p = argparse.ArgumentParser(prog="python benchmarks/compare_fusers.py", description=__doc__)
    p.add_argument("--only", help="comma-separated gallery entry names (default: all)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    entries = GALLERY
    if args.only:
        wanted = set(args.only.split(","))
        entries = [e for e in GALLERY if e.name in wanted]
        if unknown := wanted - {e.name for e in entries}:
            p.error(f"unknown entries: {sorted(unknown)}")
    console = Console(highlight=False, width=160)
    rows = {}
    for entry in entries:
        console.print(f"[dim]{entry.name}[/]")
        rows[entry.name] = {
            "family": entry.family,
            "expected": _expectation(entry),
            "exports": compare_entry(entry, EXPORTS),
        }
    summary = summarize(rows)
    render(rows, summary, EXPORTS, console)
    result = {
        "versions": versions(),
        "machine": Machine.probe("cpu").to_dict(),
        "tools": {tool: description for tool, (_, description) in TOOLS.items()},
        "ort_session_optimization_when_checking_parity": ORT_AS_WRITTEN.name,
        "exports": [f"{e}{o}" for e, o in EXPORTS],
        "legend": LEGEND,
        "summary": summary,
        "entries": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(result, args.out / "compare_fusers.json")
    console.print(f"wrote {args.out / 'compare_fusers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
