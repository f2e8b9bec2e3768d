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
torchvision's FrozenBatchNorm2d ``x * scale + shift``; a Conv or ConvTranspose bias exported as a
separate Add) reduces to one ``(s, t)``.

A linear layer ``z = W x + b`` with output channel ``c`` absorbs it as ``W'[c] = s[c] * W[c]``,
``b'[c] = s[c] * b[c] + t[c]`` (a missing bias is 0). Where the channel sits in ``W``:

- Conv: ``W`` is ``(C_out, C_in/group, k...)``: scale axis 0 (any group count).
- ConvTranspose: ``W`` is ``(C_in, C_out/group, k...)``: output channel ``g * C_out/group + j``
  is ``W[g * C_in/group : (g+1) * C_in/group, j]``, so the scale goes on axis 1, per group.
- Gemm ``alpha * A @ B' + beta * C`` (``B' = B^T`` when ``transB``): scale the columns of ``B'``;
  ``C' = beta * C * s + t`` and ``beta`` becomes 1. The BatchNorm channel is axis 1 of ``(N, C)``.
- MatMul ``x @ W`` with a constant 2-D ``W``: the channel is the last axis of the output; scale
  the columns of ``W`` and add the bias with a new ``Add`` (MatMul has no bias input).

Every new weight is computed in float64 and cast back to the weight's dtype.

A BatchNorm *before* a layer folds into it too, when every output of the layer sees only
BatchNorm outputs: ``W (s x + t) + b = (W s) x + (W t + b)``, with ``s`` on the layer's input
channel axis and ``W t`` summed over the input channels and kernel taps. That holds for a Conv
with no padding (a padded Conv pads *after* the BatchNorm in the original, and a zero there is
not ``s * 0 + t``), for a Gemm with ``transA = 0`` and for a MatMul, whose input channels are
the last axis of its input.

Ops between the layer and the BatchNorm
---------------------------------------
A per-element affine map ``s * x + t`` (``s``, ``t`` broadcast against ``x``) moves across an
op ``f`` when ``f(s * x + t) = s' * f(x) + t'`` for constants ``s'``, ``t'``:

- Transpose, Reshape, Flatten, Squeeze, Unsqueeze, Identity only move elements: ``s'`` and
  ``t'`` are ``s`` and ``t`` moved the same way (transposed; for a reshape, the axes that the
  reshape regroups must have static sizes unless the map is constant along them).
- MaxPool: ``max_i(s * x_i + t) = s * max_i(x_i) + t`` when ``s > 0`` and ``s``, ``t`` are the
  same over the pooling window (per channel). A negative scale turns the max into a min, so
  a BatchNorm with any negative scale does not move across a MaxPool (MaxPool's padding is
  ignored by the max, and its Indices output must be unused).

So ``Linear -> Transpose -> BatchNorm1d -> Transpose`` (``bn(linear(x).transpose(1, 2))
.transpose(1, 2)`` on a (B, T, C) input), ``Linear -> Reshape(-1, C) -> BatchNorm1d ->
Reshape`` and ``Conv -> MaxPool -> BatchNorm`` fold into the layer before, and CREPE's last
``BatchNorm -> MaxPool -> Transpose -> Reshape -> Linear`` folds into the classifier after it
(channel ``c`` of the BatchNorm becomes input features ``f`` with ``(f // inner) % C == c``).
After a MaxPool, the combined scale of everything folded across it must stay positive.

The graph
---------
::

    before                                     after

    x ─ Conv(W, b) ─ BatchNormalization ─ y    x ─ Conv(W', b') ─ y
    x ─ Conv(W, b) ─ Sub ─ Div ─ Mul ─ Add ─ y x ─ Conv(W', b') ─ y
    x ─ MatMul(W) ─ Add(b) ─ BatchNorm ─ y     x ─ MatMul(W') ─ Add(b') ─ y
    x ─ BatchNorm ─ Conv(W, b, pads=0) ─ y     x ─ Conv(W', b', pads=0) ─ y
    x ─ MatMul ─ Add ─ Transpose ─ BN ─ T ─ y  x ─ MatMul(W') ─ Add(b') ─ Transpose ─ T ─ y
    x ─ BN ─ MaxPool ─ Transpose ─ Reshape ─ Gemm(W, b) ─ y
                                               x ─ MaxPool ─ Transpose ─ Reshape ─ Gemm(W', b') ─ y

Everything else is left alone and recorded in the :class:`~fusion.base.FusionReport` with
the reason: a BatchNorm after a ReLU (CREPE's conv -> ReLU -> BN -> max-pool -> pad -> conv),
a layer whose output has another consumer, a constant that is not per-channel, a division by a
constant with a zero element, a BatchNorm in training mode, a padded Conv after a BatchNorm,
a MaxPool between a layer and a BatchNorm with a scale that is not positive, a reshape whose
shapes are unknown. Only the main graph is rewritten (not If / Loop bodies).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    KnownShapes,
    add_initializer,
    const_array,
    other_input,
    remove_nodes,
    replace_output,
    same_dim,
    shape_text,
    sole_consumer,
)
from fusion.base import CannotFuse, Code, FusionPass, Kind, Op

_LINEAR = ("Conv", "ConvTranspose", "Gemm", "MatMul")
_LINEAR_NAMES = "Conv/ConvTranspose/Gemm/MatMul"
_AFFINE = ("Add", "Sub", "Mul", "Div")
_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
#: Ops that a per-channel affine map moves across (module docstring): data movement, and
#: MaxPool for positive scales.
_ACROSS = ("Transpose", "Identity", "MaxPool", *_RESHAPES)


class _Refusal(CannotFuse):
    """A candidate that cannot be folded exactly (detail for the report, stable code)."""

    def __init__(self, detail: str, code: Code = Code.UNCLASSIFIED):
        super().__init__(code, detail)

    @property
    def reason(self) -> str:
        return self.detail


def _label(node: ir.Node) -> str:
    return node.name or f"{node.op_type}({node.outputs[0].name})"


def _num_consumers(value: ir.Value) -> int:
    return len(list(value.uses())) + int(value.is_graph_output())


def _value_reader(value: ir.Value) -> ir.Node | None:
    """The only node that reads the elements of ``value``, or None (several, or a graph output).

    ``Shape`` and ``Size`` read only the shape, which folding never changes: the TorchScript
    exporter writes ``x.reshape(x.shape[0], -1)`` with a ``Shape`` of ``x``.
    """
    if value.is_graph_output():
        return None
    readers = [use.node for use in value.uses() if use.node.op_type not in ("Shape", "Size")]
    return readers[0] if len(readers) == 1 else None


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


def _as_layer(node: ir.Node, shapes: KnownShapes) -> _Layer:
    """Read ``node`` (one of :data:`_LINEAR`) as a foldable layer, or raise :class:`_Refusal`."""
    op = node.op_type
    if op == "MatMul":
        weight = const_array(node.inputs[1])
        if weight is None or weight.ndim != 2:
            raise _Refusal("MatMul has no constant 2-D weight as its second input")
        shape = node.outputs[0].shape or node.inputs[0].shape or shapes(node.inputs[0])
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


def _training_mode(node: ir.Node) -> str | None:
    """Why the BatchNormalization ``node`` runs in training mode, or None (inference mode).

    From opset 14 the ``training_mode`` attribute says so. Before 14 there is no such attribute,
    and the form of the node does: a BatchNormalization with its statistics outputs (5 in all,
    Y, mean, var, saved_mean, saved_var) is the training-mode form, which ONNX Runtime runs with
    batch statistics even when the extra outputs are unused (its CPU kernel sets training mode
    from the output count below opset 14). An output named '' is absent (an empty optional
    output), and does not count. Statistics outputs that are read are refused at any opset:
    folding would remove what they hold.
    """
    graph = node.graph
    opset = graph.opset_imports.get(node.domain, 0) if graph is not None else 0
    if node.attributes.get_int("training_mode", 0):
        return "training_mode=1"
    present = [out for out in node.outputs[1:] if out is not None and out.name]
    read = [out for out in present if _num_consumers(out)]
    if read:
        names = ", ".join(f"'{out.name}'" for out in read)
        return f"its statistics output {names} is read (training mode)"
    if present and opset < 14:
        return (
            f"it has {len(node.outputs)} outputs at opset {opset}: before opset 14 that is the "
            "training-mode form (ONNX Runtime uses batch statistics even when they are unused)"
        )
    return None


def _batchnorm_affine(node: ir.Node) -> tuple[np.ndarray, np.ndarray]:
    """``(s, t)``, each ``(C,)`` float64, of an inference-mode BatchNormalization.

    Raises:
        _Refusal: training mode, statistics outputs in use, non-constant or mis-shaped
            parameters, ``spatial=0`` (opset < 9), or ``var + epsilon`` not positive.
    """
    training = _training_mode(node)
    if training is not None:
        raise _Refusal(f"{training}: statistics come from the batch, not from constants")
    if node.attributes.get_int("spatial", 1) == 0:
        raise _Refusal("spatial=0: statistics are per element, not per channel")
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


def _check_channels(bn: ir.Node, channels: int, shapes: KnownShapes) -> None:
    """Refuse a BatchNormalization whose input does not have ``channels`` on axis 1.

    ONNX requires its parameters to be ``(C,)`` with ``C`` the size of axis 1 of its input;
    ONNX Runtime stops with "Invalid input scale" when the model runs. No fold can be exact
    for a node that has no value.

    Raises:
        _Refusal: axis 1 of the input has a known size other than ``channels``.
    """
    shape = shapes(bn.inputs[0])
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int) or shape[1] == channels:
        return
    raise _Refusal(
        f"it has {channels} channels, but axis 1 of its input {shape_text(shape)} has size "
        f"{shape[1]}: not a valid BatchNormalization (ONNX Runtime rejects it when it runs)"
    )


def _squeeze_constant_axes(array: np.ndarray) -> np.ndarray:
    """``array`` with every axis along which it does not vary cut to size 1."""
    for axis, size in enumerate(array.shape):
        first = array.take([0], axis=axis)
        if size > 1 and np.array_equal(array, np.broadcast_to(first, array.shape)):
            array = first
    return array


def _reshape_map(coeff: np.ndarray, src: ir.Shape, dst: ir.Shape) -> np.ndarray | None:
    """Move ``coeff``, broadcast against a tensor of shape ``src``, to that tensor reshaped to
    ``dst`` (row-major, as ONNX Reshape / Flatten / Squeeze / Unsqueeze do).

    The leading and trailing dimensions that both shapes share are kept as they are; the middle
    ones are regrouped. That needs their sizes unless ``coeff`` is constant along them: None
    when they are not known. The middles hold the same number of elements, so one unknown
    dimension among them is that number over the others.

    Raises:
        ValueError: ``coeff`` does not broadcast against ``src``.
    """
    head = 0
    while head < min(len(src), len(dst)) and same_dim(src[head], dst[head]):
        head += 1
    tail = 0
    while tail < min(len(src), len(dst)) - head and same_dim(src[-1 - tail], dst[-1 - tail]):
        tail += 1
    middle_src, middle_dst = src.dims[head : len(src) - tail], dst.dims[head : len(dst) - tail]
    kept_head, kept_tail = coeff.shape[:head], coeff.shape[len(src) - tail :]
    if all(n == 1 for n in coeff.shape[head : len(src) - tail]):
        return coeff.reshape(kept_head + (1,) * len(middle_dst) + kept_tail)
    middle_src, middle_dst = _fill_in(middle_src, middle_dst), _fill_in(middle_dst, middle_src)
    if middle_src is None or middle_dst is None:
        return None
    full = np.broadcast_to(coeff, kept_head + middle_src + kept_tail)
    return _squeeze_constant_axes(full.reshape(kept_head + middle_dst + kept_tail))


def _fill_in(dims: tuple, other: tuple) -> tuple[int, ...] | None:
    """``dims`` as numbers, its one unknown (if any) worked out from ``other``, which holds as
    many elements; None when that cannot be done."""
    unknown = [i for i, d in enumerate(dims) if not isinstance(d, int)]
    if not unknown:
        return tuple(dims)
    known = [d for d in dims if isinstance(d, int)]
    if len(unknown) > 1 or not all(isinstance(d, int) for d in other) or 0 in known:
        return None
    filled = list(dims)
    filled[unknown[0]] = math.prod(other) // math.prod(known)
    return tuple(filled)


def _move(node: ir.Node, coeff: np.ndarray, shapes: KnownShapes, forward: bool) -> np.ndarray:
    """Carry ``coeff`` across ``node`` (one of :data:`_ACROSS`): from its input to its output
    (``forward``) or back. ``coeff`` has the rank of the side it comes from.

    Raises:
        _Refusal: the map does not move across ``node`` as a per-element map.
    """
    op = node.op_type
    if op == "MaxPool":
        if any(n != 1 for n in coeff.shape[2:]):
            raise _Refusal(
                f"MaxPool '{_label(node)}' pools over axes along which the map varies: "
                "max-pool commutes only with a map that is the same over the window"
            )
        return coeff
    if op == "Identity":
        return coeff
    if op == "Transpose":
        perm = list(node.attributes.get_ints("perm", ())) or list(range(coeff.ndim))[::-1]
        return coeff.transpose(perm if forward else np.argsort(perm))
    src, dst = shapes(node.inputs[0]), shapes(node.outputs[0])
    try:
        moved = _reshape_map(coeff, src, dst) if forward else _reshape_map(coeff, dst, src)
    except ValueError:  # np.broadcast_to: sizes that do not match the shapes
        raise _Refusal(
            f"a constant of shape {coeff.shape} does not fit the shape "
            f"{shape_text(src if forward else dst)} around {op} '{_label(node)}'"
        ) from None
    if moved is None:
        raise _Refusal(
            f"{op} '{_label(node)}' from {shape_text(src)} to {shape_text(dst)} regroups the "
            "channels across dimensions whose sizes are unknown"
        )
    return moved


def _rank_after(node: ir.Node, rank: int, shapes: KnownShapes) -> int:
    """The output rank of ``node`` (one of :data:`_ACROSS`) reading a value of rank ``rank``.

    Raises:
        _Refusal: a map cannot be carried across ``node``: its output shape (a reshape) is
            unknown, its perm does not fit, or a MaxPool's Indices output is in use.
    """
    op = node.op_type
    if op == "MaxPool" and any(out is not None and _num_consumers(out) for out in node.outputs[1:]):
        raise _Refusal(f"MaxPool '{_label(node)}' has its Indices output in use")
    if op == "Transpose":
        perm = node.attributes.get_ints("perm", ())
        if perm and len(perm) != rank:
            raise _Refusal(f"Transpose '{_label(node)}' has perm {perm} for a rank-{rank} input")
    if op in _RESHAPES:
        src, dst = shapes(node.inputs[0]), shapes(node.outputs[0])
        if src is None or dst is None:
            raise _Refusal(
                f"the {'input' if src is None else 'output'} shape of {op} '{_label(node)}' "
                "is unknown: cannot tell where the channels go"
            )
        return len(dst)
    return rank


def _per_channel(array: np.ndarray, layer: _Layer, what: str) -> np.ndarray:
    """``array`` (on the layer output, same rank) as a ``(C,)`` float64 vector.

    Raises:
        _Refusal: ``array`` varies along another axis, or has the wrong number of channels.
    """
    op = layer.node.op_type
    for axis, size in enumerate(array.shape):
        if size != 1 and axis != layer.axis:
            raise _Refusal(
                f"{what} is not per-channel: on the {op} output (rank {layer.rank}, "
                f"{layer.channels} channels on axis {layer.axis}) it varies along axis {axis}"
            )
    if array.shape[layer.axis] not in (1, layer.channels):
        raise _Refusal(
            f"{what} has {array.shape[layer.axis]} channels, the {op} output has {layer.channels}"
        )
    return np.broadcast_to(array.astype(np.float64).reshape(-1), (layer.channels,))


def _step(node: ir.Node, value: ir.Value, rank: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The map ``(a, b)`` that ``node`` applies to ``value`` (of rank ``rank``): ``a * value + b``,
    with ``a`` and ``b`` of rank ``rank``, broadcast against ``value``.

    Returns None when ``node`` is not a candidate (not BatchNorm, not an elementwise op with a
    constant operand).

    Raises:
        _Refusal: ``node`` is a candidate that cannot be folded exactly.
    """
    if node.op_type == "BatchNormalization":
        if node.inputs[0] is not value:
            return None
        s, t = _batchnorm_affine(node)
        if rank < 2:
            raise _Refusal(f"BatchNormalization on a rank-{rank} input has no channel axis")
        shape = (1, s.size) + (1,) * (rank - 2)
        return s.reshape(shape), t.reshape(shape)
    if node.op_type not in _AFFINE:
        return None
    other = other_input(node, value)
    c = const_array(other) if other is not value else None
    if c is None:
        return None
    if not np.issubdtype(c.dtype, np.floating):
        raise _Refusal(f"constant has dtype {c.dtype}, not a floating-point type")
    if c.ndim > rank:
        raise _Refusal(
            f"constant of shape {c.shape} has more axes than the rank-{rank} value it applies "
            "to: broadcasting would change the output shape"
        )
    c = c.astype(np.float64).reshape((1,) * (rank - c.ndim) + c.shape)
    ones, zeros = np.ones_like(c), np.zeros_like(c)
    value_first = node.inputs[0] is value
    if node.op_type == "Add":
        return ones, c
    if node.op_type == "Mul":
        return c, zeros
    if node.op_type == "Sub":
        return (ones, -c) if value_first else (-ones, c)
    if not value_first:
        raise _Refusal("divides a constant by the layer output: not an affine map")
    if np.any(c == 0):
        raise _Refusal("divides by a constant with a zero element: no exact reciprocal")
    return 1.0 / c, zeros


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


def _add_to_matmul_bias(graph: ir.Graph, matmul: ir.Node, shift: np.ndarray, dtype) -> None:
    """Add the float64 vector ``shift`` to the output of ``matmul``: into the constant of the
    bias ``Add`` that is the only reader of that output (a Linear layer's), else as a new Add.
    """
    out = matmul.outputs[0]
    add = sole_consumer(out)
    bias = const_array(other_input(add, out)) if add is not None and add.op_type == "Add" else None
    fits = bias is not None and bias.dtype == dtype and bias.shape[-1:] == shift.shape
    if not fits or bias.size != shift.size:  # a bias that varies along another axis, too
        _add_bias_after(graph, matmul, shift.astype(dtype))
        return
    index = 1 if add.inputs[0] is out else 0
    new_bias = (bias.astype(np.float64) + shift).reshape(bias.shape).astype(dtype)
    _set_input(graph, add, index, new_bias, f"{add.inputs[index].name}_bnfold")


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


def _fold_before(
    graph: ir.Graph, node: ir.Node, s: np.ndarray, t: np.ndarray, shapes: KnownShapes
) -> None:
    """Fold ``x -> s * x + t`` into ``node``, the Conv / Gemm / MatMul that reads ``x`` as input 0.

    Args:
        s, t: float64 vectors over the input channels of ``node`` (or of size 1).

    Raises:
        _Refusal: ``node`` cannot absorb a map applied to its input; nothing is changed.
    """
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
    layer = _as_layer(node, shapes)
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
    if s.size == 1:
        s, t = np.full(in_channels, s.item()), np.full(in_channels, t.item())
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
        _add_to_matmul_bias(graph, node, shift, dtype)
    _set_input(graph, node, 1, new_w.astype(dtype), f"{hint}_bnfold")


def _path_to_layer(bn: ir.Node) -> tuple[list[ir.Node], ir.Node]:
    """``(across, layer)``: the ops of :data:`_ACROSS` from ``bn``'s output to the Conv / Gemm /
    MatMul that reads it as its data input, every value on the way read by that path only.

    Raises:
        _Refusal: there is no such layer (the reason says what is there instead).
    """
    across, value = [], bn.outputs[0]
    while True:
        where = "its output" if not across else f"the output of {across[-1].op_type} after it"
        consumer = _value_reader(value)
        if consumer is None:
            if value.is_graph_output():
                raise _Refusal(f"{where} is a graph output")
            raise _Refusal(f"{where} has {_num_consumers(value)} consumers")
        if consumer.op_type in _ACROSS and consumer.domain == "" and consumer.inputs[0] is value:
            across.append(consumer)
            value = consumer.outputs[0]
            continue
        if consumer.op_type not in ("Conv", "Gemm", "MatMul"):
            through = f" (through {', '.join(n.op_type for n in across)})" if across else ""
            raise _Refusal(
                f"its output goes to {consumer.op_type}{through}, not to an unpadded Conv, Gemm "
                "or MatMul"
            )
        if consumer.inputs[0] is not value:
            raise _Refusal(f"{where} is not the data input of {consumer.op_type}")
        return across, consumer


def _carry_to_layer(
    bn: ir.Node, across: list[ir.Node], node: ir.Node, shapes: KnownShapes
) -> tuple[np.ndarray, np.ndarray]:
    """``bn``'s ``(s, t)`` carried across ``across`` to the input of ``node``, as vectors over
    its input channels (axis 1 of a Conv or Gemm input, the last axis of a MatMul input).

    Raises:
        _Refusal: the map does not reach ``node`` as a per-input-channel map.
    """
    s, t = _batchnorm_affine(bn)
    _check_channels(bn, s.size, shapes)
    pool = next((op for op in across if op.op_type == "MaxPool"), None)
    if pool is not None and np.any(s <= 0):
        k = int(np.argmin(s))
        raise _Refusal(
            f"MaxPool '{_label(pool)}' lies between it and the {node.op_type}, and max-pool "
            "commutes with BatchNorm only when every scale gamma / sqrt(var + eps) is positive: "
            f"channel {k} has scale {s[k]:.4g}"
        )
    shape = shapes(bn.inputs[0])
    if shape is not None:
        rank = len(shape)
    elif not across and node.op_type in ("Conv", "Gemm"):
        weight = const_array(node.inputs[1])
        rank = 2 if node.op_type == "Gemm" or weight is None else weight.ndim
    else:
        raise _Refusal("the rank of its input is unknown: cannot tell where its channels go")
    if rank < 2:
        raise _Refusal(f"its input has rank {rank}: no channel axis")
    coeffs = [x.reshape((1, s.size) + (1,) * (rank - 2)) for x in (s, t)]
    for op in across:
        rank = _rank_after(op, rank, shapes)
        coeffs = [_move(op, c, shapes, forward=True) for c in coeffs]
    axis = rank - 1 if node.op_type == "MatMul" else 1
    for c in coeffs:
        other = next((i for i, n in enumerate(c.shape) if n != 1 and i != axis), None)
        if other is not None:
            raise _Refusal(
                f"its channels reach the {node.op_type} input along axis {other}, not along "
                f"the axis of its input channels ({axis})"
            )
    return coeffs[0].reshape(-1), coeffs[1].reshape(-1)


def _data_input(node: ir.Node) -> ir.Value:
    """The tensor input of a folded BatchNormalization or constant Add / Sub / Mul / Div."""
    if node.op_type == "BatchNormalization":
        return node.inputs[0]
    return next(v for v in node.inputs if const_array(v) is None)


def _explain(value: ir.Value, stops: dict[ir.Node, str], shapes: KnownShapes) -> str:
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
            _as_layer(producer, shapes)
        except _Refusal as refusal:
            return refusal.reason
    elif op not in (*_AFFINE, *_ACROSS) or len(data) != 1:
        return f"input comes from {op}, not from {_LINEAR_NAMES}: no linear layer to fold into"
    if value.is_graph_output():
        return f"{op} output '{value.name}' is also a graph output: folding would change it"
    if (n := _num_consumers(value)) > 1:
        return f"{op} output '{value.name}' has {n} consumers: folding would change the other one"
    if op in _LINEAR:  # a foldable layer with one reader: the walk from it stopped at `stops`
        return f"the chain after {op} '{_label(producer)}' could not be folded"
    why = stops.get(producer) or _explain(data[0], stops, shapes)
    if op in _ACROSS:
        return f"input comes through {op} '{_label(producer)}': {why}"
    return f"input comes from {op} '{_label(producer)}', which was not folded: {why}"


class FoldBatchNorm(FusionPass):
    """Fold inference-mode BatchNormalization and per-channel affine chains into linear layers.

    See the module docstring for the math and the cases. Weights may be float16, float32 or
    float64; folding is computed in float64 and cast back. Graph outputs keep their names.

    Outcomes: each fold is a ``batchnorm_folded`` that counts one per BatchNormalization
    folded, or one for a hand-written per-channel affine chain with no BatchNormalization in
    it; a chain of scalar constants only is an ``affine_folded``. Each candidate left alone
    (every BatchNormalization still in the graph, and every constant Mul / Add / Sub / Div
    after a linear layer that could not be folded) is a ``batchnorm`` refusal.

    Running the pass a second time changes nothing. It raises no errors of its own: a graph it
    cannot read as foldable is left as it is and explained in the report.
    """

    kinds = (
        Kind("batchnorm_folded", "batchnorm", (Op("BatchNormalization"),)),
        Kind("affine_folded", "affine", norm=False),
    )

    def apply(self, model: ir.Model) -> bool:
        """Fold in place; return whether anything was folded."""
        graph = model.graph
        shapes = KnownShapes(model)
        stops: dict[ir.Node, str] = {}  # candidate (or op on the way) -> why it was not folded
        modified = False
        for node in [n for n in graph if n.op_type in _LINEAR]:
            modified |= self._fold_chain_after(graph, node, stops, shapes)
        for bn in [n for n in graph if n.op_type == "BatchNormalization"]:
            modified |= self._fold_into_next(graph, bn, stops, shapes)
        for node in graph:
            if node in stops and node.op_type not in _ACROSS:
                self.refused(_label(node), _Refusal(stops[node]))
        return modified

    def _fold_chain_after(
        self, graph: ir.Graph, node: ir.Node, stops: dict, shapes: KnownShapes
    ) -> bool:
        """Fold the BatchNorms and constant affine ops that follow ``node``, across the ops of
        :data:`_ACROSS`; True if any."""
        try:
            layer = _as_layer(node, shapes)
        except _Refusal:
            return False  # explained at any BatchNorm that depends on it, by _explain
        s, t = np.ones(layer.channels), np.zeros(layer.channels)
        chain, across, moved_across = [], [], []
        pools = []  # [MaxPool, combined scale of the steps folded after it]
        value, rank = node.outputs[0], layer.rank
        while (consumer := _value_reader(value)) is not None:
            try:
                if consumer.op_type in _ACROSS and consumer.domain == "":
                    if consumer.inputs[0] is not value:
                        break
                    rank = _rank_after(consumer, rank, shapes)
                    across.append(consumer)
                    if consumer.op_type == "MaxPool":
                        pools.append([consumer, np.ones(layer.channels)])
                else:
                    step = _step(consumer, value, rank)
                    if step is None:
                        break
                    a, b = self._on_layer_output(consumer, value, step, layer, across, shapes)
                    for pool in pools:
                        pool[1] = pool[1] * a
                        if np.any(pool[1] <= 0):
                            k = int(np.argmin(pool[1]))
                            raise _Refusal(
                                f"it comes after MaxPool '{_label(pool[0])}', and max-pool "
                                "commutes with a per-channel scale only when it is positive: "
                                f"folding it would scale channel {k} by {pool[1][k]:.4g}"
                            )
                    s, t = a * s, a * t + b
                    chain.append(consumer)
                    moved_across = list(across)
            except _Refusal as refusal:
                stops[consumer] = refusal.reason
                break
            value = consumer.outputs[0]
        batchnorms = sum(n.op_type == "BatchNormalization" for n in chain)
        if not batchnorms and not any(n.op_type in ("Mul", "Div") for n in chain):
            return False  # nothing, or only bias adds: not a BatchNorm
        # A BatchNorm, or one written by hand (per-channel constants); a chain of scalar
        # constants (e.g. attention's 1/sqrt(d) after a projection) folds the same way but is
        # no BatchNorm, and is counted apart so that the BatchNorm count stays honest.
        per_channel = batchnorms or any(
            c is not None and c.size > 1
            for n in chain
            if n.op_type in ("Mul", "Div", "Sub")  # the scale and the mean, not a bias Add
            for c in map(const_array, n.inputs)
        )
        _fold_after(graph, layer, s, t)
        for folded in chain:
            replace_output(graph, folded.outputs[0], _data_input(folded))
        remove_nodes(graph, chain)
        moved = f" across {', '.join(n.op_type for n in moved_across)}" if moved_across else ""
        self.fused(
            _label(node),
            f"folded into {node.op_type} '{_label(node)}'{moved}",
            kind="batchnorm_folded" if per_channel else "affine_folded",
            count=max(batchnorms, 1),
        )
        return True

    @staticmethod
    def _on_layer_output(
        node: ir.Node,
        value: ir.Value,
        step: tuple[np.ndarray, np.ndarray],
        layer: _Layer,
        across: list[ir.Node],
        shapes: KnownShapes,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``node``'s map ``step`` on ``value`` (the layer output seen through ``across``),
        carried back to the layer output as ``(C,)`` vectors.

        Raises:
            _Refusal: the map is not per-channel on the layer output.
        """
        if node.op_type == "BatchNormalization":
            _check_channels(node, step[0].size, shapes)
        moved = []
        for coeff in step:
            for op in reversed(across):
                coeff = _move(op, coeff, shapes, forward=False)
            moved.append(coeff)
        if node.op_type != "BatchNormalization":
            what = f"constant of shape {const_array(other_input(node, value)).shape}"
            return tuple(_per_channel(c, layer, what) for c in moved)
        varying = [i for i, n in enumerate(moved[0].shape) if n != 1 and i != layer.axis]
        if len(varying) == 1:
            raise _Refusal(
                f"BatchNormalization normalizes axis 1 of its input, which is axis "
                f"{varying[0]} of the {layer.node.op_type} output (rank {layer.rank}), but "
                f"that output has its channels on axis {layer.axis}"
            )
        if moved[0].shape[layer.axis] not in (1, layer.channels):
            raise _Refusal(
                f"BatchNormalization has {moved[0].shape[layer.axis]} channels, the "
                f"{layer.node.op_type} output has {layer.channels}"
            )
        return tuple(_per_channel(c, layer, "BatchNormalization") for c in moved)

    def _fold_into_next(
        self, graph: ir.Graph, bn: ir.Node, stops: dict, shapes: KnownShapes
    ) -> bool:
        """Fold ``bn`` into the layer after it, or record in ``stops`` why not; True if folded."""
        try:
            _batchnorm_affine(bn)
        except _Refusal as refusal:
            stops[bn] = refusal.reason
            return False
        try:
            across, following = _path_to_layer(bn)
            s, t = _carry_to_layer(bn, across, following, shapes)
            _fold_before(graph, following, s, t, shapes)
        except _Refusal as refusal:
            after = refusal.reason
        else:
            replace_output(graph, bn.outputs[0], bn.inputs[0])
            remove_nodes(graph, [bn])
            stops.pop(bn, None)
            moved = f" across {', '.join(n.op_type for n in across)}" if across else ""
            became = f"folded into the following {following.op_type} '{_label(following)}'{moved}"
            self.fused(_label(bn), became)
            return True
        before = stops.get(bn) or _explain(bn.inputs[0], stops, shapes)
        stops[bn] = f"{before}; and it cannot fold into the layer after it: {after}"
        return False
