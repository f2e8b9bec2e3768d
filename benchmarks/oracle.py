"""The float64 oracle of an ONNX file (:func:`normexport.verdict.oracle.onnx_float64`) on files
like issue 60's, which other people made and whose oracle ran on ``onnx.reference``: killed at
23 GB, a minute of the reference stage, or exit 3.

Builds, in a temporary folder (deleted afterwards; ``--keep DIR`` keeps them there):

- ``eeg``: a 1-D CNN over 7,500 samples of 2 channels: a stem Conv, 12 residual blocks of a
  dilated Conv1d (dilation 1 to 4,096) with BatchNorm and ReLU, a strided Conv, multi-head
  attention over the 469 steps left, a linear head (TorchScript exporter, opset 17);
- ``yolox``: a YOLOX-like detector at 416x416: Focus, depthwise-separable CSP stages, SPP
  (MaxPool 5, 9, 13), an FPN with nearest upsampling, decoupled heads (TorchScript exporter,
  opset 11);
- ``t5q``: a 2-layer T5 encoder (transformers, random weights) exported at opset 18 and
  quantized by ``onnxruntime.quantization.quantize_dynamic`` (int8 weights:
  ``DynamicQuantizeLinear``, ``MatMulInteger``, ``DequantizeLinear``);
- ``vad``: a voice-activity-like graph built with ``onnx.helper``: ``If`` on the sample rate
  choosing a spectrum, then an LSTM with state inputs inside another ``If``;
- ``densenet``: a DenseNet-style CNN at 224x224 (concatenated features, BatchNorm before each
  Conv, max and average pooling; TorchScript exporter, opset 13, BatchNorm kept);
- ``bert``: a transformers ``BertModel`` whose ``token_type_ids`` index a 2-row table, batch and
  sequence symbolic, run with no ``--dim`` and no ``--inputs`` (normexport picks the sizes and
  draws the ids within each table).

Measured for each: the whole CLI from another folder (``python -m normexport FILE -o OUT
--no-benchmark --report R``) in a fresh process: exit code, wall time, the report's peak RSS
and stage times, the oracle and its notes, the float32 islands; and, for the CNNs, the oracle
alone on one input set (the median of 3 runs after one): as built (Conv's float64 form), with
Conv made a float32 island instead, and the file as written in float32, with the islands'
largest error against the form.

    python benchmarks/oracle.py [--only eeg,yolox] [--keep DIR] [--out benchmarks/results]

Writes ``oracle_cpu.json`` and ``oracle_cpu.png`` (each file's stages and peak memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn
from torch.nn import functional

from normexport import runtime
from normexport.verdict import float64_forms, oracle

ROOT = Path(__file__).resolve().parents[1]


class _Dilated(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, dilation=dilation, padding=dilation)
        self.bn = nn.BatchNorm1d(channels)

    def forward(self, x):
        return x + functional.relu(self.bn(self.conv(x)))


class Eeg(nn.Module):
    """The 1-D CNN with attention (see the module docstring)."""

    def __init__(self, channels: int = 96):
        super().__init__()
        self.stem = nn.Conv1d(2, channels, 7, padding=3)
        dilations = [2**i for i in range(13) if i != 1]  # 12 blocks, 1 to 4096
        self.blocks = nn.ModuleList([_Dilated(channels, d) for d in dilations])
        self.down = nn.Conv1d(channels, channels, 16, stride=16)
        self.attention = nn.MultiheadAttention(channels, 4, batch_first=True)
        self.head = nn.Linear(channels, 5)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        h = self.down(h).transpose(1, 2)
        a, _ = self.attention(h, h, h)
        return self.head((h + a).mean(1))


def _cba(ci: int, co: int, k: int = 3, s: int = 1, groups: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(ci, co, k, s, k // 2, groups=groups, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(co), nn.SiLU())


class _Csp(nn.Module):
    def __init__(self, c: int, n: int = 1):
        super().__init__()
        h = c // 2
        self.a, self.b, self.out = _cba(c, h, 1), _cba(c, h, 1), _cba(2 * h, c, 1)
        self.m = nn.Sequential(*[nn.Sequential(_cba(h, h, 1), _cba(h, h, 3)) for _ in range(n)])

    def forward(self, x):
        return self.out(torch.cat([self.m(self.a(x)), self.b(x)], 1))


def _down(ci: int, co: int) -> nn.Sequential:
    """Depthwise-separable, stride 2."""
    return nn.Sequential(_cba(ci, ci, 3, 2, groups=ci), _cba(ci, co, 1))


class _Spp(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.a, self.out = _cba(c, c // 2, 1), _cba(c // 2 * 4, c, 1)
        self.pools = nn.ModuleList([nn.MaxPool2d(k, 1, k // 2) for k in (5, 9, 13)])

    def forward(self, x):
        x = self.a(x)
        return self.out(torch.cat([x] + [p(x) for p in self.pools], 1))


class Yolox(nn.Module):
    """The YOLOX-like detector (see the module docstring)."""

    def __init__(self, w: int = 16, classes: int = 80):
        super().__init__()
        self.stem = _cba(12, w)
        self.c3 = nn.Sequential(_down(w, 2 * w), _Csp(2 * w), _down(2 * w, 4 * w), _Csp(4 * w, 2))
        self.c4 = nn.Sequential(_down(4 * w, 8 * w), _Csp(8 * w, 2))
        self.c5 = nn.Sequential(_down(8 * w, 16 * w), _Spp(16 * w), _Csp(16 * w))
        self.lat5, self.p4 = _cba(16 * w, 8 * w, 1), _Csp(16 * w)
        self.lat4, self.p3 = _cba(16 * w, 4 * w, 1), _Csp(8 * w)
        self.heads = nn.ModuleList()
        for c in (8 * w, 16 * w, 16 * w):
            stem = _cba(c, 4 * w, 1)
            cls = nn.Sequential(_cba(4 * w, 4 * w, 3, groups=4 * w), nn.Conv2d(4 * w, classes, 1))
            reg = nn.Sequential(_cba(4 * w, 4 * w, 3, groups=4 * w), nn.Conv2d(4 * w, 5, 1))
            self.heads.append(nn.ModuleList([stem, cls, reg]))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, x):
        x = torch.cat(
            [x[..., ::2, ::2], x[..., 1::2, ::2], x[..., ::2, 1::2], x[..., 1::2, 1::2]], 1
        )
        c3 = self.c3(self.stem(x))
        c4 = self.c4(c3)
        c5 = self.c5(c4)
        l5 = self.lat5(c5)
        p4 = self.p4(torch.cat([self.up(l5), c4], 1))
        l4 = self.lat4(p4)
        p3 = self.p3(torch.cat([self.up(l4), c3], 1))
        outs = []
        for f, (stem, cls, reg) in zip((p3, p4, torch.cat([l5, l5], 1)), self.heads, strict=True):
            f = stem(f)
            outs.append(torch.cat([reg(f), cls(f).sigmoid()], 1).flatten(2))
        return torch.cat(outs, 2).permute(0, 2, 1)


class _Dense(nn.Module):
    def __init__(self, blocks=(4, 6, 8), growth=16):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 7, 2, 3, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        c, stages = 32, []
        for n in blocks:
            layers = []
            for _ in range(n):
                layers.append(
                    nn.Sequential(
                        nn.BatchNorm2d(c),
                        nn.ReLU(),
                        nn.Conv2d(c, 4 * growth, 1, bias=False),
                        nn.BatchNorm2d(4 * growth),
                        nn.ReLU(),
                        nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False),
                    )
                )
                c += growth
            stages.append(nn.ModuleList(layers))
            stages.append(
                nn.Sequential(nn.BatchNorm2d(c), nn.Conv2d(c, c // 2, 1), nn.AvgPool2d(2))
            )
            c //= 2
        self.stages = nn.ModuleList(stages)
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            if isinstance(stage, nn.ModuleList):
                for layer in stage:
                    x = torch.cat([x, layer(x)], 1)
            else:
                x = stage(x)
        return self.head(x.mean((2, 3)))


def _randomized(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2)
        if isinstance(m, nn.modules.batchnorm._BatchNorm | nn.LayerNorm):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0, 0.1)
    return model.eval()


def build_eeg(folder: Path) -> Path:
    path = folder / "eeg.onnx"
    x = torch.randn(1, 2, 7500)
    torch.onnx.export(_randomized(Eeg()), (x,), path, opset_version=17, dynamo=False)
    return path


def build_yolox(folder: Path) -> Path:
    path = folder / "yolox.onnx"
    x = torch.randn(1, 3, 416, 416)
    torch.onnx.export(_randomized(Yolox()), (x,), path, opset_version=11, dynamo=False)
    return path


def build_t5q(folder: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    encoder = T5EncoderModel(config).eval()

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, ids, mask):
            return self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state

    ids, mask = torch.randint(0, 512, (1, 16)), torch.ones(1, 16, dtype=torch.int64)
    float32 = folder / "t5.onnx"
    with torch.no_grad():
        torch.onnx.export(Hidden().eval(), (ids, mask), float32, opset_version=18, dynamo=False)
    path = folder / "t5q.onnx"
    quantize_dynamic(float32, path, weight_type=QuantType.QInt8)
    return path


def build_vad(folder: Path, hidden: int = 64) -> Path:
    """The voice-activity graph (see the module docstring) and its example inputs (``.npz``:
    the sample rate 16000, the state zeros)."""
    rng = np.random.default_rng(0)
    weights = {
        "basis16": rng.standard_normal((256, 129)) * 0.3,
        "basis8": rng.standard_normal((128, 129)) * 0.3,
        "enc": rng.standard_normal((129, hidden)) * 0.3,
        "W": rng.standard_normal((1, 4 * hidden, hidden)) * 0.3,
        "R": rng.standard_normal((1, 4 * hidden, hidden)) * 0.3,
        "B": rng.standard_normal((1, 8 * hidden)) * 0.3,
        "dec": rng.standard_normal((hidden, 1)) * 0.3,
        "eps": np.array(1e-3),
    }
    ints = {
        "rate": 16000,
        "zero": [0],
        "one": [1],
        "two": [2],
        "ax1": [1],
        "n16": [256],
        "n8": [128],
    }
    tensors = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in weights.items()]
    tensors += [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in ints.items()]
    nodes = [
        helper.make_node("Equal", ["sr", "rate"], ["is16"]),
        helper.make_node(
            "If", ["is16"], ["spec"], then_branch=_spectrum("16", "n16", "basis16"),
            else_branch=_spectrum("8", "n8", "basis8"),
        ),
        helper.make_node("Add", ["spec", "eps"], ["spec_eps"]),
        helper.make_node("Log", ["spec_eps"], ["log_spec"]),
        helper.make_node("MatMul", ["log_spec", "enc"], ["encoded"]),
        helper.make_node("Relu", ["encoded"], ["feat"]),
        helper.make_node(
            "If", ["is16"], ["steps", "state_out"], then_branch=_lstm("16", hidden),
            else_branch=_lstm("8", hidden),
        ),
        helper.make_node("Relu", ["steps"], ["steps_relu"]),
        helper.make_node("MatMul", ["steps_relu", "dec"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["prob"]),
    ]  # fmt: skip
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"]),
        helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 1, hidden]),
        helper.make_tensor_value_info("sr", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("prob", "state_out")
    ]
    graph = helper.make_graph(nodes, "vad", inputs, outputs, tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)
    path = folder / "vad.onnx"
    onnx.save(model, path)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    state = np.zeros((2, 1, hidden), np.float32)
    np.savez(folder / "vad.npz", x=x, state=state, sr=np.array(16000, np.int64))
    return path


def _spectrum(rate: str, length: str, basis: str) -> onnx.GraphProto:
    nodes = [
        helper.make_node("Slice", ["x", "zero", length, "ax1"], [f"frame{rate}"]),
        helper.make_node("MatMul", [f"frame{rate}", basis], [f"proj{rate}"]),
        helper.make_node("Abs", [f"proj{rate}"], [f"spec{rate}"]),
    ]
    out = [helper.make_tensor_value_info(f"spec{rate}", TensorProto.FLOAT, None)]
    return helper.make_graph(nodes, f"spectrum{rate}", [], out)


def _lstm(rate: str, hidden: int) -> onnx.GraphProto:
    h0, c0, seq = f"h0_{rate}", f"c0_{rate}", f"seq_{rate}"
    nodes = [
        helper.make_node("Unsqueeze", ["feat", "zero"], [seq]),
        helper.make_node("Slice", ["state", "zero", "one", "zero"], [h0]),
        helper.make_node("Slice", ["state", "one", "two", "zero"], [c0]),
        helper.make_node(
            "LSTM", [seq, "W", "R", "B", "", h0, c0], [f"Y{rate}", f"Yh{rate}", f"Yc{rate}"],
            hidden_size=hidden,
        ),
        helper.make_node("Concat", [f"Yh{rate}", f"Yc{rate}"], [f"state{rate}"], axis=0),
        helper.make_node("Squeeze", [f"Y{rate}", "ax1"], [f"steps{rate}"]),
    ]  # fmt: skip
    out = [
        helper.make_tensor_value_info(f"steps{rate}", TensorProto.FLOAT, None),
        helper.make_tensor_value_info(f"state{rate}", TensorProto.FLOAT, None),
    ]
    return helper.make_graph(nodes, f"lstm{rate}", [], out)


def build_densenet(folder: Path) -> Path:
    path = folder / "densenet.onnx"
    x = torch.randn(1, 3, 224, 224)
    torch.onnx.export(
        _randomized(_Dense()),
        (x,),
        path,
        opset_version=13,
        dynamo=False,
        training=torch.onnx.TrainingMode.PRESERVE,  # BatchNormalization kept as written
    )
    return path


def build_bert(folder: Path) -> Path:
    """A transformers BertModel (random weights, randomized LayerNorms) whose token_type_ids
    index a 2-row table, batch and sequence symbolic: run with no --dim and no --inputs."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        type_vocab_size=2,
    )
    bert = _randomized(BertModel(config))

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask, types):
            out = self.bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
            return out.last_hidden_state, out.pooler_output

    ids = torch.randint(0, 100, (1, 16))
    path = folder / "bert.onnx"
    names = ["input_ids", "attention_mask", "token_type_ids"]
    torch.onnx.export(
        Hidden().eval(),
        (ids, torch.ones_like(ids), torch.zeros_like(ids)),
        path,
        dynamo=False,
        opset_version=17,
        input_names=names,
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names},
    )
    return path


BUILD = {
    "eeg": build_eeg,
    "yolox": build_yolox,
    "densenet": build_densenet,
    "t5q": build_t5q,
    "vad": build_vad,
    "bert": build_bert,
}


def cli_run(path: Path, folder: Path) -> dict:
    """The whole CLI on ``path``, from another folder, in a fresh process."""
    report = folder / f"{path.stem}.report.json"
    args = [
        sys.executable,
        "-m",
        "normexport",
        str(path),
        "-o",
        str(folder / f"{path.stem}.opt.onnx"),
    ]
    args += ["--no-benchmark", "--report", str(report)]
    if (path.parent / f"{path.stem}.npz").exists():
        args += ["--inputs", str(path.parent / f"{path.stem}.npz")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = {"exit": done.returncode, "wall_s": round(wall, 2)}
    if not report.exists():
        return {**found, "stderr": done.stderr[-2000:]}
    result = json.loads(report.read_text())
    parity, cost = result["parity"], result["cost"]
    stages = {s["name"]: round(s["wall_s"], 2) for s in cost["stages"]}
    return {
        **found,
        "peak_rss_bytes": cost["peak_rss_bytes"],
        "stages_s": stages,
        "largest_stage": max(stages, key=stages.get),
        "passed": parity["passed"],
        "oracle": parity["oracle"],
        "oracle_notes": parity["oracle_notes"],
        "oracle_float32": parity["oracle_float32"],
    }


def per_input_set(path: Path, folder: Path) -> dict:
    """One input set's oracle run (the median of 3 after one): Conv's float64 form, Conv a
    float32 island, the file as written."""
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    (inp,) = session.get_inputs()
    feeds = {inp.name: np.random.default_rng(0).standard_normal(inp.shape).astype(np.float32)}
    as_written = lambda f: runtime.run(session, f)  # noqa: E731
    found = {"float32_file_s": _timed(lambda: as_written(feeds))}
    outputs = {}
    for name, forms in (("conv_form", float64_forms.FORMS), ("conv_island", _without_conv())):
        saved, float64_forms.FORMS = float64_forms.FORMS, forms
        try:
            run = oracle.onnx_float64(ir.load(path), as_written, feeds, folder, "the file").run
        finally:
            float64_forms.FORMS = saved
        found[f"{name}_s"] = _timed(lambda run=run: run(feeds))
        outputs[name] = run(feeds)[0]
        run.close()
    scale = np.abs(outputs["conv_form"]).max()
    err = np.abs(outputs["conv_island"] - outputs["conv_form"]).max()
    found["conv_island_max_abs_err"] = float(err)
    found["max_abs_oracle"] = float(scale)
    return found


def _without_conv() -> dict:
    return {k: v for k, v in float64_forms.FORMS.items() if k != ("", "Conv")}


def _timed(call) -> float:
    call()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(float(np.median(times)), 4)


def chart(results: dict, path: Path) -> None:
    """Each file's whole run: its stages' seconds stacked, and its peak memory, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: found["cli"] for name, found in results.items()}
    names = list(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    stages = list(dict.fromkeys(s for run in runs.values() for s in run.get("stages_s", {})))
    bottom = np.zeros(len(names))
    for stage in stages:
        values = np.array([runs[n].get("stages_s", {}).get(stage, 0.0) for n in names])
        left.barh(names, values, left=bottom, label=stage)
        bottom += values
    left.set_xlabel("seconds (the report's stages)")
    left.legend(fontsize=7)
    right.barh(names, [runs[n].get("peak_rss_bytes", 0) / 2**30 for n in names])
    right.set_xlabel("peak resident set (GiB)")
    for ax in (left, right):
        ax.invert_yaxis()
    fig.suptitle("normexport FILE --no-benchmark on files like issue 60's (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(BUILD))
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results = {}
    with tempfile.TemporaryDirectory(prefix="oracle-bench-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.only.split(","):
            path = BUILD[name](folder)
            work = folder / f"run-{name}"
            work.mkdir(exist_ok=True)
            results[name] = {"cli": cli_run(path, work)}
            if name in ("eeg", "yolox"):
                results[name]["per_input_set"] = per_input_set(path, work)
            print(name, json.dumps(results[name], indent=1)[:2000], flush=True)
    machine = {"cpus": os.cpu_count(), "onnxruntime": onnxruntime.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "oracle_cpu.json"
    out.write_text(json.dumps({"machine": machine, "models": results}, indent=1) + "\n")
    chart(results, out.with_suffix(".png"))
    print(f"wrote {out} and its chart")


if __name__ == "__main__":
    main()
