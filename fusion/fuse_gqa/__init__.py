"""Fuse a decoder's attention, with its rotary embedding, into ONNX Runtime's
``GroupQueryAttention`` (com.microsoft), or, with a KV cache or a mask computed at run time,
into ONNX's ``Attention`` and ``RotaryEmbedding`` (opset 23): :class:`FuseGroupQueryAttention`.

The math, what is matched, the exactness conditions (rotary tables, masks, the ``If`` guard)
and the refusals with their codes: see docs/fusions/fuse_gqa.md.
"""

from __future__ import annotations

from fusion.fuse_gqa.fusion_pass import FuseGroupQueryAttention, GQAMatch

__all__ = ["FuseGroupQueryAttention", "GQAMatch"]
