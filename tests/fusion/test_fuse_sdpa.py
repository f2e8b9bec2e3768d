"""FuseSDPA on PyTorch exports: ``F.scaled_dot_product_attention`` (no mask, ``is_causal``, a
boolean mask, a constant float bias), ``nn.MultiheadAttention``, a diffusers-style
cross-attention, segment-anything's attention with decomposed relative positions, YOLO11's
C2PSA attention, SwinV2's and EdgeNeXt's attention scaled per head, written after their
libraries. Exported by dynamo at its default opset, every
Softmax becomes ONNX's Attention with the numbers of the export; by TorchScript at opset 17,
each is refused (``opset_too_low``) and the model is left as it was."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from tests.support import exported
from tests.support.graphs import assert_close, run

pytestmark = pytest.mark.slow


class Sdpa(nn.Module):
    """Four calls of ``F.scaled_dot_product_attention`` on q, k, v (B, N, S, H)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.randn(1, 4, 6, 6))  # ALiBi-like, constant

    def forward(self, q, k, v, keep):
        plain = F.scaled_dot_product_attention(q, k, v)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        biased = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=0.3)
        return plain + causal + masked + biased


class CrossAttention(nn.Module):
    """diffusers' ``Attention`` with ``AttnProcessor2_0``: projections without bias, key and
    value from ``encoder_hidden_states``, heads by view/transpose, SDPA, ``to_out``."""

    def __init__(self, dim=32, context=24, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context, dim, bias=False)
        self.to_v = nn.Linear(context, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context):
        b = x.shape[0]
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        q, k, v = (t.view(b, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2)
                   for t in (q, k, v))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, -1, q.shape[1] * q.shape[-1]))


def _rel_pos(size: int, table: torch.Tensor) -> torch.Tensor:
    """segment-anything's ``get_rel_pos`` for equal query and key sizes."""
    coords = torch.arange(size)[:, None] - torch.arange(size)[None, :] + (size - 1)
    return table[coords.long()]


class SamAttention(nn.Module):
    """segment-anything's ``image_encoder.Attention`` with ``add_decomposed_rel_pos``."""

    def __init__(self, dim=32, heads=2, size=4):
        super().__init__()
        self.heads, head = heads, dim // heads
        self.scale = head**-0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.randn(2 * size - 1, head))
        self.rel_pos_w = nn.Parameter(torch.randn(2 * size - 1, head))

    def forward(self, x):
        b, h, w, _ = x.shape
        qkv = self.qkv(x).reshape(b, h * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * self.heads, h * w, -1).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        r_q = q.reshape(b * self.heads, h, w, -1)
        rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, _rel_pos(h, self.rel_pos_h))
        rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, _rel_pos(w, self.rel_pos_w))
        attn = attn.view(b * self.heads, h, w, h, w) + rel_h[..., None] + rel_w[..., None, :]
        attn = attn.view(b * self.heads, h * w, h * w).softmax(dim=-1)
        x = (attn @ v).view(b, self.heads, h, w, -1).permute(0, 2, 3, 1, 4).reshape(b, h, w, -1)
        return self.proj(x)


class C2PSAAttention(nn.Module):
    """ultralytics' ``Attention`` of YOLO11's C2PSA: q, k, v split from one Conv,
    ``(q^T @ k) * scale``, ``v @ attn^T``, plus a depthwise positional Conv of v."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads, self.head = heads, dim // heads
        self.key = self.head // 2
        self.scale = self.key**-0.5
        self.qkv = nn.Conv2d(dim, dim + 2 * self.key * heads, 1)
        self.proj, self.pe = nn.Conv2d(dim, dim, 1), nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)

    def forward(self, x):
        b, c, h, w = x.shape
        qkv = self.qkv(x).view(b, self.heads, 2 * self.key + self.head, h * w)
        q, k, v = qkv.split([self.key, self.key, self.head], dim=2)
        attn = ((q.transpose(-2, -1) @ k) * self.scale).softmax(dim=-1)
        x = (v @ attn.transpose(-2, -1)).view(b, c, h, w) + self.pe(v.reshape(b, c, h, w))
        return self.proj(x)


class Libraries(nn.Module):
    """``nn.MultiheadAttention`` (packed in-projection), the cross-attention, SAM's and
    C2PSA's attention, one output each."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.cross, self.sam, self.c2psa = CrossAttention(), SamAttention(), C2PSAAttention()

    def forward(self, tokens, context, grid, image):
        mha = self.mha(tokens, tokens, tokens, need_weights=False)[0]
        return mha, self.cross(tokens, context), self.sam(grid), self.c2psa(image)


def _example(name: str, rng: np.random.Generator) -> tuple[nn.Module, dict[str, np.ndarray]]:
    torch.manual_seed(0)
    if name == "sdpa":
        feeds = {n: rng.standard_normal((2, 4, 6, 8)).astype(np.float32) for n in "qkv"}
        feeds["keep"] = rng.random((2, 1, 6, 6)) > 0.3
        feeds["keep"][0, 0, 2] = False  # a row masked at every key
        return Sdpa().eval(), feeds
    shapes = {"tokens": (2, 5, 32), "context": (2, 9, 24), "grid": (1, 4, 4, 32),
              "image": (1, 32, 4, 4)}  # fmt: skip
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    return Libraries().eval(), feeds


def _export(module, feeds, **kwargs) -> ir.Model:
    args = [torch.from_numpy(a) for a in feeds.values()]
    return exported.export(module, args, input_names=list(feeds), **kwargs)


@pytest.mark.parametrize("name, attentions", [("sdpa", 4), ("libraries", 4)])
def test_dynamo_exports_every_softmax_becomes_attention_and_is_exact(rng, name, attentions):
    module, feeds = _example(name, rng)
    model = _export(module, feeds, exporter="dynamo")
    before = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    assert report.counts["sdpa_fused"] == attentions, report.refused
    assert not [n for n in model.graph if n.op_type == "Softmax"]
    fusion.check(model)
    assert_close(run(model, feeds), before)
    if "keep" in feeds:  # torch's eager SDPA gives a row masked everywhere 0, its export the mean
        feeds["keep"][..., 0] = True
    with torch.no_grad():
        expected = module(*(torch.from_numpy(a) for a in feeds.values()))
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    assert_close(run(model, feeds), [t.numpy() for t in expected], atol=1e-5, rtol=1e-4)


def test_default_target_fuses_what_fuse_attention_leaves(rng):
    """With ``target="ort"`` no Softmax is left either: the contrib rules take some, the
    rest is Attention."""
    module, feeds = _example("libraries", rng)
    model = _export(module, feeds, exporter="dynamo")
    before = run(model, feeds)
    report = fusion.optimize(model, target="ort")
    assert report.counts["sdpa_fused"] + report.counts["attention_fused"] == 4, report.refused
    assert not [n for n in model.graph if n.op_type == "Softmax"]
    assert_close(run(model, feeds), before)


def test_torchscript_at_opset_17_is_refused_and_left_as_it_was(rng):
    module, feeds = _example("sdpa", rng)
    model = _export(module, feeds, exporter="torchscript", opset=17)
    report = fusion.optimize(model, target="onnx")
    assert report.counts["sdpa_fused"] == 0
    assert report.codes("attention") == ["opset_too_low"] * 4, report.refused
    assert model.opset_imports[""] == 17


class AttentionPool(nn.Module):
    """open_clip's ``AttentionPool2d`` (RN50's head), after its source: the mean token and
    the grid's, positions added, sequence first, ``nn.MultiheadAttention``, token 0 out."""

    def __init__(self, dim=32, heads=4, grid=3):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(grid * grid + 1, dim) / dim**0.5)
        self.mha = nn.MultiheadAttention(dim, heads)

    def forward(self, x):
        x = x.flatten(2).permute(2, 0, 1)
        x = torch.cat([x.mean(dim=0, keepdim=True), x]) + self.positions[:, None]
        return self.mha(x, x, x, need_weights=False)[0][0]


def test_heads_split_by_a_view_take_attentions_3d_form(rng):
    """diffusers' cross-attention (batch first) and open_clip's attention pooling at batch 1
    (sequence first): Attention takes the projections as they are, 3-D, with no Transpose of
    the heads left, and gives the library's numbers."""
    torch.manual_seed(0)
    shapes = {"tokens": (2, 5, 32), "context": (2, 9, 24), "grid": (1, 32, 3, 3)}
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    for module, names in ((CrossAttention(), ["tokens", "context"]), (AttentionPool(), ["grid"])):
        module.eval()
        given = {n: feeds[n] for n in names}
        model = _export(module, given, exporter="dynamo")
        report = fusion.optimize(model, target="onnx")
        assert report.counts["sdpa_fused"] == 1, report.refused
        (node,) = [n for n in model.graph if n.op_type == "Attention"]
        assert [len(v.shape) for v in node.inputs[:3]] == [3, 3, 3]
        assert node.attributes["q_num_heads"].value == 4
        assert not [
            n for n in model.graph if n.op_type == "Transpose" and len(n.inputs[0].shape) == 4
        ]
        with torch.no_grad():
            expected = module(*(torch.from_numpy(a) for a in given.values()))
        assert_close(run(model, given), [expected.numpy()], atol=1e-5, rtol=1e-4)


class CosineWindowAttention(nn.Module):
    """timm's SwinV2 ``WindowAttention``: cosine scores scaled per head by
    ``exp(min(logit_scale, log 100))``, a relative position bias, the shifted windows' mask
    added through a 5-D view of the scores."""

    def __init__(self, dim=32, heads=4, tokens=4, windows=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.rand(heads, 1, 1) * 7 - 1)  # some above log 100
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens))
        mask = torch.where(torch.rand(windows, tokens, tokens) > 0.3, 0.0, -100.0)
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(self.logit_scale, max=math.log(100)).exp()
        attn = attn + self.bias.unsqueeze(0)
        windows = self.mask.shape[0]
        attn = attn.view(-1, windows, self.heads, n, n) + self.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, self.heads, n, n).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, -1))


class CrossCovarianceAttention(nn.Module):
    """timm's EdgeNeXt ``CrossCovarianceAttn`` (XCA): the scores of the channels, cosine,
    scaled by a temperature per head (here of either sign)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(torch.randn(heads, 1, 1))
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 4, 1).unbind(0)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        x = (attn * self.temperature).softmax(dim=-1) @ v
        return self.proj(x.permute(0, 3, 1, 2).reshape(b, n, c))


class PerHeadScales(nn.Module):
    def __init__(self):
        super().__init__()
        self.swin, self.xca = CosineWindowAttention(), CrossCovarianceAttention()

    def forward(self, windows, tokens):
        return self.swin(windows), self.xca(tokens)


def test_scales_per_head_of_swinv2_and_xca_move_into_q(rng):
    """Both attentions become Attention, the scale per head a Mul on Q, the op's scale 1, with
    the library's numbers."""
    torch.manual_seed(0)
    module = PerHeadScales().eval()
    shapes = {"windows": (4, 4, 32), "tokens": (2, 10, 32)}
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    model = _export(module, feeds, exporter="dynamo")
    before = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    assert report.counts["sdpa_fused"] == 2, report.refused
    attentions = [n for n in model.graph if n.op_type == "Attention"]
    assert [n.attributes.get_float("scale") for n in attentions] == [1.0, 1.0]
    assert [n.inputs[0].producer().op_type for n in attentions] == ["Mul", "Mul"]
    fusion.check(model)
    assert_close(run(model, feeds), before)
    with torch.no_grad():
        expected = module(*(torch.from_numpy(a) for a in feeds.values()))
    assert_close(run(model, feeds), [t.numpy() for t in expected], atol=1e-5, rtol=1e-4)
