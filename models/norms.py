"""The gallery: every way the literature and the model zoos write a norm, as small modules.

Each spelling is a small ``nn.Module`` whose ``forward`` is written the way its source writes
it (the point is the graph the exporters make of it), and :data:`GALLERY` lists them with
what ``fusion.optimize`` must make of each: one fused op, a folded BatchNorm, or a refusal
whose reason contains a given fragment. ``tests/models/test_gallery.py`` runs the whole table
through both exporters; ``benchmarks/compare_fusers.py`` runs it through other tools.

LayerNorm (Ba, Kiros and Hinton 2016) over the trailing axes ``A``::

    y = (x - mean_A(x)) / sqrt(var_A(x) + eps) * w + b        var_A biased (divides by N)

Written as ``nn.LayerNorm`` / ``F.layer_norm``, or by hand with the variance from
``x.var(unbiased=False)`` or ``mean(d ** 2)`` / ``mean(d * d)``, normalized by a division by
``sqrt``, by ``reciprocal(sqrt)`` or by ``rsqrt``, with weight and bias, weight only, bias only
or neither, in either operand order, over 1, 2 or 3 trailing axes. ``x.var()`` is unbiased
(divides by ``N - 1``); it is still an exact LayerNormalization (docs/fusions.md, "Every
spelling, and only the exact ones")::

    (x - m) / sqrt(var_u + eps) = sqrt((N-1)/N) * (x - m) / sqrt(var_b + eps * (N-1)/N)

since ``var_u = var_b * N/(N-1)``: epsilon becomes ``eps * (N-1)/N`` and the scale
``w * sqrt((N-1)/N)``.

RMSNorm (Zhang and Sennrich 2019) is LayerNorm without the centering,
``y = x / sqrt(mean_A(x^2) + eps) * w``, as written by ``nn.RMSNorm`` and by transformers'
LLaMA / Mistral / Qwen (``LlamaRMSNorm``: float32 upcast, ``rsqrt``, cast back, then the weight),
T5 (``T5LayerNorm``: only the variance upcast), and Gemma (``GemmaRMSNorm``: scale ``1 + w``,
applied in float32 before the cast back).

Look-alikes that must be refused: eps outside the square root, ``F.normalize(x) * sqrt(d)``
(a clamped L2 norm), statistics over a non-trailing axis, a norm computed in float64 (the fused
ops compute in float32: not the same function).

BatchNorm (Ioffe and Szegedy 2015) in eval mode is a per-channel affine map that folds into the
neighbouring Conv / ConvTranspose / Gemm / MatMul; every statistic and affine parameter here is
randomized (:func:`randomize_batchnorm`), since the default init (mean 0, var 1, weight 1,
bias 0) hides folding bugs.

Mixed precision: float16 entries take and return float16. ONNX Runtime's Python API has no
bfloat16 arrays, so bfloat16 entries are wrapped in :class:`InBFloat16`: float32 at the
interface, bfloat16 inside, as under ``torch.autocast``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fusion import registry

#: ``Entry.expect`` values: the BatchNorm disappears into a linear layer; the norm becomes its
#: family's fused op (which one at which opset: :func:`fused_op`).
FOLDED = "folded"
FUSED = "fused"

#: The norm families of :mod:`fusion.registry`, each with the pass that rewrites it.
FAMILIES = {p.kinds[0].family: p for p in registry.PASSES if p.kinds[0].norm}


def fused_op(family: str, opset: int) -> str:
    """The op that ``family``'s pass emits for ``target="ort"`` at ``opset``: its first op where
    the opset has it (the pass's ``needs_opset["onnx"]``), else its last, ONNX Runtime's (for
    RMSNorm: RMSNormalization from opset 23, else SimplifiedLayerNormalization)."""
    fusion_pass = FAMILIES[family]
    ops = fusion_pass.kinds[0].ops
    return ops[0].op_type if opset >= fusion_pass.needs_opset.get("onnx", 0) else ops[-1].op_type


#: Ops of each family's decomposed form: none may remain once the norm is fused or folded.
DECOMPOSED = {
    "layernorm": frozenset(
        {"ReduceMean", "ReduceSum", "Sub", "Pow", "Mul", "Add", "Sqrt", "Reciprocal", "Div"}
    ),
    "rmsnorm": frozenset(
        {"ReduceMean", "ReduceSum", "Pow", "Mul", "Add", "Sqrt", "Reciprocal", "Div"}
    ),
    "batchnorm": frozenset({"BatchNormalization", "Sub", "Mul", "Sqrt", "Div"}),
    "instancenorm": frozenset({"ReduceMean", "Sub", "Pow", "Mul", "Add", "Sqrt", "Div"}),
    # a GroupNorm keeps its Reshapes and its per-channel Mul / Add (nn.GroupNorm's form)
    "groupnorm": frozenset({"ReduceMean", "Sub", "Pow", "Sqrt", "Reciprocal", "Div"}),
    "layernorm_cf": frozenset({"ReduceMean", "Sub", "Pow", "Mul", "Add", "Sqrt", "Div"}),
}

#: The opsets each exporter is asked for (the dynamo exporter cannot write opsets below 18).
OPSETS = {"dynamo": (18, 20, 23), "torchscript": (17,)}

BTC = (2, 5, 16)  # (batch, time, channels)
NCHW = (2, 4, 3, 5)
REPARAM = (2, 8, 6, 6)  # the re-parameterizable blocks' input
HIDDEN = BTC[-1]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Norm(nn.Module):
    """Parameters shared by the hand-written LayerNorms: normalized axes, eps, weight, bias.

    Args:
        shape: the normalized shape (the trailing axes of the input), like ``nn.LayerNorm``'s.
        eps: added to the variance.
        weight, bias: whether there is an elementwise weight / bias. Both are seeded random
            (weight 1 + 0.5 N(0, 1), bias 0.5 N(0, 1)), so that a fusion that drops one shows.
        seed: seeds the parameters.
    """

    def __init__(
        self,
        shape: tuple[int, ...] = (HIDDEN,),
        eps: float = 1e-5,
        *,
        weight: bool = True,
        bias: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        self.dims = tuple(range(-len(shape), 0))
        self.eps = eps
        generator = _generator(seed)
        w = 1.0 + 0.5 * torch.randn(shape, generator=generator)
        b = 0.5 * torch.randn(shape, generator=generator)
        self.weight = nn.Parameter(w) if weight else None
        self.bias = nn.Parameter(b) if bias else None

    def affine(self, y: torch.Tensor) -> torch.Tensor:
        """``y * w + b``, leaving out what is absent."""
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y


class VarLayerNorm(_Norm):
    """The tutorial form: ``(x - m) / sqrt(x.var(unbiased=False) + eps) * w + b``."""

    def forward(self, x):
        m = x.mean(self.dims, keepdim=True)
        v = x.var(self.dims, unbiased=False, keepdim=True)
        return self.affine((x - m) / torch.sqrt(v + self.eps))


class PowReciprocalLayerNorm(_Norm):
    """``d = x - m``; ``d * reciprocal(sqrt(mean(d ** 2) + eps)) * w + b``."""

    def forward(self, x):
        d = x - x.mean(self.dims, keepdim=True)
        v = d.pow(2).mean(self.dims, keepdim=True)
        return self.affine(d * torch.reciprocal(torch.sqrt(v + self.eps)))


class MulRsqrtLayerNorm(_Norm):
    """``d = x - m``; ``d * rsqrt(mean(d * d) + eps) * w + b`` (the dynamo export of rsqrt is
    ``Reciprocal(Sqrt)``, the TorchScript one ``Div(1, Sqrt)``)."""

    def forward(self, x):
        d = x - x.mean(self.dims, keepdim=True)
        return self.affine(d * torch.rsqrt((d * d).mean(self.dims, keepdim=True) + self.eps))


class ReversedLayerNorm(_Norm):
    """Every operand the other way round: ``b + w * (rsqrt(eps + v) * d)``."""

    def forward(self, x):
        d = x - x.mean(self.dims, keepdim=True)
        v = (d * d).mean(self.dims, keepdim=True)
        return self.bias + self.weight * (torch.rsqrt(self.eps + v) * d)


class UnbiasedVarLayerNorm(_Norm):
    """``(x - m) / sqrt(x.var() + eps) * w + b`` with the unbiased ``x.var()`` (divides by
    N - 1): a LayerNormalization with epsilon ``eps (N-1)/N`` and scale ``w sqrt((N-1)/N)``."""

    def forward(self, x):
        m = x.mean(self.dims, keepdim=True)
        return self.affine((x - m) / torch.sqrt(x.var(self.dims, keepdim=True) + self.eps))


class FunctionalLayerNorm(_Norm):
    """``F.layer_norm(x, shape, w, b)``; the exporters write LayerNormalization themselves."""

    def forward(self, x):
        shape = x.shape[len(x.shape) - len(self.dims) :]
        return F.layer_norm(x, shape, self.weight, self.bias, self.eps)


class UpcastLayerNorm(_Norm):
    """The Hugging Face habit in a float16 / bfloat16 model: normalize ``x.float()`` in
    float32, cast back, then weight and bias in the model's dtype. LayerNormalization with
    ``stash_type=1`` on the low-precision ``x`` is that function (its spec casts the normalized
    value back before the affine part)."""

    def forward(self, x):
        h = x.float()
        d = h - h.mean(self.dims, keepdim=True)
        h = d * torch.rsqrt(d.pow(2).mean(self.dims, keepdim=True) + self.eps)
        return self.affine(h.to(x.dtype))


class Float32AffineLayerNorm(_Norm):
    """A float16 model that normalizes and applies weight and bias in float32, then casts back
    once. One LayerNormalization on the float16 ``x`` would round the normalized value before
    the affine part, so the norm is fused inside the float32 region, its Casts kept."""

    def forward(self, x):
        h = x.float()
        d = h - h.mean(self.dims, keepdim=True)
        h = d / torch.sqrt(d.pow(2).mean(self.dims, keepdim=True) + self.eps)
        return (h * self.weight.float() + self.bias.float()).to(x.dtype)


class DoubleLayerNorm(_Norm):
    """A LayerNorm in a float64 model: not fused, since LayerNormalization computes in float32
    (its ``stash_type`` allows float32 or bfloat16 only), a different function. A float16 norm
    with no upcast is refused the same way."""

    def forward(self, x):
        d = x - x.mean(self.dims, keepdim=True)
        return self.affine(d / torch.sqrt(d.pow(2).mean(self.dims, keepdim=True) + self.eps))


class EpsOutsideLayerNorm(_Norm):
    """Look-alike: ``(x - m) / (sqrt(var) + eps)`` adds eps to the standard deviation."""

    def forward(self, x):
        d = x - x.mean(self.dims, keepdim=True)
        return self.affine(d / (torch.sqrt(d.pow(2).mean(self.dims, keepdim=True)) + self.eps))


class MiddleAxisLayerNorm(nn.Module):
    """Look-alike: centers and scales over axis 1 of (B, T, C), a non-trailing axis."""

    def forward(self, x):
        d = x - x.mean(1, keepdim=True)
        return d / torch.sqrt(d.pow(2).mean(1, keepdim=True) + 1e-5)


class SumLayerNorm(_Norm):
    """The loop-free tutorial form with sums: ``m = x.sum(dims) / n``, ``v = (d ** 2).sum(dims)
    / n`` (``n`` the number of normalized elements); ``mul`` multiplies by ``1 / n`` instead.
    ``mean_divisor`` replaces the mean's ``n`` (a look-alike when it is not ``n``)."""

    def __init__(self, *args, mul: bool = False, mean_divisor: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.mul = mul
        self.mean_divisor = mean_divisor

    def _over(self, total: torch.Tensor, n: int) -> torch.Tensor:
        return total * (1.0 / n) if self.mul else total / n

    def forward(self, x):
        n = math.prod(x.shape[len(x.shape) - len(self.dims) :])
        m = self._over(x.sum(self.dims, keepdim=True), self.mean_divisor or n)
        d = x - m
        v = self._over((d**2).sum(self.dims, keepdim=True), n)
        return self.affine(d / torch.sqrt(v + self.eps))


class WeightFirstLayerNorm(_Norm):
    """The tutorials' order: ``w * (x - m) / sqrt(var + eps) + b``, the weight multiplied into
    the numerator before the division (the same function: ``w d / s = (d / s) w``)."""

    def forward(self, x):
        m = x.mean(self.dims, keepdim=True)
        v = x.var(self.dims, unbiased=False, keepdim=True)
        return self.weight * (x - m) / torch.sqrt(v + self.eps) + self.bias


class NoEpsLayerNorm(_Norm):
    """``(x - m) / sqrt(var) * w + b``: no eps. What ``torch.onnx.export``'s own optimizer leaves
    of the tutorials' LayerNorm with eps 1e-8 (it removes an ``Add`` of 1e-8 as if it were 0).
    LayerNormalization with epsilon 0 is this function: NaN on a constant row, as here."""

    def forward(self, x):
        d = x - x.mean(self.dims, keepdim=True)
        return self.affine(d / torch.sqrt(d.pow(2).mean(self.dims, keepdim=True)))


class TwoLayerNormsOfOneInput(nn.Module):
    """Two tutorial LayerNorms of the same ``x`` with different eps, concatenated (issue 13
    item 6): common-subexpression elimination merges their ``x - mean`` and square, values
    shared only among norms that are all fused."""

    def __init__(self):
        super().__init__()
        self.first, self.second = VarLayerNorm(eps=1e-5), VarLayerNorm(eps=1e-3, seed=1)

    def forward(self, x):
        return torch.cat([self.first(x), self.second(x)], -1)


class _RMS(nn.Module):
    """A weight over the last axis, seeded random (1 + 0.5 N(0, 1)), and eps."""

    def __init__(self, hidden: int = HIDDEN, eps: float = 1e-6, seed: int = 0):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.5 * torch.randn(hidden, generator=_generator(seed)))


class LlamaRMSNorm(_RMS):
    """transformers' ``LlamaRMSNorm`` (also Mistral's, Qwen2's): upcast, rsqrt, cast back,
    then the weight in the model's dtype."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class T5LayerNorm(_RMS):
    """transformers' ``T5LayerNorm``: only the variance is computed on the float32 upcast; the
    product promotes to float32 and is cast to the weight's dtype when that is half precision."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class GemmaRMSNorm(_RMS):
    """transformers' ``GemmaRMSNorm``: scale ``1 + w`` (w starts at 0), applied in float32
    before the cast back."""

    def __init__(self, hidden: int = HIDDEN, eps: float = 1e-6, seed: int = 0):
        super().__init__(hidden, eps, seed)
        with torch.no_grad():
            self.weight.sub_(1.0)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class DivRMSNorm(_RMS):
    """``x / sqrt(mean(x * x) + eps) * g``."""

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class BareRMSNorm(nn.Module):
    """No weight at all: ``x * rsqrt(mean(x ** 2) + eps)``."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class SumRMSNorm(_RMS):
    """``x / sqrt((x * x).sum(-1) / d + eps) * g``, the mean square written as a sum over ``d``;
    ``eps=None`` leaves out eps (what ``torch.onnx.export``'s optimizer makes of 1e-8)."""

    def forward(self, x):
        ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
        return x / torch.sqrt(ms if self.eps is None else ms + self.eps) * self.weight


class WeightFirstRMSNorm(_RMS):
    """``g * x / sqrt(mean(x ** 2) + eps)``: the weight multiplied before the division."""

    def forward(self, x):
        return self.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class EpsOutsideRMSNorm(_RMS):
    """Look-alike: ``x / (sqrt(mean(x ** 2)) + eps) * g`` (one of the tutorials the project grew
    from). For ``|x| ~ 1e-4`` it differs from RMSNorm by orders of magnitude."""

    def forward(self, x):
        return x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + self.eps) * self.weight


class ScaledNormalize(_RMS):
    """Look-alike: ``F.normalize(x, dim=-1) * sqrt(d) * g``, which clamps the L2 norm at eps."""

    def forward(self, x):
        return F.normalize(x, dim=-1) * math.sqrt(x.shape[-1]) * self.weight


class MiddleAxisRMSNorm(nn.Module):
    """Look-alike: the mean square over axis 1 of (B, T, C), a non-trailing axis."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)


class InBFloat16(nn.Module):
    """Runs ``inner`` (converted to bfloat16) on ``x.bfloat16()`` and returns float32.

    ONNX Runtime's Python API cannot feed or return bfloat16 arrays, so a bfloat16 model is
    tested the way autocast runs one: float32 at the interface, bfloat16 inside.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.to(torch.bfloat16)

    def forward(self, x):
        return self.inner(x.to(torch.bfloat16)).float()


# ---- BatchNorm ----


def randomize_batchnorm(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm in ``module`` random running statistics and affine parameters.

    Means uniform in [-1, 1], variances in [0.3, 3], weights in [-2, 2] (negative ones
    included), biases in [-1, 1].
    """
    generator = _generator(seed)

    def uniform(t: torch.Tensor, low: float, high: float) -> None:
        t.copy_(low + (high - low) * torch.rand(t.shape, generator=generator))

    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.modules.batchnorm._BatchNorm):
                uniform(sub.running_mean, -1.0, 1.0)
                uniform(sub.running_var, 0.3, 3.0)
                uniform(sub.weight, -2.0, 2.0)
                uniform(sub.bias, -1.0, 1.0)
    return module


class _ChannelStats(nn.Module):
    """Random per-channel BatchNorm statistics as buffers of ``shape`` (C where ``"C"``)."""

    def __init__(self, channels: int, shape: tuple = ("C",), seed: int = 0):
        super().__init__()
        generator = _generator(seed)
        shape = tuple(channels if s == "C" else 1 for s in shape)

        def uniform(low: float, high: float) -> torch.Tensor:
            return low + (high - low) * torch.rand(shape, generator=generator)

        self.register_buffer("running_mean", uniform(-1.0, 1.0))
        self.register_buffer("running_var", uniform(0.3, 3.0))
        self.register_buffer("gamma", uniform(-2.0, 2.0))
        self.register_buffer("beta", uniform(-1.0, 1.0))


class HandBatchNormAfterConv(_ChannelStats):
    """The seed tutorial's ``BatchNormCustom`` in eval mode after a conv:
    ``(y - mean) / sqrt(var + eps) * gamma + beta`` with (1, C, 1, 1) buffers."""

    def __init__(self):
        super().__init__(6, (1, "C", 1, 1))
        self.conv = nn.Conv2d(3, 6, 3)

    def forward(self, x):
        y = self.conv(x)
        return (y - self.running_mean) / torch.sqrt(
            self.running_var + 1e-5
        ) * self.gamma + self.beta


class FrozenBatchNormAfterConv(_ChannelStats):
    """torchvision's ``FrozenBatchNorm2d`` after a conv: ``y * scale + shift``."""

    def __init__(self):
        super().__init__(6)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)

    def forward(self, x):
        scale = self.gamma * (self.running_var + 1e-5).rsqrt()
        shift = self.beta - self.running_mean * scale
        return self.conv(x) * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


class LinearBatchNorm3d(nn.Module):
    """A Linear on (B, T, F) (MatMul + Add) and ``BatchNorm1d`` over its features, applied the
    usual way through a transpose to (B, C, T) and back."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, 12)
        self.bn = nn.BatchNorm1d(12)

    def forward(self, x):
        return self.bn(self.linear(x).transpose(1, 2)).transpose(1, 2)


class LinearBatchNormFlat(nn.Module):
    """A Linear on (B, T, F) and ``BatchNorm1d`` over its features, applied to the rows:
    ``bn(linear(x).reshape(-1, C)).reshape(B, T, C)``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, 12)
        self.bn = nn.BatchNorm1d(12)

    def forward(self, x):
        y = self.linear(x)
        return self.bn(y.reshape(-1, y.shape[-1])).reshape(y.shape)


class AddmmBatchNorm(nn.Module):
    """``torch.addmm(b, x, W, beta=2, alpha=0.5)`` then ``BatchNorm1d``: both exporters write a
    Gemm with alpha 0.5 and beta 2, which the fold must scale alike. ``transB`` is 0; with
    ``transposed`` (``W`` stored (out, in), passed as ``W.t()``) the TorchScript exporter
    writes ``transB=1`` (the dynamo exporter transposes the constant instead)."""

    def __init__(self, transposed: bool = False):
        super().__init__()
        self.transposed = transposed
        shape = (6, 8) if transposed else (8, 6)
        self.weight = nn.Parameter(torch.randn(shape, generator=_generator(3)))
        self.bias = nn.Parameter(torch.randn(6, generator=_generator(4)))
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        w = self.weight.t() if self.transposed else self.weight
        return self.bn(torch.addmm(self.bias, x, w, beta=2.0, alpha=0.5))


RESNET_TAIL = (2, 6, 5, 5)  # the input of ResNetTail


class ResNetTail(nn.Module):
    """A pre-activation ResNet's end: the last block's ``conv(relu(x)) + x``, the final
    BatchNorm, global pooling and the classifier (the BatchNorm folds into the classifier; the
    ReLU keeps the block from being one Conv that would absorb it, :mod:`fusion.merge_branches`).

    ``pool``: ``"avg"`` (``nn.AdaptiveAvgPool2d(1)`` and ``torch.flatten``), ``"mean"``
    (``y.mean((2, 3))``), ``"two_heads"`` (avg, read by two Linears whose outputs are summed);
    look-alikes: ``"max"`` (``nn.AdaptiveMaxPool2d(1)``: a max, which a negative BatchNorm scale
    turns into a min) and ``"channels"`` (``y.mean(1)``, a mean over the channels, then a Linear
    over the width).
    """

    def __init__(self, pool: str = "avg"):
        super().__init__()
        self.pool = pool
        self.conv = nn.Conv2d(6, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(5 if pool == "channels" else 6, 3)
        self.fc2 = nn.Linear(6, 3) if pool == "two_heads" else None

    def forward(self, x):
        y = self.bn(self.conv(torch.relu(x)) + x)
        if self.pool == "mean":
            return self.fc(y.mean((2, 3)))
        if self.pool == "channels":
            return self.fc(y.mean(1))
        pool = F.adaptive_max_pool2d if self.pool == "max" else F.adaptive_avg_pool2d
        y = torch.flatten(pool(y, 1), 1)
        return self.fc(y) if self.fc2 is None else self.fc(y) + self.fc2(y)


class SharedConvOutput(nn.Module):
    """Refused: the conv output is also read by the residual Add, so the conv cannot absorb
    the BatchNorm."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class NotPerChannel(nn.Module):
    """Refused: a Mul by a constant that varies along H and W, not per channel."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.register_buffer("c", 0.5 + 1.5 * torch.rand(1, 1, 6, 6, generator=_generator(5)))

    def forward(self, x):
        return self.conv(x) * self.c


# ---- re-parameterizable blocks (fusion.merge_branches): train-time forms, plain PyTorch ----


def _conv_bn(c_in: int, c_out: int, k: int, groups: int = 1, padding: int | None = None):
    """A bias-free Conv then a BatchNorm: one branch of a re-parameterizable block."""
    pad = k // 2 if padding is None else padding
    return _seq(
        nn.Conv2d(c_in, c_out, k, padding=pad, groups=groups, bias=False), nn.BatchNorm2d(c_out)
    )


class RepVggBlock(nn.Module):
    """RepVGG (Ding et al., CVPR 2021): ``relu(bn(conv3x3(x)) + bn(conv1x1(x)) + bn(x))``."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.dense, self.one, self.identity = (
            _conv_bn(c, c, 3),
            _conv_bn(c, c, 1),
            nn.BatchNorm2d(c),
        )

    def forward(self, x):
        return torch.relu(self.dense(x) + self.one(x) + self.identity(x))


class MobileOneBlock(nn.Module):
    """MobileOne (Vasu et al., CVPR 2023), depthwise: ``k`` over-parameterized 3x3 branches, a
    1x1 scale branch and a BatchNorm on the identity, summed; ``act`` after (FastViT's mixer
    has none)."""

    def __init__(self, c: int = 8, k: int = 4, act: bool = True):
        super().__init__()
        self.kxk = nn.ModuleList(_conv_bn(c, c, 3, groups=c) for _ in range(k))
        self.scale, self.identity = _conv_bn(c, c, 1, groups=c), nn.BatchNorm2d(c)
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x):
        out = self.scale(x) + self.identity(x)
        for branch in self.kxk:
            out = out + branch(x)
        return self.act(out)


class RepMixer(nn.Module):
    """FastViT's RepMixer: ``x + gamma * (mixer(x) - norm(x))``, the mixer a MobileOne block
    without activation, ``norm`` a BatchNorm on the identity, ``gamma`` a layer scale."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.mixer, self.norm = MobileOneBlock(c, k=1, act=False), nn.BatchNorm2d(c)
        self.gamma = nn.Parameter(0.1 + torch.rand(c, 1, 1, generator=_generator(6)))

    def forward(self, x):
        return x + self.gamma * (self.mixer(x) - self.norm(x))


class RepVitMixer(nn.Module):
    """RepViT's token mixer: ``bn(bn(dwconv3x3(x)) + dwconv1x1(x) + x)``: the BatchNorm after
    the sum folds into the merged Conv."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.conv, self.conv1 = _conv_bn(c, c, 3, groups=c), nn.Conv2d(c, c, 1, groups=c)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return self.bn(self.conv(x) + self.conv1(x) + x)


class OneByOneThenKxK(nn.Module):
    """DBB's 1x1 -> kxk branch (Ding et al., CVPR 2021): a widening 1x1 (BatchNorm'd), then an
    unpadded 3x3 (BatchNorm'd): one 3x3."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.one, self.kxk = _conv_bn(c, 2 * c, 1), _conv_bn(2 * c, c, 3, padding=0)

    def forward(self, x):
        return self.kxk(self.one(x))


class ReluInBranch(nn.Module):
    """Refused: ``conv3x3(x) + relu(conv1x1(x)) + x``: a branch is no linear map of x."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.dense, self.one = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.dense(x) + torch.relu(self.one(x)) + x


class StridedIdentity(nn.Module):
    """Refused: ``conv3x3_stride2(x) + x``, valid for a 1x1 input only: the identity does not
    subsample."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.dense = nn.Conv2d(c, c, 3, stride=2, padding=1)

    def forward(self, x):
        return self.dense(x) + x


class MisalignedBranches(nn.Module):
    """Refused: a 3x3 padded 1 and a 2x2 unpadded, both stride 2: equal output sizes at an even
    input size only, windows a row apart."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.b = nn.Conv2d(c, c, 2, stride=2)

    def forward(self, x):
        return self.a(x) + self.b(x)


# ---- the table ----


@dataclasses.dataclass(frozen=True)
class Entry:
    """One spelling, and what ``fusion.optimize(model, target="ort")`` must make of it.

    Attributes:
        name: short unique name.
        family: a norm family of :data:`FAMILIES` (the report's refusal kind), e.g.
            ``"layernorm"``.
        factory: builds the module (float32, parameters seeded; called under
            ``torch.manual_seed(0)``).
        shape: the input shape.
        expect: :data:`FUSED` (the family's fused op must replace the norm, see
            :meth:`expected_op`) or :data:`FOLDED` (no BatchNormalization left); None when the
            candidate must be refused.
        refused: a fragment of the refusal reason the report must carry (only when ``expect``
            is None).
        refused_by: the family whose refusal that is, where it is not ``family``'s (a
            re-parameterizable block's look-alike: ``"reparam"``, MergeBranches').
        dtype: the model's precision: float32, float16 or float64 (the module and its input
            converted), or bfloat16 (the module wrapped in :class:`InBFloat16`).
        fused_dtype: the type the fused op takes: the model's half-precision type where its
            round trip through float32 is absorbed, float32 where the norm is fused inside the
            float32 region (see :meth:`casts`).
        exporters: the exporters that can export it, each at its :data:`OPSETS`.
        opsets: when set, only these opsets apply.
        atol, rtol: parity with PyTorch: ``max |y - r| <= atol + rtol * max |r|``.
        norms: how many norms the module holds (each must become the fused op).
        convs: how many Conv nodes the optimized model holds, where that is checked (a
            re-parameterizable block: one).
    """

    name: str
    family: str
    factory: Callable[[], nn.Module]
    shape: tuple[int, ...] = BTC
    expect: str | None = None
    refused: str | None = None
    refused_by: str | None = None
    dtype: torch.dtype = torch.float32
    fused_dtype: torch.dtype = torch.float32
    exporters: tuple[str, ...] = ("dynamo", "torchscript")
    opsets: tuple[int, ...] | None = None
    atol: float = 1e-4
    rtol: float = 1e-3
    norms: int = 1
    convs: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"{self.name}: family {self.family!r} is none of {list(FAMILIES)}")

    def build(self) -> nn.Module:
        """The module in eval mode, in its dtype, every BatchNorm statistic randomized."""
        torch.manual_seed(0)
        module = randomize_batchnorm(self.factory())
        module = InBFloat16(module) if self.dtype == torch.bfloat16 else module.to(self.dtype)
        return module.eval()

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype of the model's input and output (float32 for bfloat16 models)."""
        return torch.float32 if self.dtype == torch.bfloat16 else self.dtype

    def example(self, seed: int = 0) -> torch.Tensor:
        """A standard normal input of :attr:`shape` in :attr:`input_dtype`."""
        return torch.randn(self.shape, generator=_generator(seed)).to(self.input_dtype)

    def casts(self) -> int:
        """How many Casts the optimized model keeps around the fused op: none when it takes
        the model's input type, else the two at the edges of its region."""
        return 0 if self.fused_dtype == self.input_dtype else 2

    def exports(self) -> list[tuple[str, int]]:
        """The (exporter, opset) pairs this entry applies to."""
        return [
            (exporter, opset)
            for exporter in self.exporters
            for opset in OPSETS[exporter]
            if self.opsets is None or opset in self.opsets
        ]

    def expected_op(self, opset: int) -> str | None:
        """The norm op type that must be in the optimized model at ``opset`` (None for a
        folded BatchNorm or a refusal)."""
        return fused_op(self.family, opset) if self.expect == FUSED else None


def _ln(name, factory, shape=BTC, **kw) -> Entry:
    return Entry(name, "layernorm", factory, shape, FUSED, **kw)


def _rms(name, factory, shape=BTC, **kw) -> Entry:
    return Entry(name, "rmsnorm", factory, shape, FUSED, **kw)


def _refused(family, name, factory, reason, shape=BTC, **kw) -> Entry:
    return Entry(name, family, factory, shape, None, reason, **kw)


def _reparam_refused(name, factory, reason, shape) -> Entry:
    """A re-parameterizable block's look-alike: its BatchNorms left, MergeBranches' refusal."""
    return Entry(name, "batchnorm", factory, shape, None, reason, refused_by="reparam")


def _bn(name, factory, shape, **kw) -> Entry:
    return Entry(name, "batchnorm", factory, shape, FOLDED, **kw)


def _seq(*layers: nn.Module) -> nn.Module:
    return nn.Sequential(*layers)


#: Half-precision entries, and their tolerances: a couple of ulps of float16 / bfloat16 at the
#: outputs' magnitude (|y| up to about 5). The fused kernels round once where the original
#: rounds the normalized value and then the product: up to one ulp apart.
HALF = {"atol": 4e-3, "rtol": 4e-3}
FP16_ROUND_TRIP = {"dtype": torch.float16, "fused_dtype": torch.float16, **HALF}
FP16_REGION = {"dtype": torch.float16, **HALF}
BF16_ROUND_TRIP = {
    "dtype": torch.bfloat16,
    "fused_dtype": torch.bfloat16,
    "atol": 3e-2,
    "rtol": 2e-2,
}
AXES = "normalizes the trailing axes only"

GALLERY: list[Entry] = [
    # LayerNorm
    _ln("ln_module", lambda: nn.LayerNorm(HIDDEN)),
    _ln("ln_module_nobias", lambda: nn.LayerNorm(HIDDEN, bias=False)),
    _ln("ln_module_chw", lambda: nn.LayerNorm(NCHW[1:]), NCHW),
    _ln("ln_functional", lambda: FunctionalLayerNorm()),
    _ln("ln_functional_nobias", lambda: FunctionalLayerNorm(bias=False)),
    _ln("ln_var_div_eps1e-8", lambda: VarLayerNorm(eps=1e-8)),
    _ln("ln_pow_reciprocal", lambda: PowReciprocalLayerNorm()),
    _ln("ln_mul_rsqrt_weight_only", lambda: MulRsqrtLayerNorm(bias=False)),
    _ln("ln_bias_only", lambda: PowReciprocalLayerNorm(weight=False)),
    _ln("ln_no_affine", lambda: MulRsqrtLayerNorm(weight=False, bias=False)),
    _ln("ln_reversed_operands", lambda: ReversedLayerNorm()),
    _ln("ln_two_axes_btc", lambda: VarLayerNorm(BTC[1:])),
    _ln("ln_two_axes_nchw", lambda: MulRsqrtLayerNorm(NCHW[2:]), NCHW),
    _ln("ln_three_axes_nchw", lambda: PowReciprocalLayerNorm(NCHW[1:]), NCHW),
    _ln("ln_unbiased_var", lambda: UnbiasedVarLayerNorm()),
    _ln("ln_unbiased_var_two_axes", lambda: UnbiasedVarLayerNorm(NCHW[2:]), NCHW),
    _ln("ln_fp16_upcast", lambda: UpcastLayerNorm(), **FP16_ROUND_TRIP),
    _ln("ln_bf16_upcast", lambda: UpcastLayerNorm(), **BF16_ROUND_TRIP),
    _ln("ln_fp16_float32_affine", lambda: Float32AffineLayerNorm(), **FP16_REGION),
    _refused(
        "layernorm",
        "ln_eps_outside_sqrt",
        lambda: EpsOutsideLayerNorm(),
        "eps outside the square root",
    ),
    _refused("layernorm", "ln_middle_axis", lambda: MiddleAxisLayerNorm(), AXES),
    _ln("ln_sum_div", lambda: SumLayerNorm()),
    _ln("ln_sum_mul_two_axes", lambda: SumLayerNorm(BTC[1:], mul=True)),
    _refused(
        "layernorm",
        "ln_sum_mean_over_d_minus_1",
        lambda: SumLayerNorm(mean_divisor=HIDDEN - 1),
        "is not x minus its mean",
    ),
    # A tutorial LayerNorm with eps 1e-8 exported by torch.onnx.export with its optimizer on
    # (the default) is this graph: the optimizer removes the Add of 1e-8. Fused with epsilon 0
    # and a note. Its parity is held against this module, the function the file computes (NaN
    # on the constant and zero probes on both sides, which parity does not compare). Against
    # the eps-1e-8 module it was exported from, the file fails before and after fusion alike:
    # NaN where PyTorch gives 0 on the constant and zero probes, and on the 1e-4-scale probe
    # (variance about 1e-8, as large as the lost eps) an error as large as the output: the
    # export is wrong, not the fusion. normexport's own export keeps the eps
    # (ln_var_div_eps1e-8).
    _ln("ln_no_eps", lambda: NoEpsLayerNorm()),
    _ln("ln_two_of_one_input", lambda: TwoLayerNormsOfOneInput(), norms=2),
    _ln("ln_weight_first_eps1e-8", lambda: WeightFirstLayerNorm(eps=1e-8)),
    # Held to 1e-8: the dynamo export's own float32 eps moves it 2e-9 on the 1e-4 probe; a
    # LayerNormalization computing it in float32 is 2e-7 off.
    _refused(
        "layernorm",
        "ln_float64",
        lambda: DoubleLayerNorm(),
        "computes in float64",
        dtype=torch.float64,
        atol=1e-8,
        rtol=1e-8,
    ),
    # RMSNorm
    _rms("rms_module", lambda: nn.RMSNorm(HIDDEN), exporters=("dynamo",)),
    _rms("rms_module_two_axes", lambda: nn.RMSNorm(BTC[1:], eps=1e-5), exporters=("dynamo",)),
    _rms("rms_llama", lambda: LlamaRMSNorm()),
    _rms("rms_t5", lambda: T5LayerNorm()),
    _rms("rms_gemma", lambda: GemmaRMSNorm()),
    _rms("rms_div_sqrt", lambda: DivRMSNorm()),
    _rms("rms_no_weight", lambda: BareRMSNorm()),
    _rms("rms_llama_fp16", lambda: LlamaRMSNorm(), **FP16_ROUND_TRIP),
    _rms("rms_t5_fp16", lambda: T5LayerNorm(), **FP16_ROUND_TRIP),
    _rms("rms_gemma_fp16", lambda: GemmaRMSNorm(), **FP16_REGION),
    # ONNX Runtime's CPU provider has no bfloat16 RMSNormalization (opset 23) kernel.
    _rms("rms_llama_bf16", lambda: LlamaRMSNorm(), opsets=(17, 18, 20), **BF16_ROUND_TRIP),
    _rms("rms_sum_div", lambda: SumRMSNorm()),
    _rms("rms_sum_no_eps", lambda: SumRMSNorm(eps=None)),
    _rms("rms_weight_first", lambda: WeightFirstRMSNorm()),
    _refused("rmsnorm", "rms_eps_outside_sqrt", lambda: EpsOutsideRMSNorm(), "not an RMSNorm"),
    _refused("rmsnorm", "rms_f_normalize", lambda: ScaledNormalize(), "F.normalize"),
    _refused("rmsnorm", "rms_middle_axis", lambda: MiddleAxisRMSNorm(), AXES),
    # BatchNorm (FoldBatchNorm)
    _bn("bn_conv1d", lambda: _seq(nn.Conv1d(4, 6, 3), nn.BatchNorm1d(6)), (2, 4, 9)),
    _bn(
        "bn_conv1d_nobias",
        lambda: _seq(nn.Conv1d(4, 6, 3, bias=False), nn.BatchNorm1d(6)),
        (2, 4, 9),
    ),
    _bn("bn_conv2d", lambda: _seq(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)), (2, 3, 6, 6)),
    _bn(
        "bn_conv2d_nobias",
        lambda: _seq(nn.Conv2d(3, 6, 3, bias=False), nn.BatchNorm2d(6)),
        (2, 3, 6, 6),
    ),
    _bn("bn_conv3d", lambda: _seq(nn.Conv3d(2, 4, 3), nn.BatchNorm3d(4)), (1, 2, 5, 5, 5)),
    _bn(
        "bn_conv3d_nobias",
        lambda: _seq(nn.Conv3d(2, 4, 3, bias=False), nn.BatchNorm3d(4)),
        (1, 2, 5, 5, 5),
    ),
    _bn(
        "bn_conv2d_grouped",
        lambda: _seq(nn.Conv2d(4, 6, 3, groups=2), nn.BatchNorm2d(6)),
        (2, 4, 6, 6),
    ),
    _bn(
        "bn_conv2d_depthwise",
        lambda: _seq(nn.Conv2d(4, 4, 3, groups=4, padding=1), nn.BatchNorm2d(4)),
        (2, 4, 6, 6),
    ),
    _bn(
        "bn_convtranspose2d",
        lambda: _seq(nn.ConvTranspose2d(4, 6, 3, stride=2), nn.BatchNorm2d(6)),
        (2, 4, 4, 4),
    ),
    _bn(
        "bn_convtranspose2d_grouped",
        lambda: _seq(nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), nn.BatchNorm2d(6)),
        (2, 4, 4, 4),
    ),
    _bn("bn_linear", lambda: _seq(nn.Linear(8, 6), nn.BatchNorm1d(6)), (3, 8)),
    _bn("bn_linear_3d", lambda: LinearBatchNorm3d(), BTC),
    _bn("bn_linear_3d_rows", lambda: LinearBatchNormFlat(), BTC),
    _bn("bn_addmm_alpha_beta", lambda: AddmmBatchNorm(), (3, 8)),
    _bn("bn_addmm_alpha_beta_transposed", lambda: AddmmBatchNorm(transposed=True), (3, 8)),
    _bn("bn_head_avgpool", lambda: ResNetTail(), RESNET_TAIL),
    _bn("bn_head_mean", lambda: ResNetTail("mean"), RESNET_TAIL),
    _bn("bn_head_two_linears", lambda: ResNetTail("two_heads"), RESNET_TAIL),
    _bn(
        "bn_before_unpadded_conv",
        lambda: _seq(nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, groups=2)),
        (2, 4, 6, 6),
    ),
    _bn("bn_before_linear", lambda: _seq(nn.BatchNorm1d(8), nn.Linear(8, 5)), (3, 8)),
    _bn("bn_hand_written", lambda: HandBatchNormAfterConv(), (2, 3, 6, 6)),
    _bn("bn_frozen", lambda: FrozenBatchNormAfterConv(), (2, 3, 6, 6)),
    _refused(
        "batchnorm",
        "bn_before_padded_conv",
        lambda: _seq(nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, padding=1)),
        "pads its input",
        (2, 4, 6, 6),
    ),
    _refused(
        "batchnorm", "bn_conv_output_shared", lambda: SharedConvOutput(), "consumers", (2, 3, 6, 6)
    ),
    _refused(
        "batchnorm", "bn_not_per_channel", lambda: NotPerChannel(), "not per-channel", (2, 3, 8, 8)
    ),
    _refused(
        "batchnorm",
        "bn_head_maxpool_negative_scale",
        lambda: ResNetTail("max"),
        "only when every scale gamma / sqrt(var + eps) is positive",
        RESNET_TAIL,
    ),
    _refused(
        "batchnorm",
        "bn_head_mean_over_channels",
        lambda: ResNetTail("channels"),
        "reduces axis 1, along which the map varies",
        RESNET_TAIL,
    ),
    # Re-parameterizable blocks (MergeBranches, after FoldBatchNorm): one Conv each, every
    # BatchNorm of their branches folded; the look-alikes refused and left as they are.
    _bn("reparam_repvgg", lambda: RepVggBlock(), REPARAM, norms=3, convs=1),
    _bn("reparam_mobileone_k2", lambda: MobileOneBlock(k=2), REPARAM, norms=4, convs=1),
    _bn("reparam_mobileone_k4", lambda: MobileOneBlock(k=4), REPARAM, norms=6, convs=1),
    _bn("reparam_fastvit_repmixer", lambda: RepMixer(), REPARAM, norms=4, convs=1),
    _bn("reparam_repvit_mixer", lambda: RepVitMixer(), REPARAM, norms=2, convs=1),
    _bn("reparam_1x1_then_3x3", lambda: OneByOneThenKxK(), (2, 4, 6, 6), norms=2, convs=1),
    _reparam_refused("reparam_relu_in_branch", lambda: ReluInBranch(), "through Relu", REPARAM),
    _reparam_refused(
        "reparam_strided_identity",
        lambda: StridedIdentity(),
        "the identity does not subsample",
        (2, 8, 1, 1),
    ),
    _reparam_refused("reparam_misaligned", lambda: MisalignedBranches(), "do not line up", REPARAM),
    # InstanceNorm / GroupNorm (and the channels-first LayerNorm); modules at the end of the
    # file. After a Conv (input (2, 3, 5, 6)), so that the TorchScript export has no shapes to
    # match with.
    Entry(
        "in_cnn_layernorm",
        "instancenorm",
        lambda: _seq(nn.Conv2d(3, 4, 3, padding=1), CnnLayerNorm(4)),
        (2, 3, 5, 6),
        FUSED,
    ),
    Entry(
        "in_cnn_layernorm_eps1e-8",
        "instancenorm",
        lambda: _seq(nn.Conv2d(3, 4, 3, padding=1), CnnLayerNorm(4, eps=1e-8)),
        (2, 3, 5, 6),
        FUSED,
    ),
    Entry("in_cnn_layernorm_unbiased", "instancenorm", lambda: CnnLayerNorm(4, True), NCHW, FUSED),
    # Look-alikes: a weight over H, W is a LayerNorm weight; eps outside the square root.
    _ln("in_spatial_gamma", lambda: CnnLayerNorm(4, gamma=(1, 1, 3, 5)), NCHW),
    _refused(
        "layernorm",
        "in_eps_outside_sqrt",
        lambda: CnnLayerNorm(4, eps_outside=True),
        "eps outside the square root",
        NCHW,
    ),
    # nn.GroupNorm: the dynamo exporter writes GroupNormalization itself from opset 21.
    _refused(
        "groupnorm",
        "gn_module",
        lambda: _random_affine(nn.GroupNorm(2, 4)),
        "no ONNX Runtime CPU kernel",
        NCHW,
        opsets=(17, 18, 20),
    ),
    _refused(
        "groupnorm",
        "gn_module_no_affine",
        lambda: nn.GroupNorm(2, 4, affine=False),
        "no ONNX Runtime CPU kernel",
        NCHW,
        opsets=(17, 18, 20),
    ),
    # ... which ONNX Runtime expands into its function body: made the exported form again.
    Entry(
        "gn_module_opset23",
        "groupnorm",
        lambda: _random_affine(nn.GroupNorm(2, 4)),
        NCHW,
        FUSED,
        exporters=("dynamo",),
        opsets=(23,),
    ),
    Entry("gn_hand", "groupnorm", lambda: HandGroupNorm(4, 2), NCHW, FUSED),
    Entry(
        "gn_hand_5d_eps1e-8",
        "groupnorm",
        lambda: _seq(nn.Conv2d(3, 4, 3, padding=1), HandGroupNorm(4, 2, eps=1e-8, split=True)),
        (2, 3, 5, 6),
        FUSED,
    ),
    _refused(
        "layernorm",
        "gn_eps_outside_sqrt",
        lambda: HandGroupNorm(4, 2, eps_outside=True),
        "eps outside the square root",
        NCHW,
    ),
    # Channels-first LayerNorm (ConvNeXt): fused at batch 1, kept (measured slower) above.
    Entry("ln_cf_convnext", "layernorm_cf", lambda: ChannelsFirstLayerNorm(4), (1, 4, 3, 5), FUSED),
    Entry(
        "ln_cf_convnext_1d",
        "layernorm_cf",
        lambda: _seq(nn.Conv1d(3, 4, 3), ChannelsFirstLayerNorm(4)),
        (1, 3, 9),
        FUSED,
    ),
    _refused(
        "layernorm_cf",
        "ln_cf_convnext_batch2",
        lambda: ChannelsFirstLayerNorm(4),
        "measured slower",
        NCHW,
    ),
]


def torch_outputs(module: nn.Module, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``module`` run eagerly on ``feeds["x"]``, in its own precision: the parity reference."""
    with torch.no_grad():
        return [module(torch.from_numpy(feeds["x"])).numpy()]


# ---- InstanceNorm / GroupNorm / channels-first LayerNorm modules (GALLERY's last section) ----


def _random_affine(module: nn.Module, seed: int = 0) -> nn.Module:
    """``module`` with a seeded random weight (1 + 0.5 N(0, 1)) and bias (0.5 N(0, 1))."""
    generator = _generator(seed)
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.5 * torch.randn(module.weight.shape, generator=generator))
        module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=generator))
    return module


class CnnLayerNorm(nn.Module):
    """The tutorials' per-channel "CNN LayerNorm": mean and variance over H, W, then gamma and
    beta of shape (1, C, 1, 1) (an InstanceNormalization).

    Args:
        channels: C.
        unbiased: the variance from ``x.var()`` (divides by H W - 1): still exact.
        gamma: the weight's and bias's shape (``(1, 1, H, W)`` makes a LayerNorm weight).
        eps_outside: ``(x - m) / (sqrt(var) + eps)``, a look-alike.
    """

    def __init__(self, channels, unbiased=False, *, eps=1e-5, gamma=None, eps_outside=False):
        super().__init__()
        generator = _generator(1)
        shape = gamma or (1, channels, 1, 1)
        self.gamma = nn.Parameter(1.0 + 0.5 * torch.randn(shape, generator=generator))
        self.beta = nn.Parameter(0.5 * torch.randn(shape, generator=generator))
        self.eps, self.unbiased, self.eps_outside = eps, unbiased, eps_outside

    def forward(self, x):
        mu = x.mean((2, 3), keepdim=True)
        if self.unbiased:
            var = x.var((2, 3), keepdim=True)
        else:
            var = ((x - mu) ** 2).mean((2, 3), keepdim=True)
        if self.eps_outside:
            x = (x - mu) / (torch.sqrt(var) + self.eps)
        else:
            x = (x - mu) / torch.sqrt(var + self.eps)
        return self.gamma * x + self.beta


class HandGroupNorm(nn.Module):
    """GroupNorm written out: ``x.reshape(N, G, -1)`` (or ``(N, G, C/G, H, W)`` with
    ``split``), mean and biased variance within each group, reshape back, per-channel weight
    and bias (Wu and He 2018); ``eps_outside`` writes the look-alike ``sqrt(var) + eps``."""

    def __init__(self, channels, groups, *, eps=1e-5, split=False, eps_outside=False):
        super().__init__()
        generator = _generator(2)
        self.weight = nn.Parameter(1.0 + 0.5 * torch.randn(channels, generator=generator))
        self.bias = nn.Parameter(0.5 * torch.randn(channels, generator=generator))
        self.groups, self.eps, self.split, self.eps_outside = groups, eps, split, eps_outside

    def forward(self, x):
        n, c = x.shape[:2]
        if self.split:
            y, dims = x.reshape(n, self.groups, c // self.groups, *x.shape[2:]), (2, 3, 4)
        else:
            y, dims = x.reshape(n, self.groups, -1), (-1,)
        mu = y.mean(dims, keepdim=True)
        var = ((y - mu) ** 2).mean(dims, keepdim=True)
        if self.eps_outside:
            y = (y - mu) / (torch.sqrt(var) + self.eps)
        else:
            y = (y - mu) / torch.sqrt(var + self.eps)
        y = y.reshape(x.shape)
        return y * self.weight[None, :, None, None] + self.bias[None, :, None, None]


class ChannelsFirstLayerNorm(nn.Module):
    """ConvNeXt's original ``LayerNorm(data_format="channels_first")`` (Liu et al. 2022), on
    (N, C, H, W) or (N, C, L)."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        generator = _generator(3)
        self.weight = nn.Parameter(1.0 + 0.5 * torch.randn(channels, generator=generator))
        self.bias = nn.Parameter(0.5 * torch.randn(channels, generator=generator))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        index = (slice(None),) + (None,) * (x.dim() - 2)
        return self.weight[index] * x + self.bias[index]
