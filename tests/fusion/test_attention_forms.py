"""The attention passes on PyTorch exports of the forms issue 61 measured on real models: a
one-head attention written after transformers' SegFormer / PVT-v2 (its Q, K and V of mixed rank
once the clean-up drops their unit axes), SwinV2's one-head windows (the weights reaching
``@ V`` through a Transpose), and an additive mask broadcast along the keys, ``(B, 1, S, 1)``.
Each is fused (or refused with the code the policy measured) and run on ONNX Runtime against
the export as it was."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion import Code
from tests.support import exported
from tests.support.graphs import assert_close, ops, run

pytestmark = pytest.mark.slow


class SelfAttention(nn.Module):
    """transformers' eager attention (SegFormer's, PVT-v2's): ``view(B, S, -1, H).transpose(1,
    2)`` of each projection, ``softmax(Q K^T * H^-0.5 + mask) @ V``, the heads merged back."""

    def __init__(self, dim: int = 16, heads: int = 1):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = (
            p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        scores = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5
        if mask is not None:
            scores = scores + mask
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)


class OneHeadWindows(nn.Module):
    """transformers' ``Swinv2SelfAttention`` with one head: cosine scores of the windows (the
    batch), scaled by ``exp(min(logit_scale, log 100))``, a relative position bias."""

    def __init__(self, dim: int = 16, tokens: int = 9):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(1, 1, 1)))
        self.bias = nn.Parameter(torch.randn(1, tokens, tokens))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (
            p(x).view(b, -1, 1, p.out_features).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scores = scores * torch.clamp(self.logit_scale, max=math.log(100)).exp()
        scores = scores + 16 * torch.sigmoid(self.bias).unsqueeze(0)
        out = scores.softmax(dim=-1) @ v
        return out.permute(0, 2, 1, 3).reshape(b, n, -1)


def _export(module: nn.Module, feeds: dict):
    torch.manual_seed(0)
    return exported.export(module.eval(), [torch.from_numpy(a) for a in feeds.values()],
                           input_names=list(feeds))  # fmt: skip


def _ranks(model) -> list[int]:
    """The ranks of the inputs of the MatMul that reads the Softmax (through a Transpose)."""
    (softmax,) = [n for n in model.graph if n.op_type == "Softmax"]
    reader = next(iter(softmax.outputs[0].uses())).node
    if reader.op_type == "Transpose":
        reader = next(iter(reader.outputs[0].uses())).node
    return [len(v.shape) for v in reader.inputs]


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_one_head_of_mixed_rank_is_left_by_measurement_and_fused_where_allowed(rng, target):
    """The clean-up leaves V of the one-head attention 3-D beside a 4-D Q (the exporter's unit
    head axis dropped): on 2 threads it is refused ``few_heads`` (the policy's measurement, not
    ``unsupported_rank``) by both passes, on 1 fused, with the export's numbers."""
    torch.manual_seed(0)
    feeds = {"x": rng.standard_normal((1, 12, 16)).astype(np.float32)}
    model = _export(SelfAttention(), feeds)
    assert sorted(_ranks(model)) == [3, 4], "the form of the issue: Q, K 4-D, V 3-D"
    report = fusion.optimize(model, target=target, threads=2)
    assert report.codes("attention") == [Code.FEW_HEADS], report.refused
    assert "Softmax" in ops(model)

    model = _export(SelfAttention(), feeds)
    (before,) = run(model, feeds)
    report = fusion.optimize(model, target=target, threads=1)
    assert report.counts["sdpa_fused"] + report.counts["attention_fused"] == 1, report.refused
    assert "Softmax" not in ops(model)
    fusion.check(model)
    assert_close(run(model, feeds), [before])


def test_weights_reaching_v_through_a_transpose_are_fused(rng):
    """SwinV2's one-head windows: the clean-up writes ``Transpose(P, (1, 0, 2, 3)) @ V`` with V
    3-D; Attention reads V through the inverse permutation and its output is transposed back,
    with the export's numbers."""
    feeds = {"x": rng.standard_normal((4, 9, 16)).astype(np.float32)}
    model = _export(OneHeadWindows(), feeds)
    (softmax,) = [n for n in model.graph if n.op_type == "Softmax"]
    transpose = next(iter(softmax.outputs[0].uses())).node
    assert transpose.op_type == "Transpose", "the form of the issue: P transposed before @ V"
    (before,) = run(model, feeds)
    report = fusion.optimize(model, target="onnx", threads=2)
    assert report.counts["sdpa_fused"] == 1, report.refused
    assert "Softmax" not in ops(model) and "Attention" in ops(model)
    fusion.check(model)
    assert_close(run(model, feeds), [before])


@pytest.mark.parametrize("constant", [False, True])
def test_a_mask_broadcast_along_the_keys_runs_fused_on_onnx_runtime(rng, constant):
    """An additive mask ``(B, 1, S, 1)``, the caller's or a constant: onnxscript's rules make
    ONNX Runtime's contrib Attention of it, whose kernel wants the bias's last axes ``(S, L)``;
    the pass expands it, so the fused node runs, with the export's numbers."""
    mask = rng.standard_normal((2, 1, 6, 1)).astype(np.float32)
    feeds = {"x": rng.standard_normal((2, 6, 16)).astype(np.float32)}
    if constant:
        module = SelfAttention(heads=4)
        module.forward = lambda x, f=module.forward: f(x, torch.from_numpy(mask))
    else:
        module, feeds = SelfAttention(heads=4), {**feeds, "mask": mask}
    model = _export(module, feeds)
    (before,) = run(model, feeds)
    report = fusion.optimize(model, target="ort", threads=1)
    assert report.counts["attention_fused"] == 1, report.refused
    assert "Softmax" not in ops(model)
    fusion.check(model)
    assert_close(run(model, feeds), [before])
