"""Attention as the exporters decompose it, as graphs (no PyTorch), shared by FuseSDPA's tests
and the fusion policy's."""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from tests.support.graphs import make_model

F = TensorProto.FLOAT
#: YOLO11's C2PSA attention's inputs: q, k ``(batch, heads, head size, length)``, v ``(batch,
#: heads, value head size, length)``, float32; its scale ``1 / sqrt(head size)``.
YOLO = {"q": (F, (2, 3, 8, 7)), "k": (F, (2, 3, 8, 7)), "v": (F, (2, 3, 6, 7))}
YOLO_SCALE = 1 / math.sqrt(8)


def random_feeds(rng: np.random.Generator, inputs: dict) -> dict[str, np.ndarray]:
    """A random array for each of ``inputs`` (name -> ``(TensorProto dtype, shape)``): standard
    normal float32, or a boolean mask about 60% True."""
    return {
        name: rng.standard_normal(shape).astype(np.float32)
        if dtype == F
        else rng.random(shape) > 0.4
        for name, (dtype, shape) in inputs.items()
    }


def yolo_attention() -> ir.Model:
    """C2PSA: ``attn = (q^T @ k) * scale``, ``out = v @ attn^T`` on :data:`YOLO`'s inputs,
    opset 20."""
    nodes = [
        ("Transpose", ["q"], ["qt"], {"perm": [0, 1, 3, 2]}),
        ("MatMul", ["qt", "k"], ["raw"], {}),
        ("Mul", ["raw", "scale"], ["scores"], {}),
        ("Softmax", ["scores"], ["p"], {"axis": -1}),
        ("Transpose", ["p"], ["pt"], {"perm": [0, 1, 3, 2]}),
        ("MatMul", ["v", "pt"], ["y"], {}),
    ]
    scale = {"scale": np.float32(YOLO_SCALE)}
    return make_model(nodes, YOLO, {"y": (F, None)}, scale, opset=20)
