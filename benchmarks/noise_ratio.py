"""How quiet the noise-ratio warning is on exact rewrites, and what the export check and the
rollback say, on every model the project runs that it did not break on purpose.

Runs the pipeline in float32 (ONNX Runtime's CPU provider, no latency run) on

- every float32 gallery entry (:data:`models.norms.GALLERY`), with each exporter it has;
- every demo model, saved and run as ``make demo`` runs it (:func:`models.demo.demo_options`);
- every ONNX file of ONNX Runtime's fusion tests, as committed in ``tests/data/ort/`` (files ONNX
  Runtime cannot run as given are refused by normexport, exit 2, and counted as such);
- the Optimum LLaMA decoder with its KV cache in ``../shared/field/optimum-llama-with-past/``,
  with the shapes of a prefill.

Per case the JSON has the verdict, the largest noise ratio of an output that passed
(``max_noise_ratio``: the optimized model's max abs error over the raw model's, floored; see
:mod:`normexport.verdict.parity`), where it was, the warnings (outputs above
:data:`normexport.verdict.parity.NOISE_WARN_FACTOR`), the export check's failures, the rewrites the
rollback undid, and the error where the run stopped. Every rewrite normexport makes is exact,
so a warning here is a false alarm (the script exits 1). The chart shows each case's largest
ratio against the factor.

    python benchmarks/noise_ratio.py [--only NAME,...] [--out DIR]
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

import normexport
from models.demo import sweep_runs
from normexport.errors import UsageError, one_line
from normexport.io.files import save_figure
from normexport.verdict.parity import NOISE_WARN_FACTOR

ROOT = Path(__file__).resolve().parents[1]
#: ONNX Runtime's fusion test files, committed (tests/data/ort/README.md).
PEER = ROOT / "tests" / "data" / "ort"
SHARED = ROOT.parent / "shared"
#: The field decoder's inputs for a prefill of 8 tokens, batch 2, no past.
FIELD_SHAPES = [
    "input_ids=2x8:int64",
    "attention_mask=2x8:int64",
    "position_ids=2x8:int64",
    *(f"past_key_values.{i}.{kv}=2x2x0x32" for i in (0, 1) for kv in ("key", "value")),
]


def summary(report: dict) -> dict:
    """The figures of one run's JSON report (see the module docstring)."""
    parity, rollback = report["parity"], report["rollback"] or {}
    ratios = [
        (e["noise_ratio"], probe, e["output"])
        for probe, errors in parity["sets"].items()
        for e in errors
        if e["passed"] and e["noise_ratio"] is not None
    ]
    worst = max(ratios, default=(None, None, None))
    return {
        "passed": parity["passed"],
        "oracle": parity["oracle"],
        "max_noise_ratio": worst[0],
        "at": f"{worst[2]} on {worst[1]}" if worst[0] is not None else None,
        "warnings": len(parity["warnings"]),
        "export_failures": len(parity["export_failures"]),
        "failures": len(parity["failures"]),
        "undone": [(u["kind"], u["node"], u["code"]) for u in rollback.get("undone", [])],
        "rewrites": len(report["fusions"]["fused"]),
    }


def _quiet(run) -> dict:
    """``run()``'s summary, its console output swallowed; a refusal (exit 2) or an error is a
    result too."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return summary(run().to_dict())
    except UsageError as err:
        return {"refused": one_line(err)}
    except Exception as err:
        return {"error": one_line(err)}


def peer_cases(only, scratch: Path) -> dict[str, dict]:
    """Every ONNX file of ``tests/data/ort/`` (and its variants), named ``peer/ort/...`` as
    the results have them, and the field decoder (``field/...``)."""
    files = sorted(PEER.rglob("*.onnx"))
    field = SHARED / "field" / "optimum-llama-with-past" / "model.onnx"
    out = {}
    for path in [*files, field]:
        named = path.relative_to(SHARED) if path == field else "peer/ort" / path.relative_to(PEER)
        name = str(named)
        if (only and path.name not in only) or not path.exists():
            continue
        shapes = FIELD_SHAPES if path == field else []
        output = scratch / name.replace("/", "_")
        out[name] = _quiet(
            lambda p=path, o=output, s=shapes: normexport.optimize(
                p, output=o, input_shape=s, benchmark=False, provider="cpu"
            )
        )
    return out


def chart(results: dict[str, dict], path: Path) -> None:
    """Each case's largest noise ratio (log scale) against the warning factor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, r["max_noise_ratio"]) for k, r in results.items() if r.get("max_noise_ratio")]
    rows.sort(key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(rows)), [v for _, v in rows], ".", color="#2a6")
    ax.axhline(NOISE_WARN_FACTOR, color="#c33", label=f"warning factor {NOISE_WARN_FACTOR:g}")
    ax.set_yscale("log")
    ax.set_xlabel(f"case ({len(rows)}: gallery, demo models, peer files), sorted")
    ax.set_ylabel("largest noise ratio of a passing output")
    ax.set_title("Exact rewrites: optimized error / raw model's error (CPU, float32)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Run every case; write ``noise_ratio.json`` and ``.png``; exit 1 on a false alarm."""
    p = argparse.ArgumentParser(prog="python benchmarks/noise_ratio.py", description=__doc__)
    p.add_argument("--only", help="comma-separated gallery entries / zoo names / file names")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    only = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory(prefix="noise-ratio-") as tmp:
        scratch = Path(tmp)
        results = {case: _quiet(run) for case, run in sweep_runs(only, scratch)}
        (scratch / "peer").mkdir()
        results |= peer_cases(only, scratch / "peer")
    for name, row in results.items():
        print(f"{name}: {row}")
    ran = [r for r in results.values() if "max_noise_ratio" in r]
    alarms = [k for k, r in results.items() if r.get("warnings")]
    data = {
        "noise_warn_factor": NOISE_WARN_FACTOR,
        "cases": len(results),
        "ran": len(ran),
        "largest_ratio": max((r["max_noise_ratio"] or 0 for r in ran), default=None),
        "false_alarms": alarms,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "noise_ratio.json").write_text(json.dumps(data, indent=1) + "\n")
    chart(results, args.out / "noise_ratio.png")
    print(
        f"{len(ran)} of {len(results)} cases ran; largest ratio {data['largest_ratio']}; "
        f"false alarms: {alarms or 'none'}; wrote {args.out / 'noise_ratio.json'}"
    )
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
