"""A two-layer LLaMA decoder at toy size, random weights (5 RMSNorms).

LLaMA (Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", 2023) is a
pre-norm transformer decoder: RMSNorm (Zhang and Sennrich, 2019) before attention and before
the SwiGLU MLP in every layer, plus one after the last layer; rotary position embeddings and
grouped-query attention. :class:`TinyLlama` is transformers' ``LlamaModel`` at a small
``LlamaConfig`` (hidden 64, 2 layers, 4 query heads sharing 2 key/value heads), so the norms
are exactly the ones the transformers implementation writes by hand, in float32:
``x * rsqrt(mean(x^2, -1) + eps) * weight``.

No weights are loaded. Weights are seeded random; every RMSNorm weight is drawn from
1 + 0.5 * N(0, 1) so that a fusion which drops or misplaces the scale changes the output.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers
from torch import nn

from models import ZooModel

#: The configuration of :class:`TinyLlama`.
CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "use_cache": False,
}


class TinyLlama(nn.Module):
    """transformers ``LlamaModel`` at toy size, returning the last hidden state.

    Constructible with no arguments, so ``--model-class models.llama:TinyLlama`` works.

    Args:
        seed: seeds the weights and the RMSNorm scales.
    """

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = transformers.LlamaModel(transformers.LlamaConfig(**CONFIG))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, transformers.models.llama.modeling_llama.LlamaRMSNorm):
                    module.weight.copy_(
                        1.0 + 0.5 * torch.randn(module.weight.shape, generator=generator)
                    )
        self.eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final RMSNorm.

        Args:
            input_ids: (batch, sequence) int64 token ids below 512; causal attention, no
                padding mask.

        Returns:
            (batch, sequence, 64) float32.
        """
        return self.model(input_ids=input_ids).last_hidden_state


def llama_tiny() -> ZooModel:
    """Zoo entry ``llama-tiny``: input ``input_ids`` (2, 16) int64, seeded random tokens."""
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, CONFIG["vocab_size"], size=(2, 16), dtype=np.int64)
    return ZooModel(
        name="llama-tiny",
        module=TinyLlama(),
        inputs={"input_ids": input_ids},
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
    )


class WithPast(nn.Module):
    """One step of transformers' ``*ForCausalLM`` ``model`` with its KV cache as tensors, as a
    deployment exports it (Optimum's and onnxruntime-genai's names follow the same order):
    ``(input_ids (B, S), attention_mask (B, P + S), past key, past value per layer (B, K, P,
    H))`` -> ``(logits, present key, present value per layer (B, K, P + S, H))``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, *past):
        return self.step(past, input_ids=input_ids, attention_mask=attention_mask)

    def step(self, past: tuple, **inputs) -> tuple:
        """The model on ``inputs`` (its keywords) with the cache ``past`` (key, value per
        layer): ``(logits, present key, present value per layer)``."""
        cache = transformers.DynamicCache(config=self.model.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.model(**inputs, past_key_values=cache, use_cache=True)
        layers = out.past_key_values.layers
        return (out.logits, *(t for layer in layers for t in (layer.keys, layer.values)))


class WithPositions(WithPast):
    """:class:`WithPast` that also takes the ``position_ids (B, S)`` of the new tokens (Optimum's
    and transformers' ``generate`` inputs: each row's positions, which left padding shifts),
    after ``attention_mask``."""

    def forward(self, input_ids, attention_mask, position_ids, *past):
        return self.step(
            past, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
