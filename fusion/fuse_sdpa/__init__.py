"""Fuse scaled dot-product attention, however a library or an exporter decomposed it, into
ONNX's ``Attention`` (opset 23, Operators.md).

The math
--------
Scaled dot-product attention (Vaswani et al., 2017, eq. 1), with a mask or bias on the scores::

    Y = softmax(scale * Q @ K^T + mask) @ V        # Q (B, N, S, H), K (B, N, L, H), V (B, N, L, Hv)

is what ``Attention`` computes from 4-D ``Q``, ``K``, ``V`` and ``attn_mask`` with its
``scale`` attribute (for 3-D ``(B*N, S, H)`` tensors, the heads folded into the batch, with
``q_num_heads = kv_num_heads = 1``). The op takes the tensors as they are, so the projections
and the split into heads (Reshape / Transpose, Split, Slice, a packed in-projection,
cross-attention from other tensors, with or without bias) are not matched: only the core
around each Softmax (:mod:`.core`). Where the heads are a view of the projections and are merged
back after, the op takes the projections in its 3-D form instead, without the Transposes
(:mod:`.layout`).

What is fused
-------------
* the scale: constant scalars on the scores (``Mul`` / ``Div`` after the MatMul), on ``Q`` and
  on ``K^T`` (torch's decomposition of ``F.scaled_dot_product_attention`` scales each by
  ``sqrt(scale)``, through a ``CastLike`` at the dynamo exporter's default opset), multiplied
  into one ``scale``; none is scale 1;
* a constant scale per head on the scores (of shape 1 but in the heads' axis: SwinV2's cosine
  attention's ``exp(min(logit_scale, log 100))``, EdgeNeXt's XCA's ``temperature``, both
  ``(N, 1, 1)``), moved into ``Q`` by a ``Mul`` (:mod:`.scales`): ``(s_h Q) K^T = s_h (Q K^T)``,
  exact up to rounding, a negative ``s_h`` too (its sign goes into ``Q``: only the op's
  ``scale``, the numbers on the scores, ``Q`` and ``K``, must be positive);
* ``K^T``: ``Transpose(K, perm=[0, 1, 3, 2])``, a Transpose of another layout (``K`` is then one
  Transpose of the composed perm), the dynamo exporter's ``Reshape -> Transpose -> Reshape``,
  or any ``(B, N, H, L)`` tensor (``K`` its Transpose: YOLO's ``q^T @ k``, whose ``q^T`` is
  ``Q`` as it is);
* the weights' product: ``P @ V`` (maybe behind the NaN guard ``Where(IsNaN(p), 0, p)``), or
  YOLO's ``V @ P^T`` (``Attention`` of ``V``'s Transpose, its output transposed back: Transposes
  are exact);
* masks and biases (:mod:`.masks`): additive ones (torch's causal mask, a padding mask, relative
  positions, ALiBi, T5's bias), segment-anything's relative positions added through a 5-D view of
  the scores (``Reshape -> Add -> Add -> Reshape``), boolean ``Where(c, scores, -inf or a large
  negative)`` either way round, ``Not(c)`` too.

Left alone, with the reason (refusals only for a Softmax whose input comes from a MatMul and
whose output feeds one): a Softmax over another axis than the keys' (``softmax_axis``), an op
between ``Q @ K^T`` and the Softmax that is no scale or mask, a mask scaled with the scores, a
boolean mask beside another (``scores_form``), a scale computed at run time (``not_constant``),
varying along another axis than the heads' or broadcasting the scores (``scale_not_scalar``),
a number that is not positive or a head's scale that is not finite (``scale_not_positive``: the
kernel requires ``scale > 0``), a mask under which a row masked at every key would come out
otherwise (``mask_not_exact``), tensors other than float32 (``unsupported_dtype``), not all
3-D or 4-D, of batches, head counts or lengths not provably alike (``shape_mismatch``), the
weights read elsewhere (``shared_output``), and, for the CPU provider (the policy's ``threads``), an
attention whose batch times heads is below the intra-op threads (``few_heads``): ONNX Runtime's
CPU kernel of ``Attention`` parallelizes over batch and heads only (``ComputeAttentionProbs``'
``TryParallelFor`` over ``batch_size * q_num_heads``, onnxruntime/core/providers/cpu/llm/
attention.cc), where the MatMuls it replaces use every thread: a single-head attention (a VAE's
mid-block) ran slower fused (``benchmarks/results/attention_forms_cpu.json``, ``vae_mid``);
YOLO's transposed attention where the policy says so (``sdpa_transposed=False``, a caller's
choice for the CPU provider: ``transposed_form``).

``Attention`` needs opset 23: a model at 18 or above is raised to it by onnxscript's version
converter (:func:`fusion.fuse_gqa.standard.upgrade`, said in the report's notes) before the
first rewrite; below 18 every candidate is refused (``opset_too_low``).

It runs after :class:`fusion.fuse_attention.FuseAttention`, so that the transformers encoders keep
ONNX Runtime's contrib attention, measured faster on them; for both targets.
"""

from __future__ import annotations

from fusion.fuse_sdpa.fusion_pass import FuseSDPA, SDPAMatch

__all__ = ["FuseSDPA", "SDPAMatch"]
