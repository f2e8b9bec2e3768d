"""The affine algebra of the fold: BatchNorm and constant Add / Sub / Mul / Div as ``s * x + t``,
the linear layers that absorb such a map, and the checks that a map is per channel.

Every map is computed in float64. Each check raises :class:`~fusion.base.CannotFuse` with a
stable code. The math: docs/fusions/fold_batchnorm.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import KnownShapes, const_array, num_consumers, other_input, shape_text
from fusion.base import CannotFuse, Code
from fusion.fold_batchnorm.codes import BatchNormCode

#: The layers a map folds into.
LINEAR = ("Conv", "ConvTranspose", "Gemm", "MatMul")
LINEAR_NAMES = "Conv/ConvTranspose/Gemm/MatMul"
#: The elementwise ops that, with a constant operand, are an affine map.
AFFINE = ("Add", "Sub", "Mul", "Div")


def constant(node: ir.Node, index: int, what: str) -> np.ndarray | None:
    """Input ``index`` of ``node`` as an array (None when absent).

    Raises:
        CannotFuse: ``not_constant``, the input is there but is no constant.
    """
    if index >= len(node.inputs) or node.inputs[index] is None:
        return None
    array = const_array(node.inputs[index])
    if array is None:
        raise CannotFuse(
            Code.NOT_CONSTANT,
            f"{node.op_type} {what} '{node.inputs[index].name}' is not a constant: "
            "there is no fixed value to fold",
        )
    return array


@dataclasses.dataclass
class Layer:
    """A linear layer whose output channels can absorb a per-channel affine map.

    Attributes:
        node: the Conv / ConvTranspose / Gemm / MatMul node.
        weight: its constant weight (input 1), a floating-point array.
        channels: number of output channels.
        rank: rank of its output.
        axis: the channel axis of its output (1, or the last axis for MatMul).
    """

    node: ir.Node
    weight: np.ndarray
    channels: int
    rank: int
    axis: int


def as_layer(node: ir.Node, shapes: KnownShapes) -> Layer:
    """Read ``node`` (one of :data:`LINEAR`) as a foldable layer.

    Weights: Conv ``(C_out, C_in/group, k...)``, ConvTranspose ``(C_in, C_out/group, k...)``,
    Gemm ``(K, N)`` or ``(N, K)`` with ``transB``, MatMul a constant 2-D ``(K, N)``; float16,
    float32 or float64.

    Raises:
        CannotFuse: ``not_constant`` (weight or bias), ``weight_shape``, ``unknown_shape`` (a
            MatMul output of unknown rank), ``bias_shape``, ``unsupported_dtype`` (an integer
            weight).
    """
    op = node.op_type
    if op == "MatMul":
        layer = _matmul_layer(node, shapes)
    else:
        weight = constant(node, 1, "weight")
        if op == "Gemm":
            if weight.ndim != 2:
                detail = f"Gemm weight has shape {weight.shape}, not 2-D"
                raise CannotFuse(BatchNormCode.WEIGHT_SHAPE, detail)
            transposed = node.attributes.get_int("transB", 0)
            layer = Layer(node, weight, weight.shape[0 if transposed else 1], 2, 1)
        else:
            if weight.ndim < 3:
                detail = f"{op} weight has shape {weight.shape}: expected (C, C', k...)"
                raise CannotFuse(BatchNormCode.WEIGHT_SHAPE, detail)
            group = node.attributes.get_int("group", 1)
            channels = weight.shape[0] if op == "Conv" else weight.shape[1] * group
            layer = Layer(node, weight, channels, weight.ndim, 1)
        bias = constant(node, 2, "bias")
        if bias is not None and not _bias_fits(bias, op, layer.channels):
            raise CannotFuse(
                BatchNormCode.BIAS_SHAPE,
                f"{op} bias has shape {bias.shape}, which does not fit {layer.channels} output "
                "channels (ONNX Runtime rejects such a model)",
            )
    if not np.issubdtype(layer.weight.dtype, np.floating):
        raise CannotFuse(
            Code.UNSUPPORTED_DTYPE,
            f"{op} weight has dtype {layer.weight.dtype}, not a floating-point type",
        )
    return layer


def _matmul_layer(node: ir.Node, shapes: KnownShapes) -> Layer:
    """A MatMul with a constant 2-D weight as a :class:`Layer` (channels on its last axis)."""
    weight = const_array(node.inputs[1])
    if weight is None:
        raise CannotFuse(Code.NOT_CONSTANT, "MatMul has no constant weight as its second input")
    if weight.ndim != 2:
        raise CannotFuse(
            BatchNormCode.WEIGHT_SHAPE, f"MatMul weight has shape {weight.shape}, not 2-D"
        )
    shape = node.outputs[0].shape or node.inputs[0].shape or shapes(node.inputs[0])
    if shape is None:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE, "MatMul output rank is unknown: cannot tell where its channels are"
        )
    return Layer(node, weight, weight.shape[1], len(shape), len(shape) - 1)


def _bias_fits(bias: np.ndarray, op: str, channels: int) -> bool:
    """Whether a bias has the shape the op's spec allows: (C,) for Conv / ConvTranspose, and
    for Gemm anything that broadcasts to (M, C)."""
    if op != "Gemm":
        return bias.shape == (channels,)
    return bias.ndim == 0 or (bias.ndim <= 2 and bias.shape[-1] in (1, channels))


def _training_mode(node: ir.Node) -> str | None:
    """Why the BatchNormalization ``node`` runs in training mode, or None (inference mode):
    ``training_mode=1``, a statistics output that is read, or below opset 14 statistics outputs
    present (the rule and why: docs/fusions/fold_batchnorm.md)."""
    graph = node.graph
    opset = graph.opset_imports.get(node.domain, 0) if graph is not None else 0
    if node.attributes.get_int("training_mode", 0):
        return "training_mode=1"
    present = [out for out in node.outputs[1:] if out is not None and out.name]
    read = [out for out in present if num_consumers(out)]
    if read:
        names = ", ".join(f"'{out.name}'" for out in read)
        return f"its statistics output {names} is read (training mode)"
    if present and opset < 14:
        return (
            f"it has {len(node.outputs)} outputs at opset {opset}: before opset 14 that is the "
            "training-mode form (ONNX Runtime uses batch statistics even when they are unused)"
        )
    return None


def batchnorm_affine(node: ir.Node) -> tuple[np.ndarray, np.ndarray]:
    """``(s, t)``, each ``(C,)`` float64, of an inference-mode BatchNormalization:
    ``s = scale / sqrt(input_var + epsilon)``, ``t = B - input_mean * s``
    (docs/fusions/fold_batchnorm.md).

    Raises:
        CannotFuse: ``training_mode`` (also statistics outputs in use), ``spatial_zero``
            (opset < 9), ``not_constant`` or ``parameter_shape`` (parameters), or
            ``nonpositive_variance`` (``input_var + epsilon`` not positive).
    """
    training = _training_mode(node)
    if training is not None:
        raise CannotFuse(
            BatchNormCode.TRAINING_MODE,
            f"{training}: statistics come from the batch, not from constants",
        )
    if node.attributes.get_int("spatial", 1) == 0:
        raise CannotFuse(
            BatchNormCode.SPATIAL_ZERO, "spatial=0: statistics are per element, not per channel"
        )
    names = ("scale", "B", "input_mean", "input_var")
    scale, bias, mean, var = (constant(node, i + 1, what) for i, what in enumerate(names))
    shapes = {a.shape for a in (scale, bias, mean, var)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise CannotFuse(
            BatchNormCode.PARAMETER_SHAPE,
            f"parameters have shapes {sorted(shapes)}, not one (C,) shape",
        )
    epsilon = node.attributes.get_float("epsilon", 1e-5)
    denominator = var.astype(np.float64) + epsilon
    if np.any(denominator <= 0):
        raise CannotFuse(
            BatchNormCode.NONPOSITIVE_VARIANCE,
            "input_var + epsilon is not positive for every channel",
        )
    s = scale.astype(np.float64) / np.sqrt(denominator)
    return s, bias.astype(np.float64) - mean.astype(np.float64) * s


def check_channels(bn: ir.Node, channels: int, shapes: KnownShapes) -> None:
    """Refuse a BatchNormalization whose input does not have ``channels`` on axis 1: no valid
    BatchNormalization (docs/fusions/fold_batchnorm.md).

    Raises:
        CannotFuse: ``channel_mismatch``, axis 1 of the input has a known size other than
            ``channels``.
    """
    shape = shapes(bn.inputs[0])
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int) or shape[1] == channels:
        return
    raise CannotFuse(
        Code.CHANNEL_MISMATCH,
        f"it has {channels} channels, but axis 1 of its input {shape_text(shape)} has size "
        f"{shape[1]}: not a valid BatchNormalization (ONNX Runtime rejects it when it runs)",
    )


def per_channel(array: np.ndarray, layer: Layer, what: str) -> np.ndarray:
    """``array`` (on the layer output, same rank) as a ``(C,)`` float64 vector.

    Raises:
        CannotFuse: ``not_per_channel`` (``array`` varies along another axis than the
            layer's channel axis) or ``channel_mismatch`` (it has another number of channels).
    """
    op = layer.node.op_type
    for axis, size in enumerate(array.shape):
        if size != 1 and axis != layer.axis:
            raise CannotFuse(
                Code.NOT_PER_CHANNEL,
                f"{what} is not per-channel: on the {op} output (rank {layer.rank}, "
                f"{layer.channels} channels on axis {layer.axis}) it varies along axis {axis}",
            )
    if array.shape[layer.axis] not in (1, layer.channels):
        raise CannotFuse(
            Code.CHANNEL_MISMATCH,
            f"{what} has {array.shape[layer.axis]} channels, the {op} output has {layer.channels}",
        )
    return np.broadcast_to(array.astype(np.float64).reshape(-1), (layer.channels,))


def step(node: ir.Node, value: ir.Value, rank: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The map ``(a, b)`` that ``node`` applies to ``value`` (of rank ``rank``): ``a * value + b``,
    with ``a`` and ``b`` float64 of rank ``rank``, broadcast against ``value``.

    ``x / c`` is ``x * (1 / c)``; ``c - x`` is ``-1 * x + c``.

    Returns None when ``node`` is not a candidate (not BatchNorm, not an elementwise op with a
    constant operand).

    Raises:
        CannotFuse: ``node`` is a candidate that cannot be folded exactly: the codes of
            :func:`batchnorm_affine`, ``no_channel_axis``, ``unsupported_dtype``,
            ``broadcast_changes_shape``, ``not_affine`` (constant / x), ``zero_divisor``.
    """
    if node.op_type == "BatchNormalization":
        if node.inputs[0] is not value:
            return None
        s, t = batchnorm_affine(node)
        if rank < 2:
            raise CannotFuse(
                BatchNormCode.NO_CHANNEL_AXIS,
                f"BatchNormalization on a rank-{rank} input has no channel axis",
            )
        shape = (1, s.size) + (1,) * (rank - 2)
        return s.reshape(shape), t.reshape(shape)
    if node.op_type not in AFFINE:
        return None
    other = other_input(node, value)
    c = const_array(other) if other is not value else None
    if c is None:
        return None
    return _elementwise_step(node, c, node.inputs[0] is value, rank)


def _elementwise_step(
    node: ir.Node, c: np.ndarray, value_first: bool, rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """The map of an Add / Sub / Mul / Div with constant ``c`` (see :func:`step`)."""
    if not np.issubdtype(c.dtype, np.floating):
        raise CannotFuse(
            Code.UNSUPPORTED_DTYPE, f"constant has dtype {c.dtype}, not a floating-point type"
        )
    if c.ndim > rank:
        raise CannotFuse(
            Code.BROADCAST_CHANGES_SHAPE,
            f"constant of shape {c.shape} has more axes than the rank-{rank} value it applies "
            "to: broadcasting would change the output shape",
        )
    c = c.astype(np.float64).reshape((1,) * (rank - c.ndim) + c.shape)
    ones, zeros = np.ones_like(c), np.zeros_like(c)
    if node.op_type == "Add":
        return ones, c
    if node.op_type == "Mul":
        return c, zeros
    if node.op_type == "Sub":
        return (ones, -c) if value_first else (-ones, c)
    if not value_first:
        raise CannotFuse(
            BatchNormCode.NOT_AFFINE, "divides a constant by the layer output: not an affine map"
        )
    if np.any(c == 0):
        raise CannotFuse(
            BatchNormCode.ZERO_DIVISOR,
            "divides by a constant with a zero element: no exact reciprocal",
        )
    return 1.0 / c, zeros


def data_input(node: ir.Node) -> ir.Value:
    """The tensor input of a folded BatchNormalization or constant Add / Sub / Mul / Div."""
    if node.op_type == "BatchNormalization":
        return node.inputs[0]
    return next(v for v in node.inputs if const_array(v) is None)
