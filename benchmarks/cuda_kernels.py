"""Nodes without a CUDA kernel, before and after normexport's passes, on every demo model,
gallery entry, peer file and field file, checked without a GPU against ONNX Runtime's CUDA
kernel table (normexport.runtime.cuda_kernels, docs/cuda.md).

Each model is loaded and exported as the pipeline does it (``normexport.pipeline.prepare``:
the demo models as ``make demo`` saves them, the float32 gallery entries through each exporter
they have, the ONNX files as they are), checked as exported (``before``), then optimized with
the passes a CUDA run makes (``fusion.optimize`` under the policy
``normexport.runtime.fusion_policy.fusion_policy("ort", "cuda", 1)``, whose threads are 1 on any
provider but the CPU) and checked again (``after``).
Then the demo models and the gallery entries (dynamo) are converted to float16 and to bfloat16 as
``--precision`` converts them for CUDA (:func:`normexport.precision.convert.to_half`), except
that its question "which op has no kernel of this type?" is answered from the table instead of
a CUDA session (which needs a GPU): ``fully_converted`` counts the nodes without a CUDA kernel
when every op is converted, ``after`` those left once the conversion keeps in float32 the op
types it is told lack one (``kept_float32``), or why it refuses (bfloat16 with no bfloat16
kernel for the heavy ops).

    python benchmarks/cuda_kernels.py [--out benchmarks/results]

Writes ``cuda_kernels.json`` and ``cuda_kernels.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import onnx_ir as ir

SHARED = Path(__file__).resolve().parents[2] / "shared"


def _check(raw: ir.Model, half: Path | None) -> dict:
    """The fallbacks of ``raw`` (as ``before``), then of it after the CUDA run's passes, then
    (with ``half``, a scratch folder) of its float16 and bfloat16 conversions."""
    import fusion
    from normexport.runtime import cuda_kernels
    from normexport.runtime.fusion_policy import fusion_policy

    before = cuda_kernels.without_kernel(raw)
    report = fusion.optimize(raw, fusion_policy("ort", "cuda", 1))
    after = cuda_kernels.without_kernel(raw)
    halves = {} if half is None else _halves(raw, report.refused, half, len(after))
    return halves | {
        "before": len(before),
        "after": len(after),
        "before_ops": dict(Counter(f.op for f in before)),
        "after_ops": dict(Counter(f.op for f in after)),
        "after_why": sorted({f"{f.op}: {f.why}" for f in after}),
    }


def _halves(model: ir.Model, refused, folder: Path, fp32: int) -> dict:
    """``model`` converted to float16 and bfloat16 for CUDA, the kernel question answered by
    the table (see the module docstring): per precision, the fallbacks fully converted and
    after the conversion, the op types kept float32, or the refusal."""
    from normexport.errors import UsageError
    from normexport.io import files
    from normexport.precision import convert, kernels
    from normexport.runtime import cuda_kernels

    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "fp32.onnx"
    files.save_model(model, src, external_data=False)
    found, asked = {}, []

    def from_table(path: Path, provider: str) -> str | None:
        fallbacks = cuda_kernels.without_kernel(ir.load(path))
        asked.append(len(fallbacks))
        return fallbacks[0].op.split(".")[-1] if len(fallbacks) > fp32 else None

    real = kernels.missing_kernel
    kernels.missing_kernel = from_table
    try:
        for precision in ("fp16", "bf16"):
            asked.clear()
            dst = folder / f"{precision}.onnx"
            try:
                done = convert.to_half(
                    src, dst, precision=precision, provider="cuda", keep_io_types=False,
                    refused=refused, external_data=False,
                )  # fmt: skip
            except UsageError as err:
                full = asked[0] if asked else None
                found[precision] = {"fully_converted": full, "refused": str(err)[:300]}
                continue
            found[precision] = {
                "fully_converted": asked[0],
                "after": asked[-1],
                "float32_op_types": done.float32_op_types,
            }
    finally:
        kernels.missing_kernel = real
    return found


def _cases(scratch: Path):
    """(kind, name, raw model, whether to convert it too) for every model of the module
    docstring."""
    import torch

    import models
    from models.demo import demo_options
    from models.norms import GALLERY
    from normexport import pipeline
    from normexport.arguments import make_options

    for name in models.ZOO:
        folder = scratch / "demo" / name
        folder.mkdir(parents=True)
        yield "demo", name, pipeline.prepare(demo_options(models.load(name), folder)).raw, True
    for entry in (e for e in GALLERY if e.dtype == torch.float32):
        for exporter in entry.exporters:
            shape = ",".join(map(str, entry.shape))
            opts = make_options(
                model="<gallery>", module=entry.build(), input_shape=[shape], exporter=exporter
            )
            raw = pipeline.prepare(opts).raw
            yield "gallery", f"{entry.name} ({exporter})", raw, exporter == "dynamo"
    for folder, kind in ((SHARED / "peer" / "ort", "peer"), (SHARED / "field", "field")):
        for path in sorted(folder.rglob("*.onnx")) if folder.exists() else ():
            yield kind, str(path.relative_to(folder)), ir.load(path), False


def write_chart(rows: list[dict], path: Path) -> None:
    """Nodes without a CUDA kernel summed per kind of model, as exported and after the passes
    (float32), and per precision fully converted and after the conversion."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from normexport.io.files import save_figure

    bars = []  # (label, before, after, models)
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        bars.append((f"{kind}\nfp32", sum(r["before"] for r in mine), sum(r["after"] for r in mine),
                     f"{len(mine)} models"))  # fmt: skip
    for precision in ("fp16", "bf16"):
        found = [r[precision] for r in rows if precision in r]
        refused = sum("refused" in f for f in found)
        full = sum(f["fully_converted"] or 0 for f in found if "refused" not in f)
        after = sum(f.get("after", 0) for f in found)
        bars.append((f"demo + gallery\n{precision}", full, after,
                     f"{len(found)} models, {refused} refused"))  # fmt: skip
    fig = Figure(figsize=(9, 4.5))
    ax = fig.subplots()
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [b[1] for b in bars], width=0.4, label="as exported / fully")
    ax.bar([x + 0.2 for x in xs], [b[2] for b in bars], width=0.4, label="normexport's output")
    for x, bar in zip(xs, bars, strict=True):
        ax.annotate(bar[3], (x, max(bar[1], bar[2])), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("nodes without a CUDA kernel")
    ax.set_title("ONNX Runtime's CUDA kernel table, checked without a GPU")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    from normexport.runtime import cuda_kernels

    rows = []
    with tempfile.TemporaryDirectory(prefix="cuda-kernels-") as tmp:
        for i, (kind, name, raw, halves) in enumerate(_cases(Path(tmp))):
            half = Path(tmp) / "half" / str(i) if halves else None
            rows.append({"kind": kind, "name": name, **_check(raw, half)})
            row = rows[-1]
            line = f"{kind:>7} {name}: fp32 {row['before']} -> {row['after']}"
            for precision in ("fp16", "bf16"):
                if precision in row:
                    found = row[precision]
                    after = found.get("after", "refused")
                    line += f"; {precision} {found['fully_converted']} -> {after}"
            print(line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"table": cuda_kernels.source(), "models": rows}
    (args.out / "cuda_kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    write_chart(rows, args.out / "cuda_kernels.png")
    worse = [r["name"] for r in rows if r["after"] > r["before"]]
    worse += [
        f"{r['name']} {p}"
        for r in rows
        for p in ("fp16", "bf16")
        if r.get(p, {}).get("after", 0) > r["after"]
    ]
    print(f"{len(rows)} models; more fallbacks after the passes: {worse or 'none'}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
