"""Helpers shared by the tests of decoders with a KV cache (FuseGroupQueryAttention): small
transformers causal LMs with random norm weights and biases, their inputs, their nodes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
import transformers

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # q, k, v biased
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}),
    # YaRN scales the cos and sin by attention_scaling = 0.1 ln(factor) + 1 (a scalar Mul)
    "llama_yarn": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
}
#: Decoders apart from :data:`FAMILIES` (whose tests assert each family's projections), with a
#: sliding-window cache (it crops the past to the window, 4096 by default, before the new keys
#: join it): Gemma 2, every other layer sliding, its scores soft-capped (``50 * tanh(scores /
#: 50)``, before the mask), and Mistral.
WINDOWED = {
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {"head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0},
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"head_dim": 16}),
}
LAYERS = COMMON["num_hidden_layers"]
CACHE = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
PRESENT = [f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


def causal_lm(family: str) -> torch.nn.Module:
    """The model of ``family`` (a key of :data:`FAMILIES` or :data:`WINDOWED`), its norm weights
    and biases random."""
    config, model, extra = {**FAMILIES, **WINDOWED}[family]
    torch.manual_seed(0)
    module = model(config(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p) + 1)
            elif name.endswith("bias"):  # Qwen2's q, k, v: transformers initializes them to 0
                p.copy_(torch.randn_like(p))
    return module


def feeds(rng, batch: int, length: int, past: int, padding: int) -> dict[str, np.ndarray]:
    """Random ids and cache; the first row's mask left-padded over ``padding`` positions."""
    heads, size = COMMON["num_key_value_heads"], 16
    mask = np.ones((batch, past + length), np.int64)
    mask[0, :padding] = 0
    feeds = {
        "input_ids": rng.integers(0, COMMON["vocab_size"], (batch, length)),
        "attention_mask": mask,
    }
    for name in CACHE:
        feeds[name] = rng.standard_normal((batch, heads, past, size)).astype(np.float32)
    return feeds


def nodes(model: ir.Model, op_type: str) -> list[ir.Node]:
    """The nodes of ``op_type``, in the main graph or in the branch of an If."""
    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_type == op_type]


#: ``(batch, length, past, padding)``: a decode step, one left-padded; a first prompt with a
#: padded row (rows all masked); a batched chunk after a past (which GroupQueryAttention's CPU
#: kernel refuses); one sequence's chunk after a past; an empty past; a decode step whose row
#: is all padding (all masked).
POINTS = ((2, 1, 7, 3), (3, 4, 0, 2), (2, 3, 5, 2), (1, 4, 6, 5), (2, 1, 0, 0), (1, 1, 3, 4))
