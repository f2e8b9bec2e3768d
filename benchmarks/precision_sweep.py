"""Half precision on everything: every float32 gallery norm (each exporter it has) and every demo
model through the pipeline with ``--precision fp16``, and the parity verdict on each.

Each case runs :func:`normexport.pipeline.run` as the CLI would (gallery entries as PyTorch
modules, :func:`normexport.optimize`; demo models saved the way ``make demo`` saves them,
:func:`models.demo.demo_options`), on ONNX Runtime's CPU provider. Per case the JSON has the
verdict, the worst relative L2 error of an output against the float64 oracle over the input
sets (weak checks left out, and counted: an oracle constant within ``atol``) and on the
overflow probe (``overflow_outliers``: scaled float inputs, or for token-id
models hidden states fed at the embedding lookup), that probe's allowance terms (the raw
float32 model's error, the input rounding's), the oracle, what stayed float32 and why, and
every failure.

    python benchmarks/precision_sweep.py [--only ln_pow_reciprocal,minilm] [--out DIR]

Writes ``precision_sweep.json`` to ``--out``; exit 1 where a case fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from models.demo import sweep_runs
from normexport import precision
from normexport.errors import one_line


def _summary(report: dict) -> dict:
    """The figures of one run's report (see the module docstring)."""
    parity = report["parity"]
    entries = [e for errors in parity["sets"].values() for e in errors]
    probe = parity["sets"].get(precision.OVERFLOW_PROBE, [])
    return {
        "passed": parity["passed"],
        "oracle": parity["oracle"],
        "worst_rel_l2": max((e["rel_l2_err"] for e in entries if not e["weak"]), default=None),
        "weak": sum(e["weak"] for e in entries),
        "probe_rel_l2": max((e["rel_l2_err"] for e in probe), default=None),
        "probe_raw_rel_l2": max((e["raw_rel_l2_err"] or 0 for e in probe), default=None),
        "probe_rounding_rel_l2": max((e["rounding_rel_l2_err"] or 0 for e in probe), default=None),
        "probe_nonfinite": sum(e["nonfinite_mismatch"] for e in probe),
        "kept_float32": sorted({k["reason"] for k in report["precision"]["kept_float32"]}),
        "stash_float32": len(report["precision"]["stash_float32"]),
        "failures": [
            {"set": f["probe"], "output": f["output"], "rel_l2_err": f["rel_l2_err"]}
            for f in parity["failures"]
        ],
    }


def _quiet(run) -> dict:
    """``run()``'s report as a dict, its console output swallowed; ``{"error": ...}`` where it
    raises (a case that cannot convert is a result)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return _summary(run().to_dict())
    except Exception as err:
        return {"passed": False, "error": one_line(err)}


def _cell(value) -> str:
    return "-" if value is None else f"{value:.2g}"


def render(results: dict[str, dict], console: Console) -> None:
    """One row per case: verdict, worst errors, the probe's allowance terms, kept reasons."""
    table = Table(title="--precision fp16: parity per case (rel L2 vs the float64 oracle)")
    for col in ("case", "verdict", "worst", "probe", "probe raw", "probe rounding", "kept f32"):
        table.add_column(col)
    for name, row in results.items():
        verdict = "pass" if row["passed"] else "FAIL"
        verdict = "E " + row["error"][:60] if "error" in row else verdict
        table.add_row(
            name,
            verdict,
            _cell(row.get("worst_rel_l2")),
            _cell(row.get("probe_rel_l2")),
            _cell(row.get("probe_raw_rel_l2")),
            _cell(row.get("probe_rounding_rel_l2")),
            ", ".join(row.get("kept_float32", [])),
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    """Run every case; write ``precision_sweep.json``; exit 1 where one fails."""
    p = argparse.ArgumentParser(prog="python benchmarks/precision_sweep.py", description=__doc__)
    p.add_argument("--only", help="comma-separated gallery entries / zoo names (default: all)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    only = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory(prefix="precision-sweep-") as tmp:
        results = {}
        for case, run in sweep_runs(only, Path(tmp), precision="fp16"):
            results[case] = _quiet(run)
            print(f"{case}: {results[case]}", flush=True)
    render(results, Console(highlight=False, width=160))
    passed = sum(r["passed"] for r in results.values())
    data = {"precision": "fp16", "passed": passed, "cases": len(results), "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "precision_sweep.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"{passed} of {len(results)} passed; wrote {args.out / 'precision_sweep.json'}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
