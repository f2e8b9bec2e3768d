"""Fold the BatchNorms and constant affine ops after a linear layer into that layer: the walk down
the layer's readers, across the ops of :data:`~fusion.fold_batchnorm.across.ACROSS`, composing
one ``(s, t)`` over its output channels. The math: docs/fusions/fold_batchnorm.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    KnownShapes,
    add_initializer,
    const_array,
    label,
    num_consumers,
    other_input,
    remove_nodes,
    replace_output,
    set_input,
    sole_consumer,
    unused_name,
    value_reader,
)
from fusion.base import CannotFuse, Code
from fusion.fold_batchnorm.across import ACROSS, MAXES, move, rank_after
from fusion.fold_batchnorm.algebra import (
    AFFINE,
    LINEAR,
    LINEAR_NAMES,
    Layer,
    as_layer,
    check_channels,
    constant,
    data_input,
    per_channel,
    step,
)
from fusion.fold_batchnorm.codes import BatchNormCode


class Folded(NamedTuple):
    """One fold, for :meth:`fusion.base.FusionPass.fused`: the anchor's name (before the
    rewrite), the kind of rewrite, what it became, and how many BatchNorms it removed."""

    node: str
    kind: str
    became: str
    count: int


@dataclasses.dataclass
class _Walk:
    """Where a walk down the readers of a layer's output has got to.

    Attributes:
        layer: the layer the map folds into.
        rank: the rank of the value reached.
        s, t: ``(C,)`` float64, the composed map ``s * layer(x) + t`` of the nodes folded.
        chain: the nodes folded, in order.
        across: the ops of ``ACROSS`` passed.
        moved_across: the ops of ``across`` before the last node folded.
        pools: ``[op, combined scale of the nodes folded after it]`` per max (MaxPool,
            GlobalMaxPool, ReduceMax) passed.
    """

    layer: Layer
    rank: int
    s: np.ndarray
    t: np.ndarray
    chain: list[ir.Node] = dataclasses.field(default_factory=list)
    across: list[ir.Node] = dataclasses.field(default_factory=list)
    moved_across: list[ir.Node] = dataclasses.field(default_factory=list)
    pools: list[list] = dataclasses.field(default_factory=list)


def fold_chain_after(
    graph: ir.Graph, node: ir.Node, stops: dict[ir.Node, CannotFuse], shapes: KnownShapes
) -> Folded | None:
    """Fold the BatchNorms and constant affine ops that follow ``node`` (any op), across the ops
    of ``ACROSS``, into it.

    Records in ``stops`` the node where the walk met a candidate it could not fold, and why.

    Returns:
        The fold, or None when nothing was folded (``node`` is no foldable layer, or only bias
        Adds follow it).
    """
    try:
        layer = as_layer(node, shapes)
    except CannotFuse:
        return None  # explained at any BatchNorm that depends on it, by explain()
    walk = _walk(layer, stops, shapes)
    kind = _kind(walk.chain)
    if kind is None:
        return None
    name = label(node)
    fold_after(graph, layer, walk.s, walk.t)
    for folded in walk.chain:
        replace_output(graph, folded.outputs[0], data_input(folded))
    remove_nodes(graph, walk.chain)
    moved = ", ".join(n.op_type for n in walk.moved_across)
    moved = f" across {moved}" if moved else ""
    return Folded(name, kind[0], f"folded into {node.op_type} '{name}'{moved}", kind[1])


def chain_after(
    node: ir.Node, stops: dict[ir.Node, CannotFuse], shapes: KnownShapes
) -> list[ir.Node]:
    """The nodes :func:`fold_chain_after` would fold into ``node``, the graph left as it is."""
    try:
        layer = as_layer(node, shapes)
    except CannotFuse:
        return []
    return _walk(layer, stops, shapes).chain


def _walk(layer: Layer, stops: dict[ir.Node, CannotFuse], shapes: KnownShapes) -> _Walk:
    """Follow the one reader of each value from the layer output while it can be folded.

    The node it stops at goes into ``stops`` where it is a candidate: a BatchNorm, a scale (Mul,
    Div) or a shift after one (:func:`_scales`); a shift alone is none (:func:`_kind`)."""
    channels = layer.channels
    walk = _Walk(layer, layer.rank, np.ones(channels), np.zeros(channels))
    value = layer.node.outputs[0]
    while (reader := value_reader(value)) is not None:
        try:
            if not _take(walk, reader, value, shapes):
                break
        except CannotFuse as refusal:
            if _scales([*walk.chain, reader]):  # else a bias or an embedding: no candidate
                stops[reader] = refusal
            break
        value = reader.outputs[0]
    return walk


def _take(walk: _Walk, node: ir.Node, value: ir.Value, shapes: KnownShapes) -> bool:
    """Pass or fold ``node``, the reader of ``value``; False when the walk ends before it.

    Raises:
        CannotFuse: ``node`` is a candidate that cannot be folded.
    """
    if node.op_type in ACROSS and node.domain == "":
        if node.inputs[0] is not value:
            return False
        walk.rank = rank_after(node, walk.rank, shapes)
        walk.across.append(node)
        if node.op_type in MAXES:
            walk.pools.append([node, np.ones(walk.layer.channels)])
        return True
    found = step(node, value, walk.rank)
    if found is None:
        return False
    a, b = on_layer_output(node, value, found, walk.layer, walk.across, shapes)
    _check_pools(walk.pools, a)
    walk.s, walk.t = a * walk.s, a * walk.t + b
    walk.chain.append(node)
    walk.moved_across = list(walk.across)
    return True


def _check_pools(pools: list[list], a: np.ndarray) -> None:
    """Compose the scale ``a`` into each MaxPool's scale; refuse one that is not positive.

    Raises:
        CannotFuse: ``maxpool_negative_scale``.
    """
    for pool in pools:
        pool[1] = pool[1] * a
        if np.any(pool[1] <= 0):
            k = int(np.argmin(pool[1]))
            raise CannotFuse(
                BatchNormCode.MAXPOOL_NEGATIVE_SCALE,
                f"it comes after {pool[0].op_type} '{label(pool[0])}', and a max commutes with a "
                "per-channel scale only when it is positive: folding it would scale channel "
                f"{k} by {pool[1][k]:.4g}",
            )


def _kind(chain: list[ir.Node]) -> tuple[str, int] | None:
    """``(kind, count)`` of a fold of ``chain``, or None when it is no fold worth making.

    A chain with BatchNormalization nodes is a ``batchnorm_folded`` that counts them; a chain
    without, a ``batchnorm_folded`` of 1 when it is a BatchNorm written by hand
    (:func:`_hand_written_batchnorm`), else an ``affine_folded`` of 1; shifts alone (bias Adds)
    are nothing (:func:`_scales`). The rule: docs/fusions/fold_batchnorm.md.
    """
    if not _scales(chain):
        return None
    batchnorms = sum(n.op_type == "BatchNormalization" for n in chain)
    if batchnorms:
        return "batchnorm_folded", batchnorms
    return ("batchnorm_folded" if _hand_written_batchnorm(chain) else "affine_folded"), 1


def _scales(chain: list[ir.Node]) -> bool:
    """Whether ``chain`` (BatchNorms and constant Add / Sub / Mul / Div) scales: a BatchNorm, a
    Mul or a Div in it. A chain that only shifts is a bias (or an embedding), no norm."""
    return any(n.op_type in ("BatchNormalization", "Mul", "Div") for n in chain)


def _hand_written_batchnorm(chain: list[ir.Node]) -> bool:
    """Whether a chain of constant Add / Sub / Mul / Div is a BatchNorm written by hand.

    It is when it scales per channel and subtracts a per-channel constant anywhere in the chain,
    or adds or subtracts one after the scale; a per-channel scale alone is a layer scale (the
    rule: docs/fusions/fold_batchnorm.md).
    """
    scaled = shifted = False
    for node in chain:
        if not any(c is not None and c.size > 1 for c in map(const_array, node.inputs)):
            continue
        if node.op_type in ("Mul", "Div"):
            scaled = True
        elif node.op_type == "Sub" or (node.op_type == "Add" and scaled):
            shifted = True
    return scaled and shifted


def on_layer_output(
    node: ir.Node,
    value: ir.Value,
    found: tuple[np.ndarray, np.ndarray],
    layer: Layer,
    across: list[ir.Node],
    shapes: KnownShapes,
) -> tuple[np.ndarray, np.ndarray]:
    """``node``'s map ``found`` on ``value`` (the layer output seen through ``across``),
    carried back to the layer output as ``(C,)`` float64 vectors.

    Raises:
        CannotFuse: the map is not per-channel on the layer output (``not_per_channel``,
            ``wrong_channel_axis``, ``channel_mismatch``), or does not move back across
            ``across`` (the codes of :func:`~fusion.fold_batchnorm.across.move`).
    """
    if node.op_type == "BatchNormalization":
        check_channels(node, found[0].size, shapes)
    moved = []
    for coeff in found:
        for op in reversed(across):
            coeff = move(op, coeff, shapes, forward=False)
        moved.append(coeff)
    if node.op_type != "BatchNormalization":
        what = f"constant of shape {const_array(other_input(node, value)).shape}"
        return tuple(per_channel(c, layer, what) for c in moved)
    varying = [i for i, n in enumerate(moved[0].shape) if n != 1 and i != layer.axis]
    if len(varying) == 1:
        raise CannotFuse(
            BatchNormCode.WRONG_CHANNEL_AXIS,
            f"BatchNormalization normalizes axis 1 of its input, which is axis "
            f"{varying[0]} of the {layer.node.op_type} output (rank {layer.rank}), but "
            f"that output has its channels on axis {layer.axis}",
        )
    if moved[0].shape[layer.axis] not in (1, layer.channels):
        raise CannotFuse(
            Code.CHANNEL_MISMATCH,
            f"BatchNormalization has {moved[0].shape[layer.axis]} channels, the "
            f"{layer.node.op_type} output has {layer.channels}",
        )
    return tuple(per_channel(c, layer, "BatchNormalization") for c in moved)


def fold_after(graph: ir.Graph, layer: Layer, s: np.ndarray, t: np.ndarray) -> ir.Value:
    """Rewrite ``layer`` to compute ``s * layer(x) + t``; return the value that now holds it.

    Args:
        s, t: ``(C,)`` float64 over the layer's output channels. The new weight and bias are
            computed in float64 and cast to the weight's dtype.
    """
    node, w = layer.node, layer.weight
    dtype, hint = w.dtype, node.inputs[1].name
    w64 = w.astype(np.float64)
    if node.op_type == "MatMul":
        set_input(graph, node, 1, (w64 * s).astype(dtype), f"{hint}_bnfold")
        return _add_bias_after(graph, node, t.astype(dtype))
    bias = constant(node, 2, "bias")
    bias64 = 0.0 if bias is None else bias.astype(np.float64)
    if node.op_type == "Gemm":
        transposed = node.attributes.get_int("transB", 0)
        new_w = w64 * (s[:, None] if transposed else s[None, :])
        new_b = node.attributes.get_float("beta", 1.0) * bias64 * s + t
        node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
    elif node.op_type == "Conv":
        new_w = w64 * s.reshape((-1,) + (1,) * (w.ndim - 1))
        new_b = s * bias64 + t
    else:  # ConvTranspose: (C_in, C_out/group, k...), output channel g * C_out/group + j
        group = node.attributes.get_int("group", 1)
        grouped = w64.reshape((group, w.shape[0] // group) + w.shape[1:])
        per_group = s.reshape((group, 1, w.shape[1]) + (1,) * (w.ndim - 2))
        new_w = (grouped * per_group).reshape(w.shape)
        new_b = s * bias64 + t
    set_input(graph, node, 1, new_w.astype(dtype), f"{hint}_bnfold")
    set_input(graph, node, 2, np.asarray(new_b).astype(dtype), f"{hint}_bnfold_bias")
    return node.outputs[0]


def _add_bias_after(graph: ir.Graph, matmul: ir.Node, bias: np.ndarray) -> ir.Value:
    """Insert ``Add(matmul_output, bias)``, move every reader of the MatMul onto it, return it."""
    out = matmul.outputs[0]
    add = ir.Node(
        "",
        "Add",
        [None, add_initializer(graph, f"{matmul.inputs[1].name}_bnfold_bias", bias)],
        name=f"{label(matmul)}_bnfold_bias",
    )
    add.outputs[0].type, add.outputs[0].shape = out.type, out.shape
    graph.insert_after(matmul, add)
    name = out.name
    replace_output(graph, out, add.outputs[0])
    if out.name is None:  # it was a graph output, whose name the Add's output took
        out.name = unused_name(graph, f"{name}_before_bias")
    add.replace_input_with(0, out)
    return add.outputs[0]


def add_to_matmul_bias(graph: ir.Graph, matmul: ir.Node, shift: np.ndarray, dtype) -> None:
    """Add the float64 vector ``shift`` (over the MatMul's output columns) to the output of
    ``matmul``: into the constant of the bias ``Add`` that is the only reader of that output (a
    Linear layer's), else as a new Add. The bias keeps ``dtype``."""
    out = matmul.outputs[0]
    add = sole_consumer(out)
    bias = const_array(other_input(add, out)) if add is not None and add.op_type == "Add" else None
    fits = bias is not None and bias.dtype == dtype and bias.shape[-1:] == shift.shape
    if not fits or bias.size != shift.size:  # a bias that varies along another axis, too
        _add_bias_after(graph, matmul, shift.astype(dtype))
        return
    index = 1 if add.inputs[0] is out else 0
    new_bias = (bias.astype(np.float64) + shift).reshape(bias.shape).astype(dtype)
    set_input(graph, add, index, new_bias, f"{add.inputs[index].name}_bnfold")


def explain(value: ir.Value, stops: dict[ir.Node, CannotFuse], shapes: KnownShapes) -> CannotFuse:
    """Why the BatchNorm (or affine op) reading ``value`` has no linear layer to fold into.

    The code is that of the first obstacle: ``no_linear_layer`` (a graph input or another op
    where the layer would be), ``shared_output`` (a value on the way read elsewhere too), the
    layer's own refusal (:func:`~fusion.fold_batchnorm.algebra.as_layer`), or the refusal
    recorded in ``stops`` for an op on the way.
    """
    producer = value.producer()
    if producer is None:
        return CannotFuse(
            BatchNormCode.NO_LINEAR_LAYER,
            f"input '{value.name}' is a graph input, not the output of {LINEAR_NAMES}: "
            "no linear layer to fold into",
        )
    op = producer.op_type
    data = [v for v in producer.inputs if v is not None and const_array(v) is None]
    if op in LINEAR:
        try:
            as_layer(producer, shapes)
        except CannotFuse as refusal:
            return refusal
    elif op not in (*AFFINE, *ACROSS) or len(data) != 1:
        return CannotFuse(
            BatchNormCode.NO_LINEAR_LAYER,
            f"input comes from {op}, not from {LINEAR_NAMES}: no linear layer to fold into",
        )
    shared = _shared(op, value)
    if shared is not None:
        return shared
    if op in LINEAR:  # a foldable layer with one reader: the walk from it stopped at `stops`
        return CannotFuse(
            BatchNormCode.CHAIN_NOT_FOLDED,
            f"the chain after {op} '{label(producer)}' could not be folded",
        )
    why = stops.get(producer) or explain(data[0], stops, shapes)
    if op in ACROSS:
        return CannotFuse(why.code, f"input comes through {op} '{label(producer)}': {why.detail}")
    return CannotFuse(
        why.code, f"input comes from {op} '{label(producer)}', which was not folded: {why.detail}"
    )


def _shared(op: str, value: ir.Value) -> CannotFuse | None:
    """A ``shared_output`` refusal when ``value`` (the output of ``op``) is read elsewhere too."""
    if value.is_graph_output():
        return CannotFuse(
            Code.SHARED_OUTPUT,
            f"{op} output '{value.name}' is also a graph output: folding would change it",
        )
    if (n := num_consumers(value)) > 1:
        return CannotFuse(
            Code.SHARED_OUTPUT,
            f"{op} output '{value.name}' has {n} consumers: folding would change the other one",
        )
    return None
