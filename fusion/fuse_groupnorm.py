"""Recognize GroupNorm, in the form ``nn.GroupNorm`` exports and written by hand: keep the exported
form (no ONNX Runtime CPU kernel for ``GroupNormalization``), make a hand-written one that form,
and for ``target="ort"`` expand a ``GroupNormalization``-21 into it.

The math, the measurement behind the choice and the shapes it needs: see
docs/fusions/fuse_groupnorm.md.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    add_initializer,
    const_array,
    dims,
    label,
    opset_version,
    producer,
    rank_of,
    remove_nodes,
    replace_output,
    same_dim,
    sole_consumer,
)
from fusion.base import CannotFuse, Code, Kind, NodeFusionPass, Op
from fusion.fuse_instancenorm import spatial_layernorm
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.norm_match import NormMatch

KEPT = (
    "GroupNorm ({groups} groups of {channels} channels) kept as Reshape -> "
    "InstanceNormalization -> Reshape: GroupNormalization-21 has no ONNX Runtime CPU kernel "
    "(ORT expands it into its function body, measured slower: "
    "benchmarks/results/forms_conv_cpu.json)"
)


def _keeps_batch(reshape: ir.Node, x_dims: tuple, view_dims: tuple) -> bool:
    """Whether ``reshape`` keeps the batch axis: the same dimension, or a target of 0 there
    (which copies the input's dimension, under ``allowzero=0``)."""
    if same_dim(x_dims[0], view_dims[0]):
        return True
    target = const_array(reshape.inputs[1]) if len(reshape.inputs) > 1 else None
    return (
        target is not None
        and target.size > 0
        and int(target.reshape(-1)[0]) == 0
        and reshape.attributes.get_int("allowzero", 0) == 0
    )


def grouping(view: ir.Value, normalized: ir.Value) -> tuple[int, int] | None:
    """``(G, C)`` when ``view`` is a Reshape of some ``x`` (N, C, *spatial) into (N, G, ...)
    groups of consecutive channels, and ``normalized`` (the norm of ``view``) is only read by a
    Reshape back to the shape of ``x``; None otherwise (shapes unknown included)."""
    reshape = producer(view, "Reshape")
    back = sole_consumer(normalized)
    if reshape is None or back is None or back.op_type != "Reshape" or back.domain != "":
        return None
    x_dims, view_dims, out_dims = (dims(v) for v in (reshape.inputs[0], view, back.outputs[0]))
    if x_dims is None or view_dims is None or out_dims is None:
        return None
    if len(x_dims) < 3 or len(view_dims) < 3 or len(out_dims) != len(x_dims):
        return None
    if not all(isinstance(d, int) for d in (*x_dims[1:], *view_dims[1:])):
        return None
    if not all(same_dim(a, b) for a, b in zip(x_dims, out_dims, strict=True)):
        return None
    channels, groups = x_dims[1], view_dims[1]
    if groups < 1 or channels % groups or not _keeps_batch(reshape, x_dims, view_dims):
        return None
    if math.prod(view_dims[2:]) != channels // groups * math.prod(x_dims[2:]):
        return None
    return groups, channels


class FuseGroupNorm(NodeFusionPass):
    """Recognize every GroupNorm: keep the exported form (refusal ``no_ort_kernel``), make a
    hand-written one that form (``groupnorm_fused``); see docs/fusions/fuse_groupnorm.md. Runs
    before
    :class:`FuseLayerNorm`, whose matcher it uses for the hand-written normalization.
    """

    kinds = (
        Kind(
            "groupnorm_fused",
            "groupnorm",
            (Op("InstanceNormalization"), Op("GroupNormalization")),
            meaning=(
                "GroupNorms made `nn.GroupNorm`'s exported form, `Reshape -> InstanceNormalization "
                "-> Reshape` then the per-channel `Mul` / `Add`: hand-written ones (mean and "
                "variance within groups of channels after a reshape), and with `--target ort` "
                "`GroupNormalization` (opset 21 and up), which ONNX Runtime expands into its "
                "function body; a GroupNorm already in that form is kept and listed under `refused`"
                " with code `no_ort_kernel`"
            ),
        ),
    )
    summary = (
        "GroupNorms into nn.GroupNorm's exported form (Reshape -> InstanceNormalization -> Reshape)"
    )

    def __init__(self, target: str = "ort", exclude: Collection[str] = ()):
        super().__init__(target, exclude)
        self._layernorm = FuseLayerNorm(target)  # its matcher; its outcomes are not kept

    def match(self, model: ir.Model, node: ir.Node) -> NormMatch | ir.Node | None:
        """A hand-written GroupNorm's normalization ending at ``node`` (the division), as a
        match over the (N, G, ...) view; ``node`` itself when it is a GroupNormalization-21 to
        expand; None for anything else.

        Raises:
            CannotFuse: ``no_ort_kernel``: ``node`` is the InstanceNormalization of an exported
                GroupNorm, which is kept; ``not_constant``: a GroupNormalization-21 whose scale
                or bias is not a constant.
        """
        if node.op_type == "GroupNormalization" and node.domain == "":
            return self._standard(model, node)
        if node.op_type == "InstanceNormalization" and node.domain == "":
            found = grouping(node.inputs[0], node.outputs[0])
            if found is not None:
                detail = KEPT.format(groups=found[0], channels=found[1])
                raise CannotFuse(Code.NO_ORT_KERNEL, detail)
            return None
        match = spatial_layernorm(self._layernorm, model, node)
        found = match is not None and grouping(match.x, match.output) is not None
        return match if found else None

    def _standard(self, model: ir.Model, node: ir.Node) -> ir.Node | None:
        """``node`` (a GroupNormalization) when it is to be expanded: ``target="ort"``, opset
        21 or later, a float32 input of known rank >= 3 and channel count divisible into the
        groups; None otherwise.

        Raises:
            CannotFuse: ``not_constant``: its scale or bias is not a constant.
        """
        x = node.inputs[0]
        if self.target != "ort" or opset_version(model) < 21 or x.dtype != ir.DataType.FLOAT:
            return None
        rank, groups = rank_of(x), node.attributes.get_int("num_groups", 0)
        channels = x.shape[1] if rank is not None and rank >= 3 else None
        if not isinstance(channels, int) or groups < 1 or channels % groups:
            return None
        if any(const_array(v) is None for v in node.inputs[1:3]):
            raise CannotFuse(
                Code.NOT_CONSTANT,
                "GroupNormalization's scale or bias is not a constant: kept (ONNX Runtime "
                "expands it into its function body)",
            )
        return node

    def rewrite(self, model: ir.Model, match: NormMatch | ir.Node) -> str:
        """Put an InstanceNormalization (unit scale over ``sqrt(factor)``, zero B) in place of
        the normalization, the Reshapes and the affine part staying; or expand a
        GroupNormalization-21 into the exported form."""
        if isinstance(match, ir.Node):
            return _expand(model.graph, match)
        graph = model.graph
        hint = match.nodes[-1].name or "groupnorm"
        groups = match.x.shape[1]
        scale = np.full(groups, 1.0 / math.sqrt(match.factor), np.float32)
        fused = ir.node(
            "InstanceNormalization",
            [
                match.x,
                add_initializer(graph, f"{hint}_scale", scale),
                add_initializer(graph, f"{hint}_B", np.zeros(groups, np.float32)),
            ],
            {"epsilon": match.epsilon},
            name=f"{hint}_InstanceNormalization",
        )
        match.replace(graph, fused)
        return "InstanceNormalization (nn.GroupNorm's exported form)"


def _expand(graph: ir.Graph, node: ir.Node) -> str:
    """Replace GroupNormalization-21 ``node`` by Reshape -> InstanceNormalization -> Reshape ->
    Mul -> Add (docs/fusions/fuse_groupnorm.md)."""
    x, hint = node.inputs[0], label(node)
    groups, rank = node.attributes.get_int("num_groups"), len(x.shape)
    per_channel = (x.shape[1],) + (1,) * (rank - 2)
    scale, bias = (const_array(v).reshape(per_channel) for v in node.inputs[1:3])

    def const(name: str, array: np.ndarray) -> ir.Value:
        return add_initializer(graph, f"{hint}_{name}", array)

    view = ir.node("Reshape", [x, const("groups", np.array([0, groups, -1], np.int64))])
    ones, zeros = np.ones(groups, np.float32), np.zeros(groups, np.float32)
    epsilon = node.attributes.get_float("epsilon", 1e-5)
    normed = ir.node(
        "InstanceNormalization",
        [view.outputs[0], const("ones", ones), const("zeros", zeros)],
        {"epsilon": epsilon},
        name=f"{hint}_InstanceNormalization",
    )
    shape = ir.node("Shape", [x])
    back = ir.node("Reshape", [normed.outputs[0], shape.outputs[0]])
    scaled = ir.node("Mul", [back.outputs[0], const("scale", scale.astype(np.float32))])
    shifted = ir.node("Add", [scaled.outputs[0], const("bias", bias.astype(np.float32))])
    new = [view, normed, shape, back, scaled, shifted]
    for n in new:
        n.outputs[0].type = x.type
    shape.outputs[0].type = ir.TensorType(ir.DataType.INT64)
    shifted.outputs[0].shape = x.shape.copy()
    graph.insert_before(node, new)
    replace_output(graph, node.outputs[0], shifted.outputs[0])
    remove_nodes(graph, [node])
    return "Reshape -> InstanceNormalization -> Reshape -> Mul -> Add"
