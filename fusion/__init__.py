"""ONNX graph passes: fold BatchNorm, merge re-parameterizable blocks, fuse LayerNorm and RMSNorm
(and, for ONNX Runtime, attention and GELU). Usable alone on any .onnx::

    import onnx_ir as ir
    import fusion

    model = ir.load("model.onnx")
    report = fusion.optimize(model, target="ort")   # in place
    ir.save(model, "model.opt.onnx")
    fusion.check("model.opt.onnx")
    print(report.to_dict(fusion.FUSION_KINDS))

The graph helpers the passes use that a caller may use too are in :mod:`fusion.graph`.

Every rewrite is exact (up to float rounding): a candidate that cannot be expressed exactly by
the fused op is left alone and recorded in the report with its reason; :func:`unlisted` finds
what still looks like a norm or an attention in an optimized model and is in no report.
"""

from __future__ import annotations

from fusion import graph, registry
from fusion.audit import Lookalike, lookalikes, unlisted
from fusion.base import (
    TARGETS,
    CannotFuse,
    Fused,
    FusionPass,
    FusionReport,
    Kind,
    NodeFusionPass,
    Op,
    Policy,
    Refused,
)
from fusion.checker import check
from fusion.cleanup import cleanup
from fusion.counts import norm_ops, onnxruntime_ops
from fusion.driver import optimize
from fusion.registry import CODES, FUSION_KINDS, KINDS, NORM_OPS, PASSES, Code, ort_registered
from fusion.shapes import DropShapes, FillShapes

__all__ = [
    "CODES",
    "FUSION_KINDS",
    "KINDS",
    "NORM_OPS",
    "PASSES",
    "TARGETS",
    "CannotFuse",
    "Code",
    "Fused",
    "FusionPass",
    "DropShapes",
    "FillShapes",
    "FusionReport",
    "Kind",
    "Lookalike",
    "NodeFusionPass",
    "Op",
    "Policy",
    "Refused",
    "check",
    "graph",
    "lookalikes",
    "cleanup",
    "norm_ops",
    "onnxruntime_ops",
    "optimize",
    "ort_registered",
    "registry",
    "unlisted",
]
