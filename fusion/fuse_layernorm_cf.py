"""Fuse a channels-first LayerNorm written by hand (ConvNeXt's, over axis 1 of (N, C, ...)) into
Transpose -> LayerNormalization -> Transpose, where that was measured faster.

The math, when a Transpose cancels, and the measurement that decides: see
docs/fusions/fuse_layernorm_cf.md.
"""

from __future__ import annotations

import enum
import math

import onnx_ir as ir

from fusion._ir import (
    as_division,
    escaping_value,
    label,
    producer,
    rank_of,
    reduce_axes,
    shape_text,
)
from fusion.base import CannotFuse, Kind, NodeFusionPass, Op
from fusion.fuse_instancenorm import absorb_per_channel
from fusion.norm_match import (
    FLOAT,
    Centering,
    NormMatch,
    centered,
    match_mean_square,
    param_value,
)


class LayerNormCFCode(enum.StrEnum):
    """Why FuseChannelsFirstLayerNorm left a candidate alone, besides the codes every pass shares
    (:class:`fusion.base.Code`)."""

    #: The exact rewrite was measured slower than the form the graph has on the provider
    #: (``benchmarks/forms.py --set conv``): that form is kept.
    SLOWER_MEASURED = "slower_measured"


SLOWER = (
    "channels-first LayerNorm over axis 1 of a {shape} input: Transpose -> LayerNormalization "
    "-> Transpose is exact, but was measured slower than the decomposed form on the CPU "
    "provider at a batch other than 1 (benchmarks/results/forms_conv_cpu.json): kept"
)


def _perms(rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(to_last, to_first)``: the permutations that move axis 1 last, and back."""
    return (0, *range(2, rank), 1), (0, rank - 1, *range(1, rank - 1))


def _over_channels(reduce: ir.Node, rank: int) -> bool:
    """Whether ``reduce`` is a keepdims mean over axis 1 only."""
    axes = reduce_axes(reduce, rank)
    return (
        axes is not None
        and {a % rank for a in axes} == {1}
        and reduce.attributes.get_int("keepdims", 1) == 1
    )


def _is_mean(center: Centering | None) -> bool:
    """Whether ``center`` subtracts a ReduceMean itself (not a scaled sum)."""
    return center is not None and center.reduce.op_type == "ReduceMean" and center.factor == 1.0


def _transpose(value: ir.Value, perm: tuple[int, ...]) -> ir.Node | None:
    """The Transpose with ``perm`` that produces ``value``, or None."""
    node = producer(value, "Transpose")
    return node if node is not None and node.attributes.get_ints("perm") == perm else None


def _reader_transpose(value: ir.Value, perm: tuple[int, ...]) -> ir.Node | None:
    """The Transpose with ``perm`` that is the only reader of ``value``, or None."""
    uses = list(value.uses())
    if value.is_graph_output() or len(uses) != 1:
        return None
    node = uses[0].node
    ok = node.op_type == "Transpose" and node.domain == ""
    return node if ok and node.attributes.get_ints("perm") == perm else None


class FuseChannelsFirstLayerNorm(NodeFusionPass):
    """Replace a hand-written LayerNorm over axis 1 of a (N, C, ...) input by Transpose ->
    LayerNormalization -> Transpose where measured faster; counted as ``layernorm_cf_fused``,
    kept as a ``layernorm_cf`` refusal (``slower_measured``) elsewhere
    (docs/fusions/fuse_layernorm_cf.md). Runs before
    :class:`~fusion.fuse_layernorm.FuseLayerNorm`.
    """

    kinds = (
        Kind(
            "layernorm_cf_fused",
            "layernorm_cf",
            (Op("LayerNormalization"),),
            meaning=(
                "hand-written channels-first LayerNorms (statistics over axis 1 of (N, C, ...), "
                "ConvNeXt's original) made `Transpose -> LayerNormalization -> Transpose`, "
                "Transposes cancelled against neighbouring inverse ones; where that was measured "
                "slower (a batch other than 1, no Transpose cancelled) kept and listed under "
                "`refused` with code `slower_measured`"
            ),
        ),
    )
    summary = (
        "channels-first LayerNorms into Transpose -> LayerNormalization -> Transpose, where "
        "measured faster"
    )
    codes = LayerNormCFCode
    needs_opset = {"onnx": 17}

    def match(self, model: ir.Model, node: ir.Node) -> NormMatch | None:
        """The channels-first LayerNorm ending at ``node`` (the division) with its per-channel
        weight and bias; None for anything else (FuseLayerNorm's to fuse or refuse).

        Raises:
            CannotFuse: ``slower_measured``: the rewrite would not be faster
                (docs/fusions/fuse_layernorm_cf.md).
        """
        match = self._normalization(node)
        if match is None:
            return None
        rank, channels = len(match.x.shape), match.x.shape[1]
        weight = absorb_per_channel(match, "Mul", rank, channels)
        bias = absorb_per_channel(match, "Add", rank, channels)
        match.weight = (None, weight) if weight is not None else None
        match.bias = (None, bias) if bias is not None else None
        to_last, to_first = _perms(rank)
        cancels = _transpose(match.x, to_first) or _reader_transpose(match.output, to_last)
        if cancels is None and match.x.shape[0] != 1:
            raise CannotFuse(
                LayerNormCFCode.SLOWER_MEASURED, SLOWER.format(shape=shape_text(match.x.shape))
            )
        return match

    def _normalization(self, node: ir.Node) -> NormMatch | None:
        """``(x - mean_1(x)) / sqrt(f * mean_1((x - mean_1(x))^2) + eps)`` ending at ``node``,
        float32, ``x`` of known rank >= 3 and channel count, nothing read outside; or None."""
        division = as_division(node)
        core = match_mean_square(division[1]) if division is not None else None
        if core is None or core.reduce.op_type != "ReduceMean":  # sums: not in this form
            return None
        centers = [centered(core.value)]
        if division[0] is not core.value:
            centers.append(centered(division[0]))
        if not all(_is_mean(c) for c in centers) or centers[-1].x is not centers[0].x:
            return None
        x = centers[0].x
        rank = rank_of(x)
        if rank is None or rank < 3 or not isinstance(x.shape[1], int) or core.restores:
            return None
        if not all(_over_channels(r, rank) for r in [core.reduce, *(c.reduce for c in centers)]):
            return None
        if core.eps is None or core.eps.dtype != FLOAT.numpy():
            return None
        if not (math.isfinite(core.factor) and core.factor > 0):
            return None
        centering = [n for c in centers for n in c.nodes]
        nodes = [*centering, *core.nodes, *division[2], node]
        if escaping_value(nodes[len(centering) :], node.outputs[0]) is not None:
            return None
        dims = (x.shape[1],)
        return NormMatch(x, 1, dims, float(core.eps), core.factor, nodes, node.outputs[0])

    def rewrite(self, model: ir.Model, match: NormMatch) -> str:
        """Insert the LayerNormalization and the Transposes that do not cancel, move the
        readers over, drop the old nodes; return what the norm became."""
        graph = model.graph
        hint = label(match.nodes[-1])
        x, rank = match.x, len(match.x.shape)
        to_last, to_first = _perms(rank)
        last_shape = ir.Shape([x.shape.dims[p] for p in to_last])
        before = _transpose(x, to_first)
        if before is not None:  # x is a channels-last tensor moved channels-first: take that
            match.nodes.insert(0, before)
            source = before.inputs[0]
        else:
            moved = ir.node("Transpose", [x], {"perm": to_last}, name=f"{hint}_to_last")
            moved.outputs[0].type, moved.outputs[0].shape = x.type, last_shape
            graph.insert_before(match.nodes[-1], moved)
            source = moved.outputs[0]
        inputs = [source, match.scale(graph, hint)]
        if match.bias is not None:
            inputs.append(param_value(graph, None, match.bias[1], f"{hint}_bias"))
        norm = ir.node(
            "LayerNormalization",
            inputs,
            {"axis": -1, "epsilon": match.epsilon, "stash_type": 1},
            name=f"{hint}_LayerNormalization",
        )
        after = _reader_transpose(match.output, to_last)
        if after is not None:  # its only reader moves it channels-last: the norm's output is that
            match.nodes.append(after)
            match.output = after.outputs[0]
            match.replace(graph, norm)
        else:
            graph.insert_before(match.nodes[-1], norm)
            back = ir.node("Transpose", [norm.outputs[0]], {"perm": to_first}, name=f"{hint}_back")
            match.replace(graph, back)
        norm.outputs[0].type, norm.outputs[0].shape = x.type, last_shape
        steps = ["Transpose"] * (before is None) + ["LayerNormalization"]
        return " -> ".join(steps + ["Transpose"] * (after is None))
