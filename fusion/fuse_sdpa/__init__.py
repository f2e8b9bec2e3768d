"""Fuse scaled dot-product attention, however a library or an exporter decomposed it, into
ONNX's ``Attention`` (opset 23): :class:`FuseSDPA`, for both targets.

The math, the forms fused, the 3-D form, the masks, the opset raise and the refusals with
their codes and measurements: see docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

from fusion.fuse_sdpa.fusion_pass import FuseSDPA, SDPAMatch

__all__ = ["FuseSDPA", "SDPAMatch"]
