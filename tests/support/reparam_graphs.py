"""Re-parameterizable blocks (RepVGG, MobileOne, FastViT, RepViT) as graphs, for MergeBranches'
tests and ``explain``'s: each branch a Conv, a BatchNormalization or the input itself, summed by
Adds, as the exporters write a block before its re-parameterize step. Every weight, bias and
BatchNorm statistic is random. The PyTorch blocks are in the gallery (``models/norms.py``)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from tests.support.graphs import make_model

F = TensorProto.FLOAT
#: The channels of every block here.
C = 6


class Block:
    """Nodes and constants of a block under construction, reading ``x`` (N, C, H, W)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list = []
        self.inits: dict[str, np.ndarray] = {}

    def conv(self, x: str, k: int, *, c_out: int = C, c_in: int = C, group: int = 1, **attrs):
        """A Conv of kernel ``k`` with a random weight and bias; pads ``k // 2`` unless given."""
        name = f"conv{len(self.nodes)}"
        shape = (c_out, c_in // group, k, k)
        self.inits[f"{name}_w"] = self.rng.normal(size=shape).astype(np.float32) / k
        self.inits[f"{name}_b"] = self.rng.normal(size=c_out).astype(np.float32)
        attrs = {"pads": [k // 2] * 4, "group": group, **attrs}
        self.nodes.append(("Conv", [x, f"{name}_w", f"{name}_b"], [name], attrs))
        return name

    def bn(self, x: str, c: int = C) -> str:
        """A BatchNormalization with random statistics."""
        name = f"bn{len(self.nodes)}"
        rng = self.rng
        params = (rng.uniform(0.2, 2, c), rng.uniform(-1, 1, c), rng.uniform(-1, 1, c))
        params += (rng.uniform(0.5, 2, c),)
        for p, v in zip(("scale", "B", "mean", "var"), params, strict=True):
            self.inits[f"{name}_{p}"] = v.astype(np.float32)
        inputs = [x, *(f"{name}_{p}" for p in ("scale", "B", "mean", "var"))]
        self.nodes.append(("BatchNormalization", inputs, [name], {"epsilon": 1e-3}))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        name = f"{op_type.lower()}{len(self.nodes)}"
        self.nodes.append((op_type, list(inputs), [name], attrs))
        return name

    def const(self, array: np.ndarray) -> str:
        name = f"k{len(self.inits)}"
        self.inits[name] = array.astype(np.float32)
        return name

    def add(self, *values: str) -> str:
        total = values[0]
        for v in values[1:]:
            total = self.op("Add", total, v)
        return total

    def model(self, y: str, shape=(2, C, 7, 7), out=None) -> ir.Model:
        return make_model(self.nodes, {"x": (F, shape)}, {y: (F, out)}, self.inits)


def repvgg(b: Block) -> str:
    return b.op("Relu", b.add(b.conv("x", 3), b.conv("x", 1), b.bn("x")))


def mobileone(k: int):
    def block(b: Block) -> str:
        convs = [b.conv("x", 3, group=C) for _ in range(k)]
        return b.op("Relu", b.add(b.conv("x", 1, group=C), b.bn("x"), *convs))

    return block


def repmixer(b: Block) -> str:
    """FastViT: ``x + gamma * (mixer(x) - norm(x))``, the mixer a depthwise RepVGG block."""
    mixer = b.add(b.conv("x", 3, group=C), b.conv("x", 1, group=C), b.bn("x"))
    gamma = b.const(b.rng.uniform(0.1, 1, (C, 1, 1)))
    return b.op("Add", "x", b.op("Mul", b.op("Sub", mixer, b.bn("x")), gamma))


def repvit(b: Block) -> str:
    """RepViT's token mixer: ``bn(conv3x3(x) + conv1x1(x) + x)``, depthwise."""
    return b.bn(b.add(b.conv("x", 3, group=C), b.conv("x", 1, group=C), "x"))


def large_kernel(b: Block) -> str:
    """FastViT's large-kernel stem: 7x7 and 3x3 at stride 2."""
    return b.add(b.conv("x", 7, group=C, strides=[2, 2]), b.conv("x", 3, group=C, strides=[2, 2]))


def dilated(b: Block) -> str:
    """A 3x3 of dilation 3 beside a 1x1 (one 3x3 of dilation 3), and a 3x3 of dilation 2 inside
    a 5x5 (one dense 5x5)."""
    a = b.add(b.conv("x", 3, dilations=[3, 3], pads=[3] * 4), b.conv("x", 1))
    return b.add(b.conv(a, 3, dilations=[2, 2], pads=[2] * 4), b.conv(a, 5))


MERGED = {
    "repvgg": (repvgg, ["Conv", "Relu"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "mobileone_k2": (mobileone(2), ["Conv", "Relu"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "mobileone_k4": (mobileone(4), ["Conv", "Relu"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "fastvit_repmixer": (repmixer, ["Conv"], {"reparam_merged": 1, "batchnorm_folded": 2}),
    "repvit_token_mixer": (repvit, ["Conv"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "large_kernel_strided": (large_kernel, ["Conv"], {"reparam_merged": 1}),
    "dilated": (dilated, ["Conv", "Conv"], {"reparam_merged": 2}),
}  # fmt: skip
