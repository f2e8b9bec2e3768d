"""Fold a BatchNorm into the linear layer after it.

``W (s x + t) + b = (W s) x + (W t + b)``, with ``s`` on the layer's input channel axis and
``W t`` summed over the input channels and kernel taps: exact for a Conv with no padding, a
Gemm with ``transA = 0`` and a MatMul (input channels on the last axis of its input), when
every value from the BatchNorm to the layer is read by that path only. The map may cross the
ops of :data:`~fusion.fold_batchnorm.across.ACROSS` on the way (the package docstring,
:mod:`fusion.fold_batchnorm`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    KnownShapes,
    const_array,
    label,
    num_consumers,
    remove_nodes,
    replace_output,
    set_input,
    value_reader,
)
from fusion.base import CannotFuse, Code
from fusion.fold_batchnorm.across import ACROSS, move, rank_after
from fusion.fold_batchnorm.after import add_to_matmul_bias
from fusion.fold_batchnorm.algebra import as_layer, batchnorm_affine, check_channels, constant


def fold_into_next(graph: ir.Graph, bn: ir.Node, shapes: KnownShapes) -> str:
    """Fold the BatchNormalization ``bn`` into the Conv / Gemm / MatMul after it and remove it.

    Returns:
        What it became, for the report.

    Raises:
        CannotFuse: it cannot be folded into the layer after it; nothing is changed. Codes:
            ``no_linear_layer`` (no such layer), ``shared_output`` (a value on the way is read
            elsewhere too), ``padded_conv``, ``gemm_trans_a``, ``maxpool_negative_scale``,
            ``unknown_shape``, ``no_channel_axis``, ``wrong_channel_axis``,
            ``channel_mismatch``, and those of :func:`~fusion.fold_batchnorm.algebra.as_layer`,
            :func:`~fusion.fold_batchnorm.algebra.batchnorm_affine` and of the moves across.
    """
    across, following = _path_to_layer(bn)
    s, t = _carry_to_layer(bn, across, following, shapes)
    name = label(following)  # before the fold, which may rename its output
    _fold_before(graph, following, s, t, shapes)
    replace_output(graph, bn.outputs[0], bn.inputs[0])
    remove_nodes(graph, [bn])
    moved = f" across {', '.join(n.op_type for n in across)}" if across else ""
    return f"folded into the following {following.op_type} '{name}'{moved}"


def _path_to_layer(bn: ir.Node) -> tuple[list[ir.Node], ir.Node]:
    """``(across, layer)``: the ops of ``ACROSS`` from ``bn``'s output to the Conv / Gemm /
    MatMul that reads it as its data input, every value on the way read by that path only.

    Raises:
        CannotFuse: there is no such layer (the detail says what is there instead):
            ``shared_output`` or ``no_linear_layer``.
    """
    across, value = [], bn.outputs[0]
    while True:
        where = "its output" if not across else f"the output of {across[-1].op_type} after it"
        consumer = value_reader(value)
        if consumer is None:
            if value.is_graph_output():
                raise CannotFuse(Code.NO_LINEAR_LAYER, f"{where} is a graph output")
            raise CannotFuse(Code.SHARED_OUTPUT, f"{where} has {num_consumers(value)} consumers")
        if consumer.op_type in ACROSS and consumer.domain == "" and consumer.inputs[0] is value:
            across.append(consumer)
            value = consumer.outputs[0]
            continue
        if consumer.op_type not in ("Conv", "Gemm", "MatMul"):
            through = f" (through {', '.join(n.op_type for n in across)})" if across else ""
            raise CannotFuse(
                Code.NO_LINEAR_LAYER,
                f"its output goes to {consumer.op_type}{through}, not to an unpadded Conv, Gemm "
                "or MatMul",
            )
        if consumer.inputs[0] is not value:
            raise CannotFuse(
                Code.NO_LINEAR_LAYER, f"{where} is not the data input of {consumer.op_type}"
            )
        return across, consumer


def _carry_to_layer(
    bn: ir.Node, across: list[ir.Node], node: ir.Node, shapes: KnownShapes
) -> tuple[np.ndarray, np.ndarray]:
    """``bn``'s ``(s, t)`` carried across ``across`` to the input of ``node``, as float64
    vectors over its input channels (axis 1 of a Conv or Gemm input, the last axis of a MatMul
    input).

    Raises:
        CannotFuse: the map does not reach ``node`` as a per-input-channel map.
    """
    s, t = batchnorm_affine(bn)
    check_channels(bn, s.size, shapes)
    pool = next((op for op in across if op.op_type == "MaxPool"), None)
    if pool is not None and np.any(s <= 0):
        k = int(np.argmin(s))
        raise CannotFuse(
            Code.MAXPOOL_NEGATIVE_SCALE,
            f"MaxPool '{label(pool)}' lies between it and the {node.op_type}, and max-pool "
            "commutes with BatchNorm only when every scale gamma / sqrt(var + eps) is positive: "
            f"channel {k} has scale {s[k]:.4g}",
        )
    rank = _input_rank(bn, across, node, shapes)
    coeffs = [x.reshape((1, s.size) + (1,) * (rank - 2)) for x in (s, t)]
    for op in across:
        rank = rank_after(op, rank, shapes)
        coeffs = [move(op, c, shapes, forward=True) for c in coeffs]
    axis = rank - 1 if node.op_type == "MatMul" else 1
    for c in coeffs:
        other = next((i for i, n in enumerate(c.shape) if n != 1 and i != axis), None)
        if other is not None:
            raise CannotFuse(
                Code.WRONG_CHANNEL_AXIS,
                f"its channels reach the {node.op_type} input along axis {other}, not along "
                f"the axis of its input channels ({axis})",
            )
    return coeffs[0].reshape(-1), coeffs[1].reshape(-1)


def _input_rank(bn: ir.Node, across: list[ir.Node], node: ir.Node, shapes: KnownShapes) -> int:
    """The rank of ``bn``'s input, from its shape or else from the layer it feeds directly.

    Raises:
        CannotFuse: ``unknown_shape`` or ``no_channel_axis`` (rank < 2).
    """
    shape = shapes(bn.inputs[0])
    if shape is not None:
        rank = len(shape)
    elif not across and node.op_type in ("Conv", "Gemm"):
        weight = const_array(node.inputs[1])
        rank = 2 if node.op_type == "Gemm" or weight is None else weight.ndim
    else:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE,
            "the rank of its input is unknown: cannot tell where its channels go",
        )
    if rank < 2:
        raise CannotFuse(Code.NO_CHANNEL_AXIS, f"its input has rank {rank}: no channel axis")
    return rank


def _check_reads_map(node: ir.Node) -> None:
    """Refuse a Conv that pads its input and a Gemm with ``transA=1``: neither computes
    ``W (s x + t) + b`` from a map on its input channels.

    Raises:
        CannotFuse: ``padded_conv`` or ``gemm_trans_a``.
    """
    if node.op_type == "Conv":
        pads = node.attributes.get_ints("pads", ())
        if any(pads) or node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise CannotFuse(
                Code.PADDED_CONV,
                "the Conv after it pads its input: zero padding is applied after BatchNorm in "
                "the original, and a padded zero is not s * 0 + t",
            )
    elif node.op_type == "Gemm" and node.attributes.get_int("transA", 0):
        raise CannotFuse(
            Code.GEMM_TRANS_A, "the Gemm after it has transA=1: BatchNorm axis 1 is not its K axis"
        )


def _fold_before(
    graph: ir.Graph, node: ir.Node, s: np.ndarray, t: np.ndarray, shapes: KnownShapes
) -> None:
    """Fold ``x -> s * x + t`` into ``node``, the Conv / Gemm / MatMul that reads ``x`` as input 0.

    Args:
        s, t: float64 vectors over the input channels of ``node`` (or of size 1). The new
            weight and bias are computed in float64 and cast to the weight's dtype.

    Raises:
        CannotFuse: ``node`` cannot absorb a map applied to its input (``padded_conv``,
            ``gemm_trans_a``, ``channel_mismatch``, the codes of ``as_layer``); nothing is
            changed.
    """
    _check_reads_map(node)
    op = node.op_type
    layer = as_layer(node, shapes)
    w = layer.weight.astype(np.float64)
    dtype, hint = layer.weight.dtype, node.inputs[1].name
    bias = constant(node, 2, "bias")
    bias64 = 0.0 if bias is None else bias.astype(np.float64)
    transposed = op == "Gemm" and node.attributes.get_int("transB", 0)
    group = node.attributes.get_int("group", 1)
    if op == "Conv":  # W[o, j, k...] reads input channel group(o) * (C_in / group) + j.
        in_channels = w.shape[1] * group
    else:
        w = w.T if transposed else w  # (K, N)
        in_channels = w.shape[0]
    if s.size == 1:
        s, t = np.full(in_channels, s.item()), np.full(in_channels, t.item())
    if in_channels != s.size:
        raise CannotFuse(
            Code.CHANNEL_MISMATCH,
            f"BatchNormalization has {s.size} channels, the {op} input {in_channels}",
        )
    if op == "Conv":
        new_w, shift = _conv_input_map(w, s, t, group)
        set_input(graph, node, 2, (shift + bias64).astype(dtype), f"{hint}_bnfold_bias")
    else:
        new_w, shift = w * s[:, None], t @ w
        if transposed:
            new_w = new_w.T
    if op == "Gemm":
        alpha = node.attributes.get_float("alpha", 1.0)
        new_c = alpha * shift + node.attributes.get_float("beta", 1.0) * bias64
        node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
        set_input(graph, node, 2, np.asarray(new_c).astype(dtype), f"{hint}_bnfold_bias")
    elif op == "MatMul":
        add_to_matmul_bias(graph, node, shift, dtype)
    set_input(graph, node, 1, new_w.astype(dtype), f"{hint}_bnfold")


def _conv_input_map(
    w: np.ndarray, s: np.ndarray, t: np.ndarray, group: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(W', shift)`` for a Conv weight ``w`` ``(C_out, C_in/group, k...)`` float64 reading
    ``s * x + t`` (``s``, ``t`` ``(C_in,)``): ``W'[o, j] = W[o, j] * s[i]`` and
    ``shift[o] = sum_{j,k} W[o, j, k] * t[i]``, with ``i = group(o) * C_in/group + j``."""
    group_of = np.arange(w.shape[0]) // (w.shape[0] // group)
    taps = (1,) * (w.ndim - 2)
    s_w = s.reshape(group, -1)[group_of].reshape(w.shape[:2] + taps)
    t_w = t.reshape(group, -1)[group_of].reshape(w.shape[:2] + taps)
    return w * s_w, (w * t_w).sum(axis=tuple(range(1, w.ndim)))
