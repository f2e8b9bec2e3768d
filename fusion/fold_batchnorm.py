"""Fold eval-mode BatchNorm (and hand-written per-channel affine chains) into a linear layer.

The math
--------
ONNX ``BatchNormalization`` in inference mode (https://onnx.ai/onnx/operators/onnx__BatchNormalization.html,
opsets 9 to 15 alike when ``training_mode`` is 0) computes, per channel ``c`` of axis 1::

    Y = (X - input_mean) / sqrt(input_var + epsilon) * scale + B

which is a per-channel affine map ``y = s * x + t`` with::

    s = scale / sqrt(input_var + epsilon)
    t = B - input_mean * s

Constant ``Mul`` / ``Add`` / ``Sub`` / ``Div`` ops whose constant varies only along the channel
axis are affine maps of the same kind (``x / c`` is ``x * (1/c)``, exact only where no element of
``c`` is 0), and affine maps compose: ``a2 * (a1 * x + b1) + b2 = (a2 * a1) * x + (a2 * b1 + b2)``.
So a whole chain (a BatchNorm written by hand, ``(x - mean) / sqrt(var + eps) * gamma + beta``;
torchvision's FrozenBatchNorm2d ``x * scale + shift``; a Conv bias exported as a separate Add)
reduces to one ``(s, t)``.

A linear layer ``z = W x + b`` with output channel ``c`` absorbs it as ``W'[c] = s[c] * W[c]``,
``b'[c] = s[c] * b[c] + t[c]`` (a missing bias is 0). Where the channel sits in ``W``:

- Conv: ``W`` is ``(C_out, C_in/group, k...)``: scale axis 0 (any group count).
- ConvTranspose: ``W`` is ``(C_in, C_out/group, k...)``: output channel ``g * C_out/group + j``
  is ``W[g * C_in/group : (g+1) * C_in/group, j]``, so the scale goes on axis 1, per group.
- Gemm ``alpha * A @ B' + beta * C`` (``B' = B^T`` when ``transB``): scale the columns of ``B'``;
  ``C' = beta * C * s + t`` and ``beta`` becomes 1. The BatchNorm channel is axis 1 of ``(N, C)``.
- MatMul ``x @ W`` with a constant 2-D ``W``: the channel is the last axis of the output; scale
  the columns of ``W`` and add the bias with a new ``Add`` (MatMul has no bias input). A
  BatchNorm (channel axis 1) fits only when the output is 2-D.

Every new weight is computed in float64 and cast back to the weight's dtype.

A BatchNorm *before* a layer folds into it too, when every output of the layer sees only
BatchNorm outputs: ``W (s x + t) + b = (W s) x + (W t + b)``, with ``s`` on the layer's input
channel axis and ``W t`` summed over the input channels and kernel taps. That holds for a Conv
with no padding (a padded Conv pads *after* the BatchNorm in the original, and a zero there is
not ``s * 0 + t``), for a Gemm with ``transA = 0`` and for a MatMul on a 2-D input.

The graph
---------
::

    before                                     after

    x ─ Conv(W, b) ─ BatchNormalization ─ y    x ─ Conv(W', b') ─ y
    x ─ Conv(W, b) ─ Sub ─ Div ─ Mul ─ Add ─ y x ─ Conv(W', b') ─ y
    x ─ MatMul(W) ─ Add(b) ─ BatchNorm ─ y     x ─ MatMul(W') ─ Add(b') ─ y
    x ─ BatchNorm ─ Conv(W, b, pads=0) ─ y     x ─ Conv(W', b', pads=0) ─ y

Everything else is left alone and recorded in the :class:`~fusion.report.FusionReport` with
the reason: a BatchNorm after a ReLU (CREPE's conv -> ReLU -> BN -> max-pool -> pad -> conv),
a layer whose output has another consumer, a constant that is not per-channel, a division by a
constant with a zero element, a BatchNorm in training mode, a padded Conv after a BatchNorm.
Only the main graph is rewritten (not If / Loop bodies).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    add_initializer,
    const_array,
    other_input,
    remove_nodes,
    replace_output,
    sole_consumer,
)
from fusion.report import FusionReport

_LINEAR = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_LINEAR_NAMES = "Conv/ConvTranspose/Gemm/MatMul"
_AFFINE = ("Add", "Sub", "Mul", "Div")


class _Refusal(Exception):
    """A candidate that cannot be folded exactly; ``args[0]`` is the user-readable reason."""

    @property
    def reason(self) -> str:
        return self.args[0]


def _label(node: ir.Node) -> str:
    return node.name or f"{node.op_type}({node.outputs[0].name})"


def _num_consumers(value: ir.Value) -> int:
    return len(list(value.uses())) + int(value.is_graph_output())


def _constant(node: ir.Node, index: int, what: str) -> np.ndarray | None:
    """Input ``index`` of ``node`` as an array (None when absent); refuse when not a constant."""
    if index >= len(node.inputs) or node.inputs[index] is None:
        return None
    array = const_array(node.inputs[index])
    if array is None:
        raise _Refusal(
            f"{node.op_type} {what} '{node.inputs[index].name}' is not a constant: "
            "there is no fixed value to fold"
        )
    return array


@dataclasses.dataclass
class _Layer:
    """A linear layer whose output channels can absorb a per-channel affine map.

    Attributes:
        node: the Conv / ConvTranspose / Gemm / MatMul node.
        weight: its constant weight (input 1).
        channels: number of output channels.
        rank: rank of its output.
        axis: the channel axis of its output (1, or the last axis for MatMul).
    """

    node: ir.Node
    weight: np.ndarray
    channels: int
    rank: int
    axis: int


def _as_layer(node: ir.Node) -> _Layer:
    """Read ``node`` (one of :data:`_LINEAR`) as a foldable layer, or raise :class:`_Refusal`."""
    op = node.op_type
    if op == "MatMul":
        weight = const_array(node.inputs[1])
        if weight is None or weight.ndim != 2:
            raise _Refusal("MatMul has no constant 2-D weight as its second input")
        shape = node.outputs[0].shape or node.inputs[0].shape
        if shape is None:
            raise _Refusal("MatMul output rank is unknown: cannot tell where its channels are")
        layer = _Layer(node, weight, weight.shape[1], len(shape), len(shape) - 1)
    else:
        weight = _constant(node, 1, "weight")
        if op == "Gemm":
            if weight.ndim != 2:
                raise _Refusal(f"Gemm weight has shape {weight.shape}, not 2-D")
            transposed = node.attributes.get_int("transB", 0)
            layer = _Layer(node, weight, weight.shape[0 if transposed else 1], 2, 1)
        else:
            if weight.ndim < 3:
                raise _Refusal(f"{op} weight has shape {weight.shape}: expected (C, C', k...)")
            group = node.attributes.get_int("group", 1)
            channels = weight.shape[0] if op == "Conv" else weight.shape[1] * group
            layer = _Layer(node, weight, channels, weight.ndim, 1)
        bias = _constant(node, 2, "bias")
        if bias is not None and not _bias_fits(bias, op, layer.channels):
            raise _Refusal(
                f"{op} bias has shape {bias.shape}, which does not fit {layer.channels} output "
                "channels (ONNX Runtime rejects such a model)"
            )
    if not np.issubdtype(weight.dtype, np.floating):
        raise _Refusal(f"{op} weight has dtype {weight.dtype}, not a floating-point type")
    return layer


def _bias_fits(bias: np.ndarray, op: str, channels: int) -> bool:
    """Whether a bias has the shape the op's spec allows: (C,) for Conv / ConvTranspose, and
    for Gemm anything that broadcasts to (M, C)."""
    if op != "Gemm":
        return bias.shape == (channels,)
    return bias.ndim == 0 or (bias.ndim <= 2 and bias.shape[-1] in (1, channels))


def _batchnorm_affine(node: ir.Node) -> tuple[np.ndarray, np.ndarray]:
    """``(s, t)``, each ``(C,)`` float64, of an inference-mode BatchNormalization.

    Raises:
        _Refusal: training mode, statistics outputs in use, non-constant or mis-shaped
            parameters, ``spatial=0`` (opset < 9), or ``var + epsilon`` not positive.
    """
    if node.attributes.get_int("training_mode", 0):
        raise _Refusal("training_mode=1: statistics come from the batch, not from constants")
    if node.attributes.get_int("spatial", 1) == 0:
        raise _Refusal("spatial=0: statistics are per element, not per channel")
    if any(out is not None and _num_consumers(out) for out in node.outputs[1:]):
        raise _Refusal("its running-statistics outputs are used (training mode)")
    names = ("scale", "B", "input_mean", "input_var")
    scale, bias, mean, var = (_constant(node, i + 1, what) for i, what in enumerate(names))
    shapes = {a.shape for a in (scale, bias, mean, var)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise _Refusal(f"parameters have shapes {sorted(shapes)}, not one (C,) shape")
    epsilon = node.attributes.get_float("epsilon", 1e-5)
    denominator = var.astype(np.float64) + epsilon
    if np.any(denominator <= 0):
        raise _Refusal("input_var + epsilon is not positive for every channel")
    s = scale.astype(np.float64) / np.sqrt(denominator)
    return s, bias.astype(np.float64) - mean.astype(np.float64) * s


def _per_channel(array: np.ndarray, layer: _Layer) -> np.ndarray:
    """``array`` broadcast against the layer output, as a ``(C,)`` float64 vector.

    Raises:
        _Refusal: the constant would broadcast along another axis or raise the output rank.
    """
    op = layer.node.op_type
    if array.ndim > layer.rank:
        raise _Refusal(
            f"constant of shape {array.shape} has more axes than the {op} output "
            f"(rank {layer.rank}): broadcasting would change the output shape"
        )
    offset = layer.rank - array.ndim
    for i, size in enumerate(array.shape):
        if size != 1 and not (i + offset == layer.axis and size == layer.channels):
            raise _Refusal(
                f"constant of shape {array.shape} is not per-channel: on the {op} output "
                f"(rank {layer.rank}, {layer.channels} channels on axis {layer.axis}) it "
                f"varies along axis {i + offset}"
            )
    return np.broadcast_to(array.astype(np.float64).reshape(-1), (layer.channels,))


def _step(node: ir.Node, value: ir.Value, layer: _Layer) -> tuple[np.ndarray, np.ndarray] | None:
    """The per-channel map ``(a, b)`` that ``node`` applies to ``value``: ``a * value + b``.

    Returns None when ``node`` is not a candidate (not BatchNorm, not an elementwise op with a
    constant operand).

    Raises:
        _Refusal: ``node`` is a candidate that cannot be folded exactly.
    """
    ones = np.ones(layer.channels)
    if node.op_type == "BatchNormalization":
        if node.inputs[0] is not value:
            return None
        s, t = _batchnorm_affine(node)
        if layer.axis != 1:
            raise _Refusal(
                f"BatchNormalization normalizes axis 1, but the {layer.node.op_type} output "
                f"(rank {layer.rank}) has its channels on axis {layer.axis}"
            )
        if s.shape != (layer.channels,):
            raise _Refusal(
                f"BatchNormalization has {s.shape[0]} channels, the {layer.node.op_type} "
                f"output has {layer.channels}"
            )
        return s, t
    if node.op_type not in _AFFINE:
        return None
    other = other_input(node, value)
    array = const_array(other) if other is not value else None
    if array is None:
        return None
    if not np.issubdtype(array.dtype, np.floating):
        raise _Refusal(f"constant has dtype {array.dtype}, not a floating-point type")
    c = _per_channel(array, layer)
    value_first = node.inputs[0] is value
    if node.op_type == "Add":
        return ones, c
    if node.op_type == "Mul":
        return c, np.zeros_like(c)
    if node.op_type == "Sub":
        return (ones, -c) if value_first else (-ones, c)
    if not value_first:
        raise _Refusal("divides a constant by the layer output: not an affine map")
    if np.any(c == 0):
        raise _Refusal("divides by a constant with a zero element: no exact reciprocal")
    return 1.0 / c, np.zeros_like(c)


def _drop_if_unused(graph: ir.Graph, value: ir.Value | None) -> None:
    """Remove a constant (initializer or Constant node) that nothing reads any more."""
    if value is None or _num_consumers(value) or value.is_graph_input():
        return
    if value.name in graph.initializers and graph.initializers[value.name] is value:
        graph.initializers.pop(value.name)
    elif (producer := value.producer()) is not None and producer.op_type == "Constant":
        graph.remove(producer, safe=True)


def _set_input(graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, hint: str) -> None:
    """Make input ``index`` of ``node`` a new initializer holding ``array`` (adding the slot)."""
    if index >= len(node.inputs):
        node.resize_inputs(index + 1)
    old = node.inputs[index]
    node.replace_input_with(index, add_initializer(graph, hint, array))
    _drop_if_unused(graph, old)


def _unused_name(graph: ir.Graph, hint: str) -> str:
    """``hint``, or ``hint_<n>``: a value name that no input, initializer or node output has."""
    taken = {v.name for v in graph.inputs} | set(graph.initializers)
    taken |= {v.name for node in graph for v in node.outputs}
    name, n = hint, 0
    while name in taken:
        n += 1
        name = f"{hint}_{n}"
    return name


def _add_bias_after(graph: ir.Graph, matmul: ir.Node, bias: np.ndarray) -> ir.Value:
    """Insert ``Add(matmul_output, bias)``, move every reader of the MatMul onto it, return it."""
    out = matmul.outputs[0]
    add = ir.Node(
        "",
        "Add",
        [None, add_initializer(graph, f"{matmul.inputs[1].name}_bnfold_bias", bias)],
        name=f"{_label(matmul)}_bnfold_bias",
    )
    add.outputs[0].type, add.outputs[0].shape = out.type, out.shape
    graph.insert_after(matmul, add)
    name = out.name
    replace_output(graph, out, add.outputs[0])
    if out.name is None:  # it was a graph output, whose name the Add's output took
        out.name = _unused_name(graph, f"{name}_before_bias")
    add.replace_input_with(0, out)
    return add.outputs[0]


def _fold_after(graph: ir.Graph, layer: _Layer, s: np.ndarray, t: np.ndarray) -> ir.Value:
    """Rewrite ``layer`` to compute ``s * layer(x) + t``; return the value that now holds it."""
    node, w = layer.node, layer.weight
    dtype, hint = w.dtype, node.inputs[1].name
    w64 = w.astype(np.float64)
    if node.op_type == "MatMul":
        _set_input(graph, node, 1, (w64 * s).astype(dtype), f"{hint}_bnfold")
        return _add_bias_after(graph, node, t.astype(dtype))
    bias = _constant(node, 2, "bias")
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
    _set_input(graph, node, 1, new_w.astype(dtype), f"{hint}_bnfold")
    _set_input(graph, node, 2, np.asarray(new_b).astype(dtype), f"{hint}_bnfold_bias")
    return node.outputs[0]


def _fold_before(graph: ir.Graph, bn: ir.Node, node: ir.Node) -> None:
    """Fold ``bn`` into ``node``, the Conv / Gemm / MatMul that reads its output as input 0.

    Raises:
        _Refusal: ``node`` cannot absorb a BatchNorm applied to its input; nothing is changed.
    """
    s, t = _batchnorm_affine(bn)
    op = node.op_type
    if op == "Conv":
        pads = node.attributes.get_ints("pads", ())
        if any(pads) or node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise _Refusal(
                "the Conv after it pads its input: zero padding is applied after BatchNorm in "
                "the original, and a padded zero is not s * 0 + t"
            )
    elif op == "Gemm" and node.attributes.get_int("transA", 0):
        raise _Refusal("the Gemm after it has transA=1: BatchNorm axis 1 is not its K axis")
    layer = _as_layer(node)
    if op == "MatMul" and layer.rank != 2:
        raise _Refusal(f"the MatMul after it has rank-{layer.rank} input: axis 1 is not its K")
    w = layer.weight.astype(np.float64)
    dtype, hint = layer.weight.dtype, node.inputs[1].name
    bias = _constant(node, 2, "bias")
    bias64 = 0.0 if bias is None else bias.astype(np.float64)
    transposed = op == "Gemm" and node.attributes.get_int("transB", 0)
    if op == "Conv":
        # W[o, j, k...] reads input channel group(o) * (C_in / group) + j.
        group = node.attributes.get_int("group", 1)
        in_channels = w.shape[1] * group
    else:
        w = w.T if transposed else w  # (K, N)
        in_channels = w.shape[0]
    if in_channels != s.size:
        raise _Refusal(f"BatchNormalization has {s.size} channels, the {op} input {in_channels}")
    if op == "Conv":
        group_of = np.arange(w.shape[0]) // (w.shape[0] // group)
        taps = (1,) * (w.ndim - 2)
        s_w = s.reshape(group, -1)[group_of].reshape(w.shape[:2] + taps)
        t_w = t.reshape(group, -1)[group_of].reshape(w.shape[:2] + taps)
        new_w, shift = w * s_w, (w * t_w).sum(axis=tuple(range(1, w.ndim)))
        _set_input(graph, node, 2, (shift + bias64).astype(dtype), f"{hint}_bnfold_bias")
    else:
        new_w, shift = w * s[:, None], t @ w
        if transposed:
            new_w = new_w.T
    if op == "Gemm":
        alpha = node.attributes.get_float("alpha", 1.0)
        new_c = alpha * shift + node.attributes.get_float("beta", 1.0) * bias64
        node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
        _set_input(graph, node, 2, np.asarray(new_c).astype(dtype), f"{hint}_bnfold_bias")
    elif op == "MatMul":
        _add_bias_after(graph, node, shift.astype(dtype))
    _set_input(graph, node, 1, new_w.astype(dtype), f"{hint}_bnfold")
    node.replace_input_with(0, bn.inputs[0])
    remove_nodes(graph, [bn])


def _explain(value: ir.Value, stops: dict[ir.Node, str]) -> str:
    """Why the BatchNorm (or affine op) reading ``value`` has no linear layer to fold into."""
    producer = value.producer()
    if producer is None:
        return (
            f"input '{value.name}' is a graph input, not the output of {_LINEAR_NAMES}: "
            "no linear layer to fold into"
        )
    op = producer.op_type
    data = [v for v in producer.inputs if v is not None and const_array(v) is None]
    if op in _LINEAR:
        try:
            _as_layer(producer)
        except _Refusal as refusal:
            return refusal.reason
    elif op not in _AFFINE or len(data) != 1:
        return f"input comes from {op}, not from {_LINEAR_NAMES}: no linear layer to fold into"
    if value.is_graph_output():
        return f"{op} output '{value.name}' is also a graph output: folding would change it"
    if (n := _num_consumers(value)) > 1:
        return f"{op} output '{value.name}' has {n} consumers: folding would change the other one"
    if op in _LINEAR:  # a foldable layer with one reader: the walk from it stopped at `stops`
        return f"the chain after {op} '{_label(producer)}' could not be folded"
    why = stops.get(producer) or _explain(data[0], stops)
    return f"input comes from {op} '{_label(producer)}', which was not folded: {why}"


def _after_reason(value: ir.Value) -> str | None:
    """Why ``value`` (a BatchNorm output) has no layer after it to fold into; None if it has."""
    consumer = sole_consumer(value)
    if consumer is None:
        if value.is_graph_output():
            return "its output is a graph output"
        return f"its output has {_num_consumers(value)} consumers"
    if consumer.op_type not in ("Conv", "Gemm", "MatMul"):
        return f"its output goes to {consumer.op_type}, not to an unpadded Conv, Gemm or MatMul"
    if consumer.inputs[0] is not value:
        return f"its output is not the data input of {consumer.op_type}"
    return None


class FoldBatchNorm(ir.passes.InPlacePass):
    """Fold inference-mode BatchNormalization and per-channel affine chains into linear layers.

    See the module docstring for the math and the cases. Weights may be float16, float32 or
    float64; folding is computed in float64 and cast back. Graph outputs keep their names.

    Args:
        report: the shared :class:`~fusion.report.FusionReport`. Each fold adds to
            ``counts["batchnorm_folded"]``: one per BatchNormalization folded, or one for a
            hand-written affine chain with no BatchNormalization in it. Each candidate left
            alone (every BatchNormalization still in the graph, and every constant
            Mul / Add / Sub / Div after a linear layer that could not be folded) adds a
            ``refuse("batchnorm", node_name, reason)``.

    Running the pass a second time changes nothing. It raises no errors of its own: a graph it
    cannot read as foldable is left as it is and explained in the report.
    """

    def __init__(self, report: FusionReport):
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Fold in place; ``PassResult.modified`` tells whether anything was folded."""
        graph = model.graph
        stops: dict[ir.Node, str] = {}  # candidate node -> why it was not folded
        modified = False
        for node in [n for n in graph if n.op_type in _LINEAR]:
            modified |= self._fold_chain_after(graph, node, stops)
        for bn in [n for n in graph if n.op_type == "BatchNormalization"]:
            modified |= self._fold_into_next(graph, bn, stops)
        for node in graph:
            if node in stops:
                self.report.refuse("batchnorm", _label(node), stops[node])
        return ir.passes.PassResult(model, modified)

    def _fold_chain_after(self, graph: ir.Graph, node: ir.Node, stops: dict) -> bool:
        """Fold the BatchNorms and constant affine ops that follow ``node``; True if any."""
        try:
            layer = _as_layer(node)
        except _Refusal:
            return False  # explained at any BatchNorm that depends on it, by _explain
        s, t = np.ones(layer.channels), np.zeros(layer.channels)
        chain, value = [], node.outputs[0]
        while (consumer := sole_consumer(value)) is not None:
            try:
                step = _step(consumer, value, layer)
            except _Refusal as refusal:
                stops[consumer] = refusal.reason
                break
            if step is None:
                break
            a, b = step
            s, t = a * s, a * t + b
            chain.append(consumer)
            value = consumer.outputs[0]
        batchnorms = sum(n.op_type == "BatchNormalization" for n in chain)
        if not batchnorms and not any(n.op_type in ("Mul", "Div") for n in chain):
            return False  # nothing, or only bias adds: not a BatchNorm
        replace_output(graph, value, _fold_after(graph, layer, s, t))
        remove_nodes(graph, chain)
        self.report.record(
            "batchnorm_folded",
            _label(node),
            f"folded into {node.op_type} '{_label(node)}'",
            max(batchnorms, 1),
        )
        return True

    def _fold_into_next(self, graph: ir.Graph, bn: ir.Node, stops: dict) -> bool:
        """Fold ``bn`` into the layer after it, or record in ``stops`` why not; True if folded."""
        try:
            _batchnorm_affine(bn)
        except _Refusal as refusal:
            stops[bn] = refusal.reason
            return False
        after = _after_reason(bn.outputs[0])
        if after is None:
            following = bn.outputs[0].consumers()[0]
            try:
                _fold_before(graph, bn, following)
            except _Refusal as refusal:
                after = refusal.reason
            else:
                stops.pop(bn, None)
                became = f"folded into the following {following.op_type} '{_label(following)}'"
                self.report.record("batchnorm_folded", _label(bn), became)
                return True
        before = stops.get(bn) or _explain(bn.inputs[0], stops)
        stops[bn] = f"{before}; and it cannot fold into the layer after it: {after}"
        return False
