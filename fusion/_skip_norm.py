"""The conditions on the norm that :class:`fusion.fuse_skip.FuseSkip` fuses with the residual
``Add`` before it: what ONNX Runtime's Skip*LayerNormalization kernels take (the list and its
sources: docs/fusions/fuse_skip.md).
"""

from __future__ import annotations

import enum

import onnx_ir as ir

from fusion._ir import KnownShapes, same_dim, shape_text
from fusion.base import CannotFuse, Code


class SkipCode(enum.StrEnum):
    """Why FuseSkip left a candidate alone, besides the codes every pass shares
    (:class:`fusion.base.Code`)."""

    #: A Cast between the residual Add and the norm (the Skip op would add in another type).
    CAST_BETWEEN = "cast_between"
    #: The model imports com.microsoft at a version other than the Skip ops' 1.
    MS_OPSET_VERSION = "ms_opset_version"
    #: The norm's mean / inverse-std outputs are read (the Skip kernels do not compute them).
    STATS_OUTPUTS_USED = "stats_outputs_used"
    #: The norm normalizes more than the last axis.
    NOT_LAST_AXIS = "not_last_axis"
    #: A float16 norm with stash_type=0 (statistics in float16; the Skip op uses float32).
    STASH_TYPE_ZERO = "stash_type_zero"
    #: epsilon < 0, which the Skip kernels reject.
    NEGATIVE_EPSILON = "negative_epsilon"
    #: The norm's scale or bias has a type other than the data's.
    PARAM_DTYPE = "param_dtype"
    #: The norm's scale or bias is not a 1-D vector as long as the last axis.
    PARAM_SHAPE = "param_shape"


_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


def check_norm(norm: ir.Node, shapes: KnownShapes) -> None:
    """Check that ``norm`` normalizes the last axis, in a type and shape the Skip op takes.

    Raises:
        CannotFuse: ``stats_outputs_used``, ``unknown_shape`` (the input's rank),
            ``not_last_axis``, ``unsupported_dtype``, ``stash_type_zero``,
            ``negative_epsilon``, or those of :func:`_check_params`.
    """
    op = norm.op_type
    if any(out is not None and (out.uses() or out.is_graph_output()) for out in norm.outputs[1:]):
        raise CannotFuse(
            SkipCode.STATS_OUTPUTS_USED,
            f"{op}'s statistics outputs are in use: the Skip op does not compute them",
        )
    shape = shapes(norm.inputs[0])
    if shape is None:
        raise CannotFuse(Code.UNKNOWN_SHAPE, f"the rank of the {op} input is unknown")
    axis = norm.attributes.get_int("axis", -1)
    if axis % len(shape) != len(shape) - 1:
        raise CannotFuse(
            SkipCode.NOT_LAST_AXIS,
            f"{op} normalizes axes {axis % len(shape)}..{len(shape) - 1} of a rank-{len(shape)} "
            "input: the Skip op normalizes the last axis only",
        )
    dtype = shapes.dtype(norm.inputs[0])
    if dtype not in _DTYPES:
        raise CannotFuse(
            Code.UNSUPPORTED_DTYPE,
            f"the data type is {dtype.name if dtype else 'unknown'}: ORT's Skip kernels take "
            "float32 and float16",
        )
    if dtype == ir.DataType.FLOAT16 and norm.attributes.get_int("stash_type", 1) != 1:
        raise CannotFuse(
            SkipCode.STASH_TYPE_ZERO,
            f"{op} has stash_type=0 (statistics in float16): the Skip op computes them in float32",
        )
    if norm.attributes.get_float("epsilon", 1e-5) < 0:
        raise CannotFuse(
            SkipCode.NEGATIVE_EPSILON,
            "epsilon is negative: ORT's Skip kernels require epsilon >= 0",
        )
    _check_params(norm, shape, dtype, shapes)


def _check_params(norm: ir.Node, shape: ir.Shape, dtype: ir.DataType, shapes: KnownShapes) -> None:
    """Check that the norm's scale and bias are 1-D of length ``shape[-1]`` and of ``dtype``.

    Raises:
        CannotFuse: ``param_dtype`` or ``param_shape``.
    """
    op = norm.op_type
    for index, what in ((1, "scale"), (2, "bias")):
        if index >= len(norm.inputs) or norm.inputs[index] is None:
            continue
        param = norm.inputs[index]
        param_shape = shapes(param)
        if shapes.dtype(param) != dtype:
            raise CannotFuse(
                SkipCode.PARAM_DTYPE,
                f"{op} {what} has type {shapes.dtype(param)}, not the data type {dtype.name}: "
                "the Skip op takes one type",
            )
        if param_shape is None or len(param_shape) != 1 or not same_dim(param_shape[0], shape[-1]):
            got = "an unknown shape" if param_shape is None else f"shape {shape_text(param_shape)}"
            raise CannotFuse(
                SkipCode.PARAM_SHAPE,
                f"{op} {what} has {got}: the Skip op takes a 1-D vector as long as the last "
                f"axis of the input {shape_text(shape)}",
            )
