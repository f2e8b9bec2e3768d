"""The main job on classifiers that read one token of their last hidden state, as a user saves
them (``torch.export.save`` of an unwrapped transformers model, run from another folder with the
output written elsewhere): PruneRows makes the published model compute the last block on that
token only, and the verdict passes it; ``--last-token-logits`` on a decoder."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

import models
import normexport
from normexport.errors import UsageError

pytestmark = pytest.mark.slow


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode, every norm weight and bias random (not 1 and 0)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p) + name.endswith("weight"))
    return model.eval()


def _vit() -> tuple[torch.nn.Module, tuple]:
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=5,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config), (torch.randn(1, 3, 32, 32),)


def _bert() -> tuple[torch.nn.Module, tuple]:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, num_labels=3,
    )  # fmt: skip
    mask = torch.ones(1, 12, dtype=torch.int64)
    mask[0, -3:] = 0
    ids = torch.randint(0, 100, (1, 12))
    return transformers.BertForSequenceClassification(config), (ids, mask)


def _rows_of_matmuls(path, feeds: dict) -> list[int]:
    """The number of rows (the second axis) each MatMul of the model at ``path`` multiplies,
    from one run on ONNX Runtime with their inputs exposed as outputs."""
    model = onnx.load(path)
    names = [n.input[0] for n in model.graph.node if n.op_type == "MatMul"]
    model.graph.output.extend(onnx.ValueInfoProto(name=v) for v in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(names, feeds)
    return sorted(a.shape[1] for a in got if a.ndim == 3)


@pytest.mark.parametrize("build", [_vit, _bert])
def test_class_token_classifier_computes_its_last_block_on_that_token(build, tmp_path):
    module, example = build()
    saved = tmp_path / "model" / "classifier.pt2"
    saved.parent.mkdir()
    torch.export.save(torch.export.export(_randomized(module), example), saved)
    out = tmp_path / "published" / "classifier.onnx"
    report = normexport.optimize(saved, output=out, benchmark=False, make_dirs=True)
    assert report.passed and report.fusions.counts["rows_pruned"] == 1, report.fusions.refused
    names = [i.name for i in onnx.load(out, load_external_data=False).graph.input]
    feeds = dict(zip(names, (t.numpy() for t in example), strict=True))
    rows = _rows_of_matmuls(out, feeds)
    # the last block's output projection and MLP on one row, the blocks before it on all
    assert rows.count(1) >= 3 and len(rows) - rows.count(1) >= 3, rows


def test_last_token_logits_of_a_decoder(tmp_path):
    """``--last-token-logits``: llama-tiny's logits at the last position only, the tail moved
    up to the attention, judged against the references' last position."""
    zoo = models.load("llama-tiny")
    args = tuple(torch.from_numpy(a) for a in zoo.inputs.values())
    out = tmp_path / "llama.onnx"
    report = normexport.optimize(
        zoo.module, args, output=out, benchmark=False, last_token_logits=True
    )
    assert report.passed and report.fusions.counts["rows_pruned"] == 1, report.fusions.refused
    session = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    (logits, *_) = session.run(None, dict(zoo.inputs))
    with torch.no_grad():
        want = zoo.module(*args)[:, -1:].numpy()
    assert logits.shape == want.shape and np.abs(logits - want).max() < 1e-4


def test_last_token_logits_needs_a_3d_first_output(tmp_path):
    """A classifier's (batch, classes) logits: refused before any work, naming the output."""
    module, example = _vit()
    with pytest.raises(UsageError, match="--last-token-logits .* is not \\(batch, sequence"):
        normexport.optimize(
            module, example, output=tmp_path / "v.onnx", benchmark=False, last_token_logits=True
        )
