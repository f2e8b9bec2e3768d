"""The verdict on files made the way others make them (issue 60): each file through the whole
command, timed and measured from outside, so that the oracle, the memory plan, the inputs
normexport picks and the check as deployed are judged together.

The files, made here with PyTorch, transformers and ONNX Runtime's quantization tools in the
kinds the issue met in packages' wheels (weights random, statistics and norm weights too):

- ``eeg_dilated``: a 1-D CNN over 7,500 samples, Conv1d with dilations up to 4,096 and
  BatchNorm, then a small self-attention (dynamo export, opset 17);
- ``yolox_like``: a CSP-style detector backbone with BatchNorm and SiLU at 416x416, opset 11
  (TorchScript export, BatchNorm kept as written);
- ``densenet_like``: a DenseNet-style CNN (concatenated features, BatchNorm, pooling) at
  224x224, opset 13;
- ``vad_lstm``: a voice activity detector with state inputs (an LSTM's ``h`` and ``c``) and an
  ``If`` on the sample rate (TorchScript of a scripted module, opset 16);
- ``bert_token_types``: a transformers ``BertModel`` with ``token_type_ids`` indexing a 2-row
  table, symbolic batch and sequence (opset 17), run with no ``--dim``;
- ``t5_int8``: a transformers ``T5EncoderModel`` through ``quantize_dynamic``
  (MatMulInteger, DynamicQuantizeLinear; opset 18).

Each runs as ``python -m normexport FILE -o OUT --report R.json --no-benchmark`` from another
folder, under ``/usr/bin/time -v`` (wall seconds, peak resident set), with the report's stage
times, oracle, notes and parity. Writes ``field_verdict.json`` and ``.png`` to ``--out``.

    python benchmarks/field_verdict.py [--only eeg_dilated,t5_int8] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def _randomize(module: torch.nn.Module) -> torch.nn.Module:
    """Random BatchNorm statistics and norm weights (defaults hide bugs)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.2)
                m.running_var.uniform_(0.5, 2.0)
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm | torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    return module.eval()


class _EEG(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layers, width = [], 2
        for i in range(7):
            dilation = min(4**i, 4096)
            layers += [
                torch.nn.Conv1d(width, 32, 7, dilation=dilation, padding=3 * dilation),
                torch.nn.BatchNorm1d(32),
                torch.nn.ReLU(),
            ]
            width = 32
        self.convs = torch.nn.Sequential(*layers)
        self.pool = torch.nn.AvgPool1d(50)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x):
        h = self.pool(self.convs(x)).transpose(1, 2)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


def _conv_bn(cin, cout, k=3, s=1):
    return torch.nn.Sequential(
        torch.nn.Conv2d(cin, cout, k, s, k // 2, bias=False),
        torch.nn.BatchNorm2d(cout),
        torch.nn.SiLU(),
    )


class _CSP(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.a, self.b = _conv_bn(c, c // 2, 1), _conv_bn(c, c // 2, 1)
        self.m = torch.nn.Sequential(_conv_bn(c // 2, c // 2, 1), _conv_bn(c // 2, c // 2))
        self.out = _conv_bn(c, c, 1)

    def forward(self, x):
        a = self.a(x)
        return self.out(torch.cat([a + self.m(a), self.b(x)], 1))


class _YoloxLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        chans, layers, cin = [16, 32, 64, 128, 256], [], 3
        for c in chans:
            layers += [_conv_bn(cin, c, 3, 2), _CSP(c)]
            cin = c
        self.backbone = torch.nn.Sequential(*layers)
        self.up = torch.nn.Upsample(scale_factor=2, mode="nearest")
        self.neck = _conv_bn(256 + 128, 128)
        self.head = torch.nn.Conv2d(128, 85, 1)

    def forward(self, x):
        feats = []
        for i, layer in enumerate(self.backbone):
            x = layer(x)
            if i in (7, 9):
                feats.append(x)
        p4, p5 = feats
        return self.head(self.neck(torch.cat([self.up(p5), p4], 1)))


class _Dense(torch.nn.Module):
    def __init__(self, blocks=(4, 6, 8), growth=16):
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 7, 2, 3, bias=False),
            torch.nn.BatchNorm2d(32),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(3, 2, 1),
        )
        c, stages = 32, []
        for n in blocks:
            layers = []
            for _ in range(n):
                layers.append(
                    torch.nn.Sequential(
                        torch.nn.BatchNorm2d(c),
                        torch.nn.ReLU(),
                        torch.nn.Conv2d(c, 4 * growth, 1, bias=False),
                        torch.nn.BatchNorm2d(4 * growth),
                        torch.nn.ReLU(),
                        torch.nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False),
                    )
                )
                c += growth
            stages.append(torch.nn.ModuleList(layers))
            stages.append(
                torch.nn.Sequential(
                    torch.nn.BatchNorm2d(c), torch.nn.Conv2d(c, c // 2, 1), torch.nn.AvgPool2d(2)
                )
            )
            c //= 2
        self.stages = torch.nn.ModuleList(stages)
        self.head = torch.nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            if isinstance(stage, torch.nn.ModuleList):
                for layer in stage:
                    x = torch.cat([x, layer(x)], 1)
            else:
                x = stage(x)
        return self.head(x.mean((2, 3)))


class _VAD(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stft = torch.nn.Conv1d(1, 64, 256, 128, bias=False)
        self.norm = torch.nn.BatchNorm1d(64)
        self.lstm = torch.nn.LSTM(64, 64, batch_first=True)
        self.out = torch.nn.Linear(64, 1)

    def forward(self, x, h, c, sr):
        if bool(sr == 8000):
            x = torch.nn.functional.interpolate(x, scale_factor=2.0)
        feats = torch.relu(self.norm(self.stft(x))).transpose(1, 2)
        y, (h2, c2) = self.lstm(feats, (h, c))
        return torch.sigmoid(self.out(y[:, -1])), h2, c2


def make_files(folder: Path) -> dict[str, Path]:
    """Write every file of the module docstring to ``folder``; name -> path."""
    made = {}
    eeg = folder / "eeg_dilated.onnx"
    torch.onnx.export(
        _randomize(_EEG()), (torch.randn(1, 2, 7500),), eeg, dynamo=True, opset_version=17
    )
    made["eeg_dilated"] = eeg
    yolox = folder / "yolox_like.onnx"
    torch.onnx.export(
        _randomize(_YoloxLike()),
        (torch.randn(1, 3, 416, 416),),
        yolox,
        dynamo=False,
        opset_version=11,
        training=torch.onnx.TrainingMode.PRESERVE,
        input_names=["images"],
    )
    made["yolox_like"] = yolox
    dense = folder / "densenet_like.onnx"
    torch.onnx.export(
        _randomize(_Dense()),
        (torch.randn(1, 3, 224, 224),),
        dense,
        dynamo=False,
        opset_version=13,
        training=torch.onnx.TrainingMode.PRESERVE,
        input_names=["image"],
    )
    made["densenet_like"] = dense
    vad = folder / "vad_lstm.onnx"
    feeds = (torch.randn(1, 1, 4096), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64))
    torch.onnx.export(
        torch.jit.script(_randomize(_VAD())),
        (*feeds, torch.tensor(16000)),
        vad,
        dynamo=False,
        opset_version=16,
        input_names=["input", "h", "c", "sr"],
        dynamic_axes={"input": {0: "batch", 2: "samples"}, "h": {1: "batch"}, "c": {1: "batch"}},
    )
    made["vad_lstm"] = vad
    made["bert_token_types"] = _bert(folder)
    made["t5_int8"] = _t5_int8(folder)
    return made


def _bert(folder: Path) -> Path:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        type_vocab_size=2,
    )
    model = _randomize(BertModel(config))
    ids = torch.randint(0, 100, (1, 16))
    path = folder / "bert_token_types.onnx"
    names = ["input_ids", "attention_mask", "token_type_ids"]
    torch.onnx.export(
        model,
        (ids, torch.ones_like(ids), torch.zeros_like(ids)),
        path,
        dynamo=False,
        opset_version=17,
        input_names=names,
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names},
    )
    return path


def _t5_int8(folder: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=200, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    model = _randomize(T5EncoderModel(config))
    ids = torch.randint(0, 200, (1, 16))
    float32 = folder / "t5_float32.onnx"
    torch.onnx.export(
        model,
        (ids,),
        float32,
        dynamo=False,
        opset_version=18,
        input_names=["input_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
    )
    path = folder / "t5_int8.onnx"
    quantize_dynamic(float32, path, weight_type=QuantType.QInt8)
    return path


def run_file(name: str, path: Path, work: Path) -> dict:
    """The whole command on ``path`` from ``work`` (another folder than the file's), with
    its exit code, wall seconds, peak resident set (bytes) and the report's facts."""
    out, report = work / f"{name}.opt.onnx", work / f"{name}.json"
    command = [sys.executable, "-m", "normexport", str(path), "-o", str(out)]
    command += ["--report", str(report), "--no-benchmark"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-v", *command], cwd=work, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    entry = {
        "file": name,
        "exit": done.returncode,
        "wall_s": round(wall, 2),
        "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
        "error": done.stderr.strip().splitlines()[-25] if done.returncode > 1 else None,
    }
    if report.exists():
        found = json.loads(report.read_text())
        parity = found.get("parity") or {}
        entry |= {
            "stages_s": {s["name"]: round(s["wall_s"], 2) for s in found["cost"]["stages"]},
            "oracle": parity.get("oracle"),
            "oracle_notes": parity.get("oracle_notes") or parity.get("notes"),
            "passed": found.get("passed"),
            "inputs": found.get("inputs"),
            "memory_line": (found.get("memory") or {}).get("line"),
            "fusions": {k: v for k, v in found["fusions"]["counts"].items() if v},
        }
    return entry


def chart(entries: list[dict], path: Path) -> None:
    """Wall seconds (stages stacked) and peak memory per file, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [e["file"] for e in entries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    stages = sorted({s for e in entries for s in e.get("stages_s", {})})
    bottom = np.zeros(len(entries))
    for stage in stages:
        values = np.array([e.get("stages_s", {}).get(stage, 0.0) for e in entries])
        left.barh(names, values, left=bottom, label=stage)
        bottom += values
    left.set_xlabel("seconds (the report's stages)")
    left.legend(fontsize=7)
    right.barh(names, [(e["peak_rss_bytes"] or 0) / 2**30 for e in entries])
    right.set_xlabel("peak resident set (GiB)")
    for ax in (left, right):
        ax.invert_yaxis()
    fig.suptitle("normexport on files made the way others make them (--no-benchmark)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, work = Path(tmp, "files"), Path(tmp, "work")
        folder.mkdir()
        work.mkdir()
        files = make_files(folder)
        only = [n for n in args.only.split(",") if n] or list(files)
        entries = []
        for name in only:
            entry = run_file(name, files[name], work)
            entries.append(entry)
            print(json.dumps(entry)[:400], flush=True)
    machine = {"cores": os.cpu_count(), "torch": torch.__version__}
    result = {"machine": machine, "files": entries}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "field_verdict.json").write_text(json.dumps(result, indent=1) + "\n")
    chart(entries, args.out / "field_verdict.png")


if __name__ == "__main__":
    main()
