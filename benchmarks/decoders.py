"""Decoders at the speed of the best tool (issue 25): prefill and decode-step latency of small
LLaMA, Qwen2, Qwen3, Gemma and Phi-3 models against every other way a user would get an ONNX
model of them.

Each family is transformers' ``*ForCausalLM`` at a small configuration (hidden 256, 4 layers,
8 query heads sharing 4 key/value heads, vocabulary 1000), random weights, every norm weight
and bias random (transformers initializes Qwen2's query, key and value biases to 0). It is
exported the way users do, ``torch.onnx.export`` (dynamo) with symbolic axes:

- prefill: logits of ``input_ids`` (batch, sequence), no cache;
- decode: one step with the KV cache as tensors (:class:`WithPast`: ``input_ids``,
  ``attention_mask``, ``past_key_values.N.key/value`` in; ``logits``, ``present.N.key/value``
  out, as Optimum and onnxruntime-genai name them), at a past length, sequence 1, random cache;

and timed on ONNX Runtime's CPU provider (2 intra-op threads, spinning off, interleaved,
per-round paired ratios with 95% intervals) as:

- ``ort_raw``, ``onnxscript_ort``, ``ort_transformers``, ``normexport``: the export as is and
  after each optimizer (:func:`normexport.bench.variants.build_variants`; normexport's is
  ``fusion.optimize`` as a CPU run makes it);
- ``genai``: onnxruntime-genai's model builder on the same weights
  (``python -m onnxruntime_genai.models.builder -i FOLDER -o OUT -p fp32 -e cpu`` on a
  ``save_pretrained`` folder with a throwaway tokenizer); for prefill fed an all-ones mask and
  an empty cache; skipped, and said so, where ``onnxruntime_genai`` is not installed
  (``pip install --no-deps onnxruntime-genai``: its dependencies would put the CPU onnxruntime
  over onnxruntime-gpu).

Also timed, to show why normexport fuses what it fuses (:data:`FORMS`, not counted as other
tools): its model with MultiHeadAttention instead of GroupQueryAttention (``normexport_mha``),
with the norms alone (``normexport_unfused``), and with the Skip ops everywhere
(``normexport_skip``; the CPU policy puts them in a model with a KV cache only). And the
encoders of the issue (:data:`ENCODERS`: ViT-Tiny's shape, a CLIP vision tower, BERT with a
padding mask; batch only symbolic; every norm weight and bias random), against the same
optimizers.

Each variant is ``--copies`` sessions (default 2), opened in ABBA order and timed in turn
(:func:`normexport.latency.measure.counterbalanced`), every round in a random order: with one
session each, opened in the order above, and each round in a rotated order (every variant after
the same other one), a second session of normexport's own file ran faster than the first at
every decode step of an earlier run (its control), so the tools opened and timed after
normexport's were favoured.

A control (:data:`CONTROL`, ``normexport_again``): other sessions of normexport's own file,
timed like the others. Its ratio is 1 but for what the bootstrap interval does not see (where
each session's weights and buffers lie): a difference from another tool no larger than the
control's is no difference.

Every variant's outputs (logits, and the present cache of a decode step) are compared by name
with PyTorch's at each point (max abs difference). Targets: normexport's model no slower than
the best other variant (the interval of other / normexport reaches 1.0 or above) and never
slower than the raw export; each point also gives the control's ratio beside them.

    python benchmarks/decoders.py [--families llama,qwen2,qwen3,gemma,phi3]
                                  [--prefill 1,4:128,512] [--decode 1,4:128,1024]
                                  [--encoders vit,clip,bert] [--encoder-batch 1,4]
                                  [--budget 8] [--copies 2] [--out DIR]

Writes ``decoders_cpu.json`` and ``decoders_cpu.png`` to ``--out`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch
import transformers
from rich.console import Console
from rich.table import Table

import fusion
from models.llama import WithPast
from normexport.bench import variants
from normexport.bench.render import fmt_ratio
from normexport.bench.results import Machine
from normexport.io.files import save_figure, save_model
from normexport.latency.measure import (
    counterbalanced,
    paired_ratio,
    rotating,
    runner,
    time_interleaved,
)
from normexport.runtime import make_session

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
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
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
    """The family's small causal LM, seeded random weights, every norm weight and bias
    random."""
    config, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma scales by 1 + w, the others by w
                p.copy_(0.3 * torch.randn_like(p) + (family != "gemma"))
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p))
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


def _cache_names(kind: str) -> list[str]:
    """The KV cache's input (``"past_key_values"``) or output (``"present"``) names, as Optimum
    and onnxruntime-genai name them."""
    return [
        f"{kind}.{i}.{kv}" for i in range(COMMON["num_hidden_layers"]) for kv in ("key", "value")
    ]


def _head_size() -> int:
    return COMMON["hidden_size"] // COMMON["num_attention_heads"]


def _decode_inputs(rng, batch: int, past: int) -> dict[str, np.ndarray]:
    """One decode step's inputs: a token, an all-ones mask over ``past + 1``, a random cache."""
    cache = (batch, COMMON["num_key_value_heads"], past, _head_size())
    feeds = {
        "input_ids": rng.integers(0, COMMON["vocab_size"], (batch, 1)),
        "attention_mask": np.ones((batch, past + 1), np.int64),
    }
    for name in _cache_names("past_key_values"):
        feeds[name] = rng.standard_normal(cache).astype(np.float32)
    return feeds


def _export_with_past(model: torch.nn.Module, path: Path) -> None:
    """``torch.onnx.export`` (dynamo) of :class:`WithPast` with symbolic batch, sequence, past
    and total lengths."""
    example = _decode_inputs(np.random.default_rng(1), 2, 5)
    example["input_ids"] = example["input_ids"].repeat(3, 1)  # sequence 3: no 1 to specialize
    example["attention_mask"] = np.ones((2, 8), np.int64)
    dims = {n: torch.export.Dim(n) for n in ("batch", "sequence", "past", "total")}
    cache_dims = tuple({0: dims["batch"], 2: dims["past"]} for _ in _cache_names("present"))
    shapes = {
        "input_ids": {0: dims["batch"], 1: dims["sequence"]},
        "attention_mask": {0: dims["batch"], 1: dims["total"]},
        "past": cache_dims,
    }
    program = torch.onnx.export(
        WithPast(model).eval(), tuple(torch.from_numpy(a) for a in example.values()),
        dynamo=True, dynamic_shapes=shapes, input_names=list(example),
        output_names=["logits", *_cache_names("present")],
    )  # fmt: skip
    program.save(str(path), external_data=True)


def _feeds(session, ids: np.ndarray) -> dict[str, np.ndarray]:
    """``ids`` and, for the builder's model, an all-ones mask and an empty KV cache."""
    feeds = {}
    for spec in session.get_inputs():
        if spec.name == "input_ids":
            feeds[spec.name] = ids
        elif spec.name == "attention_mask":
            feeds[spec.name] = np.ones(ids.shape, np.int64)
        else:  # past_key_values.*: (batch, kv heads, 0, head size)
            heads = COMMON["num_key_value_heads"]
            feeds[spec.name] = np.zeros((ids.shape[0], heads, 0, _head_size()), np.float32)
    return feeds


#: normexport's own other forms, timed to show why it fuses what it fuses (not other tools):
#: ``fusion.optimize`` keywords.
FORMS = {
    "normexport_mha": {"gqa": False},  # onnxscript's MultiHeadAttention, rotation outside
    "normexport_unfused": {"gqa": False, "attention": False},  # the norms alone
    "normexport_skip": {"skip": True},  # the Skip ops everywhere (the CPU default: KV cache)
}


#: The A/A control: other sessions of normexport's own file.
CONTROL = "normexport_again"


def _variants(raw_path: Path, folder: Path, genai: Path | None, copies: int) -> tuple[dict, dict]:
    """The optimizers' variants of ``raw_path``, normexport's other :data:`FORMS` and the
    builder's model: ``copies`` sessions of each (:func:`counterbalanced`) and their JSON."""
    out = folder / "variants"
    out.mkdir()
    built = variants.build_variants(raw_path, "cpu", out, only=VARIANTS)
    paths = {k: v.model for k, v in built.items() if v.model is not None}
    described = {k: v.to_dict() for k, v in built.items()}
    for name, options in FORMS.items():
        model = ir.load(raw_path)
        report = fusion.optimize(model, target="ort", **options)
        paths[name] = out / f"{name}.onnx"
        save_model(model, paths[name], external_data=True)
        described[name] = {"options": options, "details": dict(report.counts)}
    if genai is not None:
        paths["genai"] = genai
    paths[CONTROL] = paths["normexport"]
    described[CONTROL] = {"details": "other sessions of normexport's file"}
    opens = {k: functools.partial(make_session, p, "cpu", spinning=False) for k, p in paths.items()}
    return counterbalanced(opens, copies), described


def bench_family(
    family: str, points, decode, budget_s: float, copies: int, console: Console
) -> dict:
    """Build, check and time one family: prefill at each (batch, sequence) of ``points``, one
    decode step at each (batch, past) of ``decode``, ``copies`` sessions of each variant; its
    JSON entry."""
    model = build_model(family)
    module = Logits(model)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="decoders-") as tmp:
        folder = Path(tmp)
        genai, genai_error = _genai(model, folder)
        entry = {"genai_error": genai_error}
        ids = rng.integers(0, COMMON["vocab_size"], (2, 16))  # batch 1 would specialize it
        (folder / "prefill").mkdir()
        program = torch.onnx.export(
            module, (torch.from_numpy(ids),), dynamo=True, input_names=["input_ids"],
            output_names=["logits"], dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
        )  # fmt: skip
        program.save(str(folder / "prefill" / "model.onnx"), external_data=True)
        sessions, built = _variants(
            folder / "prefill" / "model.onnx", folder / "prefill", genai, copies
        )
        entry["prefill"] = {"variants": built, "points": []}
        for batch, seq in points:
            ids = rng.integers(0, COMMON["vocab_size"], (batch, seq))
            feeds = {k: _feeds(opened[0], ids) for k, opened in sessions.items()}
            entry["prefill"]["points"].append(_point(module, sessions, feeds, budget_s))
            console.print(f"{family} prefill batch {batch} sequence {seq}: done")
        if decode:
            (folder / "decode").mkdir()
            _export_with_past(model, folder / "decode" / "model.onnx")
            sessions, built = _variants(
                folder / "decode" / "model.onnx", folder / "decode", genai, copies
            )
            entry["decode"] = {"variants": built, "points": []}
            for batch, past in decode:
                inputs = _decode_inputs(rng, batch, past)
                feeds = dict.fromkeys(sessions, inputs)
                point = _point(WithPast(model), sessions, feeds, budget_s)
                entry["decode"]["points"].append(point | {"past": past})
                console.print(f"{family} decode batch {batch} past {past}: done")
    return entry


def _point(module, sessions: dict, feeds: dict, budget_s: float, names=None) -> dict:
    """Time every session on its ``feeds``, interleaved; ratios to normexport, the largest
    difference from PyTorch's outputs (every output, by ``names``: default the logits and the
    present cache)."""
    first = next(iter(feeds.values()))
    with torch.no_grad():
        out = module(*(torch.from_numpy(a) for a in first.values()))
    out = out if isinstance(out, tuple) else (out,)
    names = (names or ["logits", *_cache_names("present")])[: len(out)]
    expected = dict(zip(names, (t.numpy() for t in out), strict=True))
    runners, errors = {}, {}
    for name, copies in sessions.items():
        calls = []
        for session in copies:
            call, outputs = runner(session, feeds[name], io_binding=False)
            got = dict(zip((o.name for o in session.get_outputs()), outputs(), strict=True))
            error = max(float(np.abs(got[k] - e).max()) for k, e in expected.items())
            errors[name] = max(errors.get(name, 0.0), error)
            calls.append(call)
        runners[name] = rotating(calls)
    timings = time_interleaved(runners, budget_s=budget_s, min_runs=10)
    base = timings["normexport"]
    return {
        "batch": int(next(iter(first.values())).shape[0]),
        "sequence": int(first["input_ids"].shape[1]) if "input_ids" in first else None,
        "median_ms": {k: t.median_ms for k, t in timings.items()},
        "ratio_to_normexport": {
            k: paired_ratio(t, base).to_dict() for k, t in timings.items() if k != "normexport"
        },
        "max_abs_error_vs_pytorch": errors,
    }


def targets(point: dict) -> dict:
    """Whether normexport meets issue 25's targets at ``point`` (issue 41's too, in
    ``families.py``): no slower than the best other variant, nor than the raw export."""
    measured = point["ratio_to_normexport"]
    ratios = {k: r for k, r in measured.items() if k not in FORMS and k != CONTROL}
    best = min(ratios, key=lambda k: ratios[k]["median"])
    return {
        "best_other": best,
        "not_slower_than_best": ratios[best]["ci_high"] >= 1.0,
        "not_slower_than_raw": ratios["ort_raw"]["ci_high"] >= 1.0,
        "control": measured[CONTROL]["median"],
    }


PHASES = ("prefill", "decode", "encoder")


def _vit() -> tuple[torch.nn.Module, dict]:
    """ViT-Tiny's shape (hidden 192, 12 layers, 3 heads, 16x16 patches of 224x224)."""
    config = transformers.ViTConfig(
        hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768
    )
    model = transformers.ViTModel(config, add_pooling_layer=False)
    return _Hidden(model, "pixel_values"), {"pixel_values": (3, 224, 224)}


def _clip() -> tuple[torch.nn.Module, dict]:
    """A CLIP vision tower (hidden 256, 6 layers, 4 heads, 32x32 patches of 224x224)."""
    config = transformers.CLIPVisionConfig(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=1024,
        patch_size=32,
    )  # fmt: skip
    return _Hidden(transformers.CLIPVisionModel(config), "pixel_values"), {
        "pixel_values": (3, 224, 224)
    }


def _bert() -> tuple[torch.nn.Module, dict]:
    """A BERT encoder (hidden 256, 4 layers, 4 heads), token ids and a padding mask of 128."""
    config = transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
        vocab_size=COMMON["vocab_size"],
    )  # fmt: skip
    model = transformers.BertModel(config, add_pooling_layer=False)
    return _Hidden(model, "input_ids", "attention_mask"), {
        "input_ids": (128,),
        "attention_mask": (128,),
    }


#: The encoders of issue 25, each a (module, input shapes without the batch) factory.
ENCODERS = {"vit": _vit, "clip": _clip, "bert": _bert}


class _Hidden(torch.nn.Module):
    """A transformers encoder's last hidden state for inputs given by position."""

    def __init__(self, model: torch.nn.Module, *names: str):
        super().__init__()
        self.model, self.names = model.eval(), names

    def forward(self, first, second=None):
        inputs = dict(zip(self.names, (first, second), strict=False))
        return self.model(**inputs).last_hidden_state


def encoder_inputs(rng, shapes: dict, batch: int) -> dict[str, np.ndarray]:
    """Random pixels, token ids, and a mask with the last quarter of row 0 padded."""
    feeds = {}
    for name, shape in shapes.items():
        if name == "pixel_values":
            feeds[name] = rng.standard_normal((batch, *shape)).astype(np.float32)
        elif name == "input_ids":
            feeds[name] = rng.integers(0, COMMON["vocab_size"], (batch, *shape))
        else:
            feeds[name] = np.ones((batch, *shape), np.int64)
            feeds[name][0, -shape[0] // 4 :] = 0
    return feeds


def bench_encoder(name: str, batches, budget_s: float, copies: int, console: Console) -> dict:
    """Build, check and time one encoder of :data:`ENCODERS` at each batch, ``copies``
    sessions of each variant; its JSON entry."""
    torch.manual_seed(0)
    module, shapes = ENCODERS[name]()
    with torch.no_grad():  # every norm weight and bias random, not transformers' 1 and 0
        for parameter, p in module.named_parameters():
            if "norm" in parameter.lower() or parameter.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p) + parameter.endswith("weight"))
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="encoders-") as tmp:
        folder = Path(tmp)
        example = encoder_inputs(rng, shapes, 2)
        axes = {k: {0: "batch"} for k in example}
        program = torch.onnx.export(
            module, tuple(torch.from_numpy(a) for a in example.values()), dynamo=True,
            input_names=list(example), output_names=["hidden"], dynamic_axes=axes,
        )  # fmt: skip
        program.save(str(folder / "model.onnx"), external_data=True)
        sessions, built = _variants(folder / "model.onnx", folder, None, copies)
        entry = {"variants": built, "points": []}
        for batch in batches:
            feeds = dict.fromkeys(sessions, encoder_inputs(rng, shapes, batch))
            entry["points"].append(_point(module, sessions, feeds, budget_s, ["hidden"]))
            console.print(f"{name} batch {batch}: done")
    return {"encoder": entry}


def _points(results: dict):
    """``(family, phase, point)`` for every point measured."""
    for family, entry in results["families"].items():
        for phase in PHASES:
            for point in entry.get(phase, {}).get("points", []):
                yield family, phase, point


def _label(phase: str, point: dict) -> str:
    """``b4 s512`` for a prefill point, ``b4 past1024`` for a decode step."""
    if phase == "encoder":
        return f"b{point['batch']}"
    size = f"past{point['past']}" if phase == "decode" else f"s{point['sequence']}"
    return f"b{point['batch']} {size}"


def _chart(results: dict, path: Path) -> None:
    """Each variant's time over normexport's, per family, phase and point (above 1: normexport
    is faster)."""
    import matplotlib.pyplot as plt

    labels, series = [], {}
    for family, phase, point in _points(results):
        labels.append(f"{family} {phase}\n{_label(phase, point)}")
        for name, ratio in point["ratio_to_normexport"].items():
            series.setdefault(name, []).append(ratio["median"])
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.7), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(values))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=6)
    ax.set_ylabel("time / normexport's time")
    ax.set_title("Decoders on ONNX Runtime CPU (2 threads): above 1, normexport is faster")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def _pairs(text: str) -> list[tuple[int, int]]:
    a, b = text.split(":")
    return [(int(x), int(y)) for x in a.split(",") for y in b.split(",")]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write JSON and PNG; print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--prefill", default="1,4:128,512", help="BATCHES:SEQUENCES")
    p.add_argument("--decode", default="1,4:128,1024", help="BATCHES:PASTS, or '' for none")
    p.add_argument("--encoders", default=",".join(ENCODERS), help="names, or '' for none")
    p.add_argument("--encoder-batch", default="1,4")
    p.add_argument("--budget", type=float, default=8.0, help="timing seconds per point")
    p.add_argument(
        "--copies", type=int, default=2, help="sessions of each variant, opened ABBA, timed in turn"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prefill, decode = _pairs(args.prefill), _pairs(args.decode) if args.decode else []
    console = Console()
    results = {
        "machine": Machine.probe("cpu").to_dict(),
        "config": COMMON,
        "copies": args.copies,
        "families": {},
    }
    for family in filter(None, args.families.split(",")):
        entry = bench_family(family, prefill, decode, args.budget, args.copies, console)
        results["families"][family] = entry
    batches = [int(b) for b in args.encoder_batch.split(",")]
    for name in filter(None, args.encoders.split(",")):
        results["families"][name] = bench_encoder(name, batches, args.budget, args.copies, console)
    for _, _, point in _points(results):
        point["targets"] = targets(point)
    (args.out / "decoders_cpu.json").write_text(json.dumps(results, indent=1))
    _chart(results, args.out / "decoders_cpu.png")
    _table(results, console)
    return 0


def _table(results: dict, console: Console) -> None:
    table = Table(title="time / normexport's time (95% interval); > 1: normexport is faster")
    names = sorted({n for _, _, p in _points(results) for n in p["ratio_to_normexport"]})
    for column in ("family", "phase", "point", "normexport ms", *names):
        table.add_column(column)
    for family, phase, point in _points(results):
        ratios = point["ratio_to_normexport"]
        cells = [fmt_ratio(ratios[n]) if n in ratios else "-" for n in names]
        ms = f"{point['median_ms']['normexport']:.2f}"
        table.add_row(family, phase, _label(phase, point), ms, *cells)
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
