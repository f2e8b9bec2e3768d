"""Decoders at the speed of the best tool (issue 25): prefill latency of small LLaMA, Qwen3,
Gemma and Phi-3 models against every other way a user would get an ONNX model of them.

Each family is transformers' ``*ForCausalLM`` at a small configuration (hidden 256, 4 layers,
8 query heads sharing 4 key/value heads, vocabulary 1000), random weights, every norm weight
random. It is exported the way users do, ``torch.onnx.export`` (dynamo) with symbolic batch
and sequence, logits out, no cache, and timed on ONNX Runtime's CPU provider (2 intra-op
threads, spinning off, interleaved, per-round paired ratios with 95% intervals) as:

- ``ort_raw``, ``onnxscript_ort``, ``ort_transformers``, ``normexport``: the export as is and
  after each optimizer (:func:`normexport.tuning.variants.build_variants`; normexport's is
  ``fusion.optimize`` as a CPU run makes it);
- ``genai``: onnxruntime-genai's model builder on the same weights
  (``python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32 -e cpu`` on a
  ``save_pretrained`` folder with a throwaway tokenizer), fed an all-ones attention mask and an
  empty KV cache; skipped, and said so, where ``onnxruntime_genai`` is not installed
  (``pip install --no-deps onnxruntime-genai``: its dependencies would put the CPU onnxruntime
  over onnxruntime-gpu).

Every variant's logits are compared with PyTorch's at each point (max abs difference).
Targets: normexport's model no slower than the best other variant (the interval of other /
normexport reaches 1.0 or above) and never slower than the raw export.

    python benchmarks/decoders.py [--families llama,qwen3,gemma,phi3] [--batch 1,4]
                                  [--seq 128,512] [--budget 8] [--out DIR]

Writes ``decoders_cpu.json`` and ``decoders_cpu.png`` to ``--out`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from rich.console import Console
from rich.table import Table

from normexport.bench.render import fmt_ratio
from normexport.bench.results import Machine
from normexport.io.export import export_module
from normexport.io.files import save_figure, save_model
from normexport.runtime import make_session
from normexport.runtime.latency import paired_ratio, runner, time_interleaved
from normexport.tuning import variants

COMMON = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 32}),
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"original_max_position_embeddings": 2048},  # the builder's short-RoPE Phi-3
    ),
}
#: The optimizers' variants timed (see the module docstring).
VARIANTS = ("ort_raw", "onnxscript_ort", "ort_transformers", "normexport")


class Logits(torch.nn.Module):
    """A causal LM's logits for ``input_ids``, no cache (what the raw export computes)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_model(family: str) -> torch.nn.Module:
    """The family's small causal LM, seeded random weights, every norm weight random."""
    config, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma scales by 1 + w, the others by w
                p.copy_(0.3 * torch.randn_like(p) + (family != "gemma"))
    return model


def _genai(model: torch.nn.Module, folder: Path) -> tuple[Path | None, str | None]:
    """The builder's model of ``model`` (saved to ``folder``), or None and why not."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return None, "onnxruntime_genai is not installed (pip install --no-deps onnxruntime-genai)"
    from tokenizers import Tokenizer, models

    hf, out = folder / "hf", folder / "genai"
    model.save_pretrained(hf)
    vocab = {f"t{i}": i for i in range(COMMON["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf)]
    command += ["-o", str(out), "-p", "fp32", "-e", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return None, done.stderr.strip().splitlines()[-1]
    return out / "model.onnx", None


def _feeds(session, ids: np.ndarray) -> dict[str, np.ndarray]:
    """``ids`` and, for the builder's model, an all-ones mask and an empty KV cache."""
    feeds = {}
    for spec in session.get_inputs():
        if spec.name == "input_ids":
            feeds[spec.name] = ids
        elif spec.name == "attention_mask":
            feeds[spec.name] = np.ones(ids.shape, np.int64)
        else:  # past_key_values.*: (batch, kv heads, 0, head size)
            heads, size = spec.shape[1], COMMON["hidden_size"] // COMMON["num_attention_heads"]
            feeds[spec.name] = np.zeros((ids.shape[0], heads, 0, size), np.float32)
    return feeds


def bench_family(family: str, points, budget_s: float, console: Console) -> dict:
    """Build, check and time one family at each (batch, sequence) point; its JSON entry."""
    model = build_model(family)
    module = Logits(model)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="decoders-") as tmp:
        folder = Path(tmp)
        ids = rng.integers(0, COMMON["vocab_size"], (2, 16))  # batch 1 would specialize it
        raw = export_module(
            module, [torch.from_numpy(ids)], input_names=["input_ids"], exporter="dynamo",
            dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
        ).model  # fmt: skip
        raw_path = folder / "raw" / "model.onnx"
        raw_path.parent.mkdir()
        save_model(raw, raw_path, external_data=True)
        (folder / "variants").mkdir()
        built = variants.build_variants(raw_path, "cpu", folder / "variants", only=VARIANTS)
        paths = {k: v.model for k, v in built.items() if v.model is not None}
        genai, genai_error = _genai(model, folder)
        if genai is not None:
            paths["genai"] = genai
        entry = {
            "variants": {k: v.to_dict() for k, v in built.items()},
            "genai_error": genai_error,
            "points": [],
        }
        sessions = {k: make_session(p, "cpu", spinning=False) for k, p in paths.items()}
        for batch, seq in points:
            ids = rng.integers(0, COMMON["vocab_size"], (batch, seq))
            entry["points"].append(_point(module, sessions, ids, budget_s))
            console.print(f"{family} batch {batch} sequence {seq}: done")
    return entry


def _point(module, sessions: dict, ids: np.ndarray, budget_s: float) -> dict:
    """Time every session on ``ids``, interleaved; ratios to normexport, errors vs PyTorch."""
    with torch.no_grad():
        expected = module(torch.from_numpy(ids)).numpy()
    runners, errors = {}, {}
    for name, session in sessions.items():
        call, outputs = runner(session, _feeds(session, ids), io_binding=False)
        errors[name] = float(np.abs(outputs()[0] - expected).max())
        runners[name] = call
    timings = time_interleaved(runners, budget_s=budget_s, min_runs=10)
    base = timings["normexport"]
    return {
        "batch": int(ids.shape[0]),
        "sequence": int(ids.shape[1]),
        "median_ms": {k: t.median_ms for k, t in timings.items()},
        "ratio_to_normexport": {
            k: paired_ratio(t, base).to_dict() for k, t in timings.items() if k != "normexport"
        },
        "max_abs_error_vs_pytorch": errors,
    }


def _targets(point: dict) -> dict:
    """Whether normexport meets issue 25's targets at ``point``."""
    ratios = point["ratio_to_normexport"]
    best = min(ratios, key=lambda k: ratios[k]["median"])
    return {
        "best_other": best,
        "not_slower_than_best": ratios[best]["ci_high"] >= 1.0,
        "not_slower_than_raw": ratios["ort_raw"]["ci_high"] >= 1.0,
    }


def _chart(results: dict, path: Path) -> None:
    """Each variant's time over normexport's, per family and point (above 1: normexport is
    faster)."""
    import matplotlib.pyplot as plt

    labels, series = [], {}
    for family, entry in results["families"].items():
        for point in entry["points"]:
            labels.append(f"{family}\nb{point['batch']} s{point['sequence']}")
            for name, ratio in point["ratio_to_normexport"].items():
                series.setdefault(name, []).append(ratio["median"])
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(values))]
        ax.bar(xs, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("time / normexport's time")
    ax.set_title("Decoder prefill on ONNX Runtime CPU (2 threads): above 1, normexport is faster")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write JSON and PNG; print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--batch", default="1,4")
    p.add_argument("--seq", default="128,512")
    p.add_argument("--budget", type=float, default=8.0, help="timing seconds per point")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    points = [(int(b), int(s)) for b in args.batch.split(",") for s in args.seq.split(",")]
    console = Console()
    results = {"machine": Machine.probe("cpu").to_dict(), "config": COMMON, "families": {}}
    for family in args.families.split(","):
        results["families"][family] = bench_family(family, points, args.budget, console)
    for entry in results["families"].values():
        for point in entry["points"]:
            point["targets"] = _targets(point)
    (args.out / "decoders_cpu.json").write_text(json.dumps(results, indent=1))
    _chart(results, args.out / "decoders_cpu.png")
    _table(results, console)
    return 0


def _table(results: dict, console: Console) -> None:
    table = Table(title="time / normexport's time (95% interval); > 1: normexport is faster")
    names = sorted({n for e in results["families"].values() for p in e["points"]
                    for n in p["ratio_to_normexport"]})  # fmt: skip
    for column in ("family", "batch", "seq", "normexport ms", *names):
        table.add_column(column)
    for family, entry in results["families"].items():
        for point in entry["points"]:
            ratios = point["ratio_to_normexport"]
            cells = [fmt_ratio(ratios[n]) if n in ratios else "-" for n in names]
            ms = f"{point['median_ms']['normexport']:.2f}"
            table.add_row(family, str(point["batch"]), str(point["sequence"]), ms, *cells)
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
