"""Fuse a decoder's attention, with its rotary embedding, into ONNX Runtime's
``GroupQueryAttention`` (com.microsoft, ContribOperators.md), or, with a KV cache or a mask
computed at run time, into ONNX's ``Attention`` and ``RotaryEmbedding`` (opset 23).

The math
--------
Scaled dot-product attention (Vaswani et al., 2017, eq. 1) over ``N`` query heads that share
``K`` key/value heads, each ``N / K`` times (Ainslie et al., 2023, "GQA"), with the rotary
position embedding of RoFormer (Su et al., 2021) applied to the queries and keys::

    out = softmax(scale * rope(q) @ rope(k)^T + mask) @ v

or, with Gemma 2's soft-capping of the scores before the mask, ``softmax(c * tanh(scale *
rope(q) @ rope(k)^T / c) + mask) @ v``: the ops' ``softcap = c`` (:func:`.core.scores`).

``GroupQueryAttention`` computes this from the projections before they are split into heads
(``query (B, S, N*H)``, ``key`` and ``value (B, T, K*H)``): it splits them, rotates ``q`` and
``k`` with rows of its ``cos_cache`` / ``sin_cache`` (``do_rotary=1``), repeats the key/value
heads itself, and masks causally (``causal=1``) or adds ``attention_bias``.

What is fused, as ``torch.onnx.export`` (dynamo, or TorchScript as Optimum runs it) writes
transformers' ``LlamaAttention`` and the models that copy it (Qwen2/3, Mistral, Gemma, Phi-3),
at a fixed length or with symbolic axes (:mod:`.parts` for each piece, :mod:`.core` for the
Softmax's surroundings):
``Softmax(scale * Q @ K^T [+ mask])`` anchored at the Softmax, the NaN guard of the dynamo export
(``Where(IsNaN(p), 0, p)``: no row of a constant mask fused is all masked, and the rows of a
run-time mask that are go to the model's own branch, so no NaN arises),
``@ V``, and the merge of the heads back into ``(B, S, N*H)``; ``Q`` a split into heads,
rotated; ``K`` the same with its heads repeated; ``V`` likewise; and the nodes that only feed
these (the ``Shape`` arithmetic of a symbolic-length export). Attention with no rotation and no
causal mask (an encoder's) is left to :mod:`fusion.fuse_attention`. The op runs in float32 on
ONNX Runtime's CPU provider; its CUDA kernel takes float16 and bfloat16 only, so a caller
turns the pass off for CUDA runs (:attr:`fusion.Policy.gqa`).

Exactness. Without a past, the query at position ``i`` of the call reads row ``i`` of the
op's caches. So the rotation is the op's own exactly when the model's ``cos`` and ``sin`` have
one row per position of the call, alike for every batch and head, with equal halves
(``cat(freqs, freqs)``, as transformers builds them): constant tables (the first halves become
the caches), or values computed at run time whose leading axes are 1 and which are
``cat(f, f)`` put through elementwise ops (:func:`.parts.runtime_table`; the caches are then
those ops applied to the model's own ``f``, so the op rotates by the very numbers the model
does). Tables of one row per batch row and position (the model's ``position_ids`` input) are
taken by ONNX's ``RotaryEmbedding`` alone, as ``(B, S, H/2)`` caches: with a KV cache or a
run-time mask, below (else refused, :func:`_check_per_batch`). The
mask (:mod:`.masks`) is evaluated where it comes from constants and the inputs' shapes alone:
0 on and below the diagonal and masked above it (``-inf``, or at most ``-1e30``, as
transformers' ``finfo.min``) gives ``causal=1``; all zeros, ``causal=0``; another constant mask
with no row all masked becomes ``attention_bias`` with ``causal=0``. The scale is the product of
every scalar factor on ``Q``, ``K`` and the scores.

With a KV cache (``present = Concat(past, rope(k))`` along the length, :func:`.parts.with_past`;
Optimum's and onnxruntime-genai's layout ``(B, K, P, H)``), or a mask computed at run time
without one (an ``attention_mask`` input to a prefill, a sliding window), the attention becomes
ONNX's own ``Attention`` with ``RotaryEmbedding`` of the query and the key (opset 23, the
model's opset raised to it, :mod:`.standard`): ONNX Runtime's CPU kernel of ``Attention``
computes every input the model accepts, where GroupQueryAttention's refuses a batch of several
sequences of several tokens after a past and gives NaN for a query all masked; the model's mask,
as the model computes it from its ``attention_mask`` (padding, the causal offset of the past), is
its ``attn_mask``, and the ``present`` outputs keep the model's names. A sliding-window cache
(Mistral's, Gemma 2's) crops the past before the new keys join it: the op's past is the cropped
one, and the mask, which the model adds to the scores, spans the keys wherever the model runs,
though its length is not provably theirs (:func:`.masks.mask_spans_keys`; only this op takes
it). In a decode step the three projections become one MatMul and a Split
(:func:`.build.projected`). Where the model's
opset is below 18 (onnxscript's version converter starts there) or its mask is not of a form
:func:`.standard.bias` takes, GroupQueryAttention takes the past (every key valid to it,
``seqlens_k = P + S - 1``) and the mask as its ``attention_bias`` (``causal=0``), rotating by the
model's ``S`` rows of ``cos``/``sin`` through ``position_ids = 0 .. S-1``
(:func:`.build.positions`), behind an ``If`` whose other branch is the model's own attention
(:mod:`.guard`), for the inputs its CPU kernel refuses or computes otherwise; the projections of
a decode step are then its packed query.

Left intact, with the reason in the report: a mask computed at run time that is not of the op's
``attention_bias`` shape ``(B | 1, N | 1, S, T)``; a mask computed from the inputs' sizes with
no rotation (an encoder's, :mod:`fusion.fuse_attention`'s); ``cos``/``sin`` not of the form
above; only one of ``Q`` and ``K`` rotated; a value inside read elsewhere; a split into heads of
unknown count or size (the TorchScript exporter's ``-1`` heads where neither ONNX's shape
inference nor ONNX Runtime's symbolic one computes them, :class:`fusion.FillShapes`); keys of
another length than the queries and no past (cross-attention); a value head size other than the
key's; head counts that do not group. Only a decoder's attention is a candidate (rotated, with a
past, or masked causally, :func:`.trace.heads_of`): an encoder's (no rotation, no causal mask,
as in a cross-attention of a UNet or an encoder-decoder) is left to :mod:`fusion.fuse_attention`
with no refusal here.
"""

from __future__ import annotations

from fusion.fuse_gqa.fusion_pass import FuseGroupQueryAttention, GQAMatch

__all__ = ["FuseGroupQueryAttention", "GQAMatch"]
