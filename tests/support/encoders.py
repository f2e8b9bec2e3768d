"""A one-layer BERT encoder in PyTorch and its export, for the attention tests that start from
a real transformers model (marked slow)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
import transformers

from tests.support import exported


class TinyBert(torch.nn.Module):
    """One BERT layer (hidden 32, 2 heads, erf GELU), random weights, with a padding mask."""

    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32,
        )  # fmt: skip
        torch.manual_seed(0)
        self.bert = transformers.BertModel(config, add_pooling_layer=False).eval()

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def tiny_bert_feeds(batch: int = 3, seq: int = 8) -> dict[str, np.ndarray]:
    """Token ids and an attention mask ``(batch, seq)`` int64, two rows padded."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, 5:] = 0  # padding: the mask must reach the fused attention
    mask[2, 2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def export_tiny_bert(module: torch.nn.Module) -> ir.Model:
    """``module`` (a :class:`TinyBert`) exported with the dynamo exporter, batch and sequence
    symbolic (:func:`tests.support.exported.export`)."""
    feeds = tiny_bert_feeds()
    args = [torch.from_numpy(a) for a in feeds.values()]
    axes = {name: {0: "batch", 1: "sequence"} for name in feeds}
    return exported.export(module, args, input_names=list(feeds), dynamic_axes=axes)
