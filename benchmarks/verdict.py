"""How sharp the parity verdict is on the demo models: deliberately broken optimizers.

Each demo model is saved as ``make demo`` saves it (:func:`models.demo.save_model_file`), and
the pipeline runs on it once as it is and once per break of :mod:`models.broken`
(``scale`` at 1.01, ``eps_dropped``, ``layernorm_as_rmsnorm``, ``bn_wrong_variance``; a break
the model has nothing for is ``n/a``). A break is caught where the verdict fails or the
rollback undoes the rewrite it is in (:func:`models.broken.caught`). A break that changes the
outputs by less than the tolerance (``atol + rtol * max|oracle|``) passes the verdict by
definition: dropping a LayerNorm eps of 1e-12, or a BatchNorm eps of 1e-5 beside running
variances near 1, changes nothing a user can see; the JSON has each break's worst error
beside the verdict. Then the ``scale`` break is tried at the factors of :data:`FACTORS` (by
bisection) for the smallest single-channel weight scaling caught, without and with
``--strict`` (which fails an output whose noise ratio, its error over the raw model's, passes
:data:`normexport.verdict.parity.NOISE_WARN_FACTOR`), and the largest noise ratio each factor tried
gave (the closer to the export's own noise, the sharper the verdict).

Per model, the JSON has the oracle, every break's verdict and worst error against the oracle
(``inf``: NaN or Inf where the oracle is finite), the smallest scaling caught with and without
``--strict``, the noise ratios, and the unbroken run's worst errors of the optimized model, the
raw model and PyTorch float32, and its largest noise ratio.

    python benchmarks/verdict.py [--only resnet-small,minilm] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

import models
from models import broken
from models.demo import demo_options
from normexport import pipeline
from normexport.arguments import Options

#: Single-channel weight scalings tried, smallest first.
FACTORS = (1.0001, 1.0003, 1.001, 1.003, 1.01, 1.03, 1.1, 1.3)


def _report(opts: Options) -> dict:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return pipeline.run(opts).to_dict()


def _worst(parity: dict, key: str = "max_abs_err") -> float | None:
    values = [e[key] for errors in parity["sets"].values() for e in errors]
    return None if any(v is None for v in values) else max(values)


def _broken(opts: Options, kind: str, factor: float = 1.01) -> dict:
    """The verdict with the optimizer broken ``kind`` way."""
    try:
        with broken.broken(kind, factor):
            report = _report(opts)
    except broken.NothingToBreak as why:
        return {"applies": False, "why": str(why)}
    parity, rollback = report["parity"], report["rollback"] or {}
    return {
        "applies": True,
        "caught": broken.caught(report),
        "caught_strict": broken.caught(report, strict=True),
        "undone": len(rollback.get("undone", [])),
        "max_abs_err": _worst(parity),
        "max_noise_ratio": _worst(parity, "noise_ratio"),
    }


def measure(name: str, folder: Path) -> dict:
    """Every break on zoo model ``name``, and the smallest scaling caught."""
    opts = demo_options(models.load(name), folder)
    clean = _report(opts)["parity"]
    result = {
        "oracle": clean["oracle"],
        "oracle_notes": clean["oracle_notes"],
        "unbroken": {
            "passed": clean["passed"],
            "warnings": len(clean["warnings"]),
            "optimized": _worst(clean),
            "raw": _worst(clean, "raw_max_abs_err"),
            "pytorch_float32": _worst(clean, "pytorch_max_abs_err"),
            "max_noise_ratio": _worst(clean, "noise_ratio"),
        },
        "breaks": {kind: _broken(opts, kind) for kind in broken.BREAKS},
    }
    tried: dict[float, dict] = {}
    for key, strict in (("smallest_scale_caught", False), ("smallest_scale_caught_strict", True)):
        result[key] = _smallest_caught(opts, strict, tried)
    result["scale_noise_ratio"] = {str(f): r["max_noise_ratio"] for f, r in sorted(tried.items())}
    return result


def _smallest_caught(opts: Options, strict: bool, tried: dict[float, dict]) -> float | None:
    """The smallest factor of :data:`FACTORS` whose ``scale`` break is caught (with
    ``--strict``: also where only warned of), by bisection (a larger scaling is further from
    the oracle); None where none is. ``tried`` keeps each factor's run for the other call."""
    key = "caught_strict" if strict else "caught"
    low, high = 0, len(FACTORS)  # FACTORS[high] is caught (high == len: none known to be)
    while low < high:
        middle = (low + high) // 2
        factor = FACTORS[middle]
        if factor not in tried:
            tried[factor] = _broken(opts, "scale", factor)
        if tried[factor].get(key):
            high = middle
        else:
            low = middle + 1
    return FACTORS[high] if high < len(FACTORS) else None


def _cell(entry: dict) -> str:
    if not entry["applies"]:
        return "n/a"
    how = "undone" if entry["undone"] else "caught" if entry["caught"] else "not caught"
    return f"{how} ({entry['max_abs_err']:.2g})"


def print_table(results: dict[str, dict]) -> None:
    """One row per model: the oracle, every break's verdict, the smallest scaling caught
    without and with ``--strict``, the unbroken run's largest noise ratio."""
    table = Table(title="Deliberately broken optimizers against the parity verdict")
    columns = ("model", "oracle", *broken.BREAKS, "scale caught", "--strict", "clean ratio")
    for column in columns:
        table.add_column(column)
    for name, r in results.items():
        cells = [_cell(r["breaks"][kind]) for kind in broken.BREAKS]
        smallest = [r[k] for k in ("smallest_scale_caught", "smallest_scale_caught_strict")]
        smallest = [f"x{c}" if c else "none" for c in smallest]
        ratio = r["unbroken"]["max_noise_ratio"]
        table.add_row(name, r["oracle"], *cells, *smallest, f"{ratio:.2g}" if ratio else "-")
    Console(width=180).print(table)


def main(argv: list[str] | None = None) -> int:
    """Run every break on the demo models and write the results (exit 0 when they ran: a
    break below the tolerance is a figure, not an error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated zoo names (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(models.ZOO)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            print(f"{name} ...", flush=True)
            folder = Path(scratch) / name
            folder.mkdir()
            results[name] = measure(name, folder)
            print(json.dumps(results[name]), flush=True)
    print_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "verdict.json"
    path.write_text(json.dumps({"factors": FACTORS, "models": results}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
