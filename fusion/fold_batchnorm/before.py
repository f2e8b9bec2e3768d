"""Fold a BatchNorm into the linear layers after it (a Conv with no padding, a Gemm with
``transA = 0``, a MatMul), across the ops of :data:`~fusion.fold_batchnorm.across.ACROSS`.
The math and the conditions: docs/fusions/fold_batchnorm.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    KnownShapes,
    const_array,
    label,
    remove_nodes,
    replace_output,
    set_input,
)
from fusion.base import CannotFuse, Code
from fusion.fold_batchnorm.across import ACROSS, MAXES, move, rank_after
from fusion.fold_batchnorm.after import add_to_matmul_bias
from fusion.fold_batchnorm.algebra import as_layer, batchnorm_affine, check_channels, constant
from fusion.fold_batchnorm.codes import BatchNormCode


def fold_into_next(graph: ir.Graph, bn: ir.Node, shapes: KnownShapes) -> str:
    """Fold the BatchNormalization ``bn`` into the Conv / Gemm / MatMul layers after it and
    remove it.

    Every reader of its output (through the ops of ``ACROSS``, which may branch: a pooled
    tensor read by two heads) must end at such a layer that can absorb the map; each of them
    does.

    Returns:
        What it became, for the report.

    Raises:
        CannotFuse: it cannot be folded into the layers after it; nothing is changed. Codes:
            ``no_linear_layer`` (no such layer), ``shared_output`` (a value on the way is also
            read by something else, or is a graph output), ``padded_conv``, ``gemm_trans_a``,
            ``maxpool_negative_scale``, ``pools_over_channels``, ``unknown_shape``,
            ``no_channel_axis``, ``wrong_channel_axis``, ``channel_mismatch``, and those of
            :func:`~fusion.fold_batchnorm.algebra.as_layer`,
            :func:`~fusion.fold_batchnorm.algebra.batchnorm_affine` and of the moves across.
    """
    s, t = batchnorm_affine(bn)
    check_channels(bn, s.size, shapes)
    paths: list[tuple[list[ir.Node], ir.Node]] = []
    _follow(bn.outputs[0], [], paths)
    # Every layer's new parameters first: a refusal at any of them changes nothing.
    updates = [
        (layer, _plan(bn, (s, t), across, layer, shapes, len(paths))) for across, layer in paths
    ]
    names = [label(layer) for _, layer in paths]  # before the fold, which may rename outputs
    for layer, (weight, bias) in updates:
        _write(graph, layer, weight, bias)
    replace_output(graph, bn.outputs[0], bn.inputs[0])
    remove_nodes(graph, [bn])
    where = [
        f"{layer.op_type} '{name}'"
        + (f" across {', '.join(n.op_type for n in ops)}" if ops else "")
        for (ops, layer), name in zip(paths, names, strict=True)
    ]
    return f"folded into the following {'; '.join(where)}"


def _plan(
    bn: ir.Node,
    st: tuple[np.ndarray, np.ndarray],
    across: list[ir.Node],
    layer: ir.Node,
    shapes: KnownShapes,
    layers: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The new parameters of ``layer`` (:func:`_absorb`) for ``bn``'s map ``st`` carried across
    ``across``; where there are several ``layers``, a refusal names the one that refused."""
    try:
        return _absorb(layer, *_carry_to_layer(bn, st, across, layer, shapes), shapes)
    except CannotFuse as refusal:
        if layers == 1:
            raise
        where = f"one of the {layers} layers it reaches, {layer.op_type} '{label(layer)}'"
        raise CannotFuse(refusal.code, f"{where}: {refusal.detail}") from None


def _follow(value: ir.Value, across: list[ir.Node], paths: list) -> None:
    """Append to ``paths`` an ``(across, layer)`` per reader of ``value``: the ops of ``ACROSS``
    from ``value`` to a Conv / Gemm / MatMul that reads it as its data input. ``across`` holds
    the ops from the BatchNorm to ``value``.

    Raises:
        CannotFuse: a reader on the way is none of those (the detail says what is there
            instead): ``no_linear_layer``, or ``shared_output`` where ``value`` has other
            readers too or is also a graph output.
    """
    where = "its output" if not across else f"the output of {across[-1].op_type} after it"
    readers = [u for u in value.uses() if u.node.op_type not in ("Shape", "Size")]
    if value.is_graph_output():
        code = Code.SHARED_OUTPUT if readers else BatchNormCode.NO_LINEAR_LAYER
        raise CannotFuse(code, f"{where} is {'also ' if readers else ''}a graph output")
    if not readers:
        raise CannotFuse(BatchNormCode.NO_LINEAR_LAYER, f"{where} is read by no layer")
    for node, index in readers:
        try:
            _follow_reader(node, index, value, across, paths)
        except CannotFuse as refusal:
            if len(readers) == 1:
                raise
            raise CannotFuse(
                Code.SHARED_OUTPUT,
                f"{where} has {len(readers)} consumers, and {node.op_type} '{label(node)}' "
                f"cannot absorb it: {refusal.detail}",
            ) from None


def _follow_reader(
    node: ir.Node, index: int, value: ir.Value, across: list[ir.Node], paths: list
) -> None:
    """One step of :func:`_follow`: ``node`` reads ``value`` as its input ``index``."""
    if node.op_type in ACROSS and node.domain == "" and index == 0:
        _follow(node.outputs[0], [*across, node], paths)
        return
    through = f" (through {', '.join(n.op_type for n in across)})" if across else ""
    if node.op_type not in ("Conv", "Gemm", "MatMul") or node.domain != "":
        raise CannotFuse(
            BatchNormCode.NO_LINEAR_LAYER,
            f"its output goes to {node.op_type}{through}, not to an unpadded Conv, Gemm or MatMul",
        )
    if index != 0:
        raise CannotFuse(
            BatchNormCode.NO_LINEAR_LAYER,
            f"its output{through} is not the data input of {node.op_type} '{label(node)}'",
        )
    paths.append((across, node))


def _carry_to_layer(
    bn: ir.Node,
    st: tuple[np.ndarray, np.ndarray],
    across: list[ir.Node],
    node: ir.Node,
    shapes: KnownShapes,
) -> tuple[np.ndarray, np.ndarray]:
    """``bn``'s map ``st``, ``(s, t)`` over its channels, carried across ``across`` to the input
    of ``node``, as float64 vectors over its input channels (axis 1 of a Conv or Gemm input,
    the last axis of a MatMul input).

    Raises:
        CannotFuse: the map does not reach ``node`` as a per-input-channel map.
    """
    s, _ = st
    pool = next((op for op in across if op.op_type in MAXES), None)
    if pool is not None and np.any(s <= 0):
        k = int(np.argmin(s))
        raise CannotFuse(
            BatchNormCode.MAXPOOL_NEGATIVE_SCALE,
            f"{pool.op_type} '{label(pool)}' lies between it and the {node.op_type}, and a max "
            "commutes with BatchNorm only when every scale gamma / sqrt(var + eps) is positive: "
            f"channel {k} has scale {s[k]:.4g}",
        )
    rank = _input_rank(bn, across, node, shapes)
    coeffs = [x.reshape((1, s.size) + (1,) * (rank - 2)) for x in st]
    for op in across:
        rank = rank_after(op, rank, shapes)
        coeffs = [move(op, c, shapes, forward=True) for c in coeffs]
    axis = rank - 1 if node.op_type == "MatMul" else 1
    for c in coeffs:
        other = next((i for i, n in enumerate(c.shape) if n != 1 and i != axis), None)
        if other is not None:
            raise CannotFuse(
                BatchNormCode.WRONG_CHANNEL_AXIS,
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
        raise CannotFuse(
            BatchNormCode.NO_CHANNEL_AXIS, f"its input has rank {rank}: no channel axis"
        )
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
                BatchNormCode.PADDED_CONV,
                "the Conv after it pads its input: zero padding is applied after BatchNorm in "
                "the original, and a padded zero is not s * 0 + t",
            )
    elif node.op_type == "Gemm" and node.attributes.get_int("transA", 0):
        raise CannotFuse(
            BatchNormCode.GEMM_TRANS_A,
            "the Gemm after it has transA=1: BatchNorm axis 1 is not its K axis",
        )


def _absorb(
    node: ir.Node, s: np.ndarray, t: np.ndarray, shapes: KnownShapes
) -> tuple[np.ndarray, np.ndarray]:
    """The new ``(weight, bias)`` of ``node``, the Conv / Gemm / MatMul that reads ``x`` as
    input 0, for it to read ``s * x + t`` instead; nothing is changed (see :func:`_write`).

    Args:
        s, t: float64 vectors over the input channels of ``node`` (or of size 1).

    Returns:
        Both float64: the weight in its layout; the Conv or Gemm bias input (for a Gemm, with
        ``alpha`` and ``beta`` applied: the new ``C`` for ``beta = 1``), or for a MatMul the
        vector to add to its output.

    Raises:
        CannotFuse: ``node`` cannot absorb a map applied to its input (``padded_conv``,
            ``gemm_trans_a``, ``channel_mismatch``, the codes of ``as_layer``).
    """
    _check_reads_map(node)
    op = node.op_type
    w = as_layer(node, shapes).weight.astype(np.float64)
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
        return new_w, shift + bias64
    new_w, shift = w * s[:, None], t @ w
    new_w = new_w.T if transposed else new_w
    if op == "Gemm":
        alpha = node.attributes.get_float("alpha", 1.0)
        return new_w, np.asarray(alpha * shift + node.attributes.get_float("beta", 1.0) * bias64)
    return new_w, shift


def _write(graph: ir.Graph, node: ir.Node, weight: np.ndarray, bias: np.ndarray) -> None:
    """Give ``node`` the parameters of :func:`_absorb`, cast to its weight's dtype (a Gemm's
    ``beta`` becomes 1; a MatMul's bias goes into the Add after it, or a new one)."""
    dtype, hint = const_array(node.inputs[1]).dtype, node.inputs[1].name
    if node.op_type == "MatMul":
        add_to_matmul_bias(graph, node, bias, dtype)
    else:
        if node.op_type == "Gemm":
            node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
        set_input(graph, node, 2, bias.astype(dtype), f"{hint}_bnfold_bias")
    set_input(graph, node, 1, weight.astype(dtype), f"{hint}_bnfold")


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
