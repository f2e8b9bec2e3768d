"""What a model holds, counted: its ONNX Runtime-only ops (:func:`onnxruntime_ops`) and its
norm ops (:func:`norm_ops`)."""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from fusion._ir import opset_version
from fusion.base import MS_DOMAIN, Op
from fusion.registry import NORM_OPS, ort_registered


def onnxruntime_ops(model: ir.Model) -> dict[str, int]:
    """How many nodes of each op the model holds, subgraphs included (a GroupQueryAttention
    behind an If), that only ONNX Runtime runs (zeros left out): com.microsoft contrib ops as
    ``com.microsoft.OpType``, and the ops ONNX Runtime registers in the default domain where
    ONNX has none at the model's opset (:func:`ort_registered`: SimplifiedLayerNormalization,
    LayerNormalization below 17)."""
    opset = opset_version(model)
    counts = Counter(
        f"{node.domain}.{node.op_type}" if node.domain else node.op_type
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if node.domain == MS_DOMAIN or ort_registered(node.op_type, node.domain, opset)
    )
    return dict(sorted(counts.items()))


def norm_ops(model: ir.Model) -> dict[str, int]:
    """How many nodes of each :data:`NORM_OPS` type the model holds, subgraphs included (a
    LayerNorm fused inside an If's branch), zeros left out."""
    counts = Counter(
        node.op_type
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if Op(node.op_type, node.domain) in NORM_OPS
    )
    return dict(sorted(counts.items()))
