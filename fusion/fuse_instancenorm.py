"""Fuse the per-channel "CNN LayerNorm" (a norm over the spatial axes of (N, C, *spatial), then a
per-channel weight and bias) into one ``InstanceNormalization`` node, with FuseLayerNorm's
matcher. The math and what is left to FuseLayerNorm: see docs/fusions/fuse_instancenorm.md.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, const_array, other_input, rank_of, sole_consumer
from fusion.base import CannotFuse, Kind, NodeFusionPass, Op
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.norm_match import NormMatch


def per_channel(array: np.ndarray | None, rank: int, channels: int) -> np.ndarray | None:
    """``array`` as a float32 (C,) vector when broadcasting it against (N, C, *spatial) varies
    along axis 1 at most; None otherwise."""
    if array is None or array.ndim > rank or array.dtype != np.float32:
        return None
    full = array.reshape((1,) * (rank - array.ndim) + array.shape)
    if any(n != 1 for i, n in enumerate(full.shape) if i != 1) or full.shape[1] not in (
        1,
        channels,
    ):
        return None
    return np.ascontiguousarray(np.broadcast_to(full.reshape(-1), (channels,)))


def absorb_per_channel(
    match: NormMatch, op_type: str, rank: int, channels: int
) -> np.ndarray | None:
    """Extend ``match`` over ``op_type(output, c)`` with ``c`` per channel; return ``c`` as a
    (C,) vector, or None (``match`` unchanged)."""
    node = sole_consumer(match.output)
    if node is None or node.op_type != op_type or node.domain != "":
        return None
    vector = per_channel(const_array(other_input(node, match.output)), rank, channels)
    if vector is not None:
        match.nodes.append(node)
        match.output = node.outputs[0]
    return vector


def spatial_layernorm(layernorm: FuseLayerNorm, model: ir.Model, node: ir.Node) -> NormMatch | None:
    """``layernorm``'s match at ``node`` where it normalizes axes 2.. of a float32 input of
    rank 3 or more with no weight or bias of its own (an InstanceNorm's or a GroupNorm's
    statistics); None for anything else, a refusal included (FuseLayerNorm reports those)."""
    try:
        match = layernorm.match(model, node)
    except CannotFuse:
        return None
    if match is None or match.weight is not None or match.bias is not None:
        return None
    rank = rank_of(match.x)
    if rank is None or rank < 3 or match.k != rank - 2 or match.dtype != ir.DataType.FLOAT:
        return None
    return match


class FuseInstanceNorm(NodeFusionPass):
    """Replace each hand-written per-channel "CNN LayerNorm" by one ``InstanceNormalization``
    (the math: docs/fusions/fuse_instancenorm.md). Runs before :class:`FuseLayerNorm`.

    Counted as ``instancenorm_fused``. It refuses nothing itself: a candidate that is not
    exactly an InstanceNorm is FuseLayerNorm's to fuse or to refuse with the reason.
    """

    kinds = (
        Kind(
            "instancenorm_fused",
            "instancenorm",
            (Op("InstanceNormalization"),),
            meaning=(
                'hand-written per-channel "CNN LayerNorms" (statistics over the spatial axes, '
                "weight and bias per channel) made one `InstanceNormalization`"
            ),
        ),
    )
    summary = (
        'the per-channel "CNN LayerNorm" into InstanceNormalization, with FuseLayerNorm\'s matcher'
    )

    def __init__(self, target: str = "ort", exclude: Collection[str] = ()):
        super().__init__(target, exclude)
        self._layernorm = FuseLayerNorm(target)  # its matcher; its outcomes are not kept

    def match(self, model: ir.Model, node: ir.Node) -> NormMatch | None:
        """A LayerNorm over axes 2.. of a float32 (N, C, ...) input with no weight of its own,
        followed by a per-channel Mul (and optionally Add); None for anything else."""
        match = spatial_layernorm(self._layernorm, model, node)
        if match is None:
            return None
        rank = rank_of(match.x)
        channels = match.x.shape[1]
        if not isinstance(channels, int):
            return None
        scale = absorb_per_channel(match, "Mul", rank, channels)
        if scale is None:
            return None
        bias = absorb_per_channel(match, "Add", rank, channels)
        match.weight = (None, scale)
        match.bias = (None, bias if bias is not None else np.zeros(channels, np.float32))
        return match

    def rewrite(self, model: ir.Model, match: NormMatch) -> str:
        """Insert the InstanceNormalization, move the readers over, drop the old nodes."""
        graph = model.graph
        hint = match.nodes[-1].name or "instancenorm"
        scale = (match.weight[1].astype(np.float64) / math.sqrt(match.factor)).astype(np.float32)
        fused = ir.node(
            "InstanceNormalization",
            [
                match.x,
                add_initializer(graph, f"{hint}_scale", scale),
                add_initializer(graph, f"{hint}_B", match.bias[1]),
            ],
            {"epsilon": match.epsilon},
            name=f"{hint}_InstanceNormalization",
        )
        match.replace(graph, fused)
        return "InstanceNormalization"
