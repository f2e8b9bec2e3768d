"""The constants that scale the scores of :mod:`fusion.fuse_sdpa`'s attention besides the one
number on them: a number on ``Q`` or on ``K^T`` (:func:`unscaled`), one number per head on the
scores (:func:`per_head`). See docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import producer, scalar_const
from fusion.base import CannotFuse
from fusion.fuse_gqa import parts
from fusion.fuse_sdpa.codes import SDPACode


def unscaled(value: ir.Value) -> tuple[ir.Value, float, list[ir.Node]]:
    """``(x, c, nodes)`` for ``value = x * c`` (:func:`fusion.fuse_gqa.parts.scaled`), also
    where ``c`` is ``CastLike(constant, x)`` (torch's decomposition of
    ``scaled_dot_product_attention`` at the dynamo exporter's default opset)."""
    factor, nodes = 1.0, []
    while True:
        value, found, more = parts.scaled(value)
        factor, nodes = factor * found, nodes + more
        mul = producer(value, "Mul")
        consts = [_cast_constant(v) for v in mul.inputs] if mul is not None else []
        index = next((i for i, c in enumerate(consts) if c is not None), None)
        if index is None:
            return value, factor, nodes
        factor *= consts[index]
        nodes += [mul, mul.inputs[index].producer()]
        value = mul.inputs[1 - index]


def _cast_constant(value: ir.Value | None) -> float | None:
    """The number ``CastLike(c, x)`` is, for a one-element constant ``c`` and a float32
    ``x``; None for anything else."""
    cast = producer(value, "CastLike")
    if cast is None or value.dtype != ir.DataType.FLOAT:
        return None
    number = scalar_const(cast.inputs[0])
    return None if number is None else float(np.float32(number))


def per_head(node: ir.Node, scale: np.ndarray, scores: list | None) -> np.ndarray:
    """``scale``, a constant of several values that ``node`` multiplies the scores (of dims
    ``scores``) by, where it is one number per head: 1 in every axis but the heads' (the third
    from last: a 4-D attention's heads, a 3-D one's batch times heads), there as many as the
    scores have. Such a scale moves into ``Q`` (:func:`.build.rewrite`; docs/fusions/fuse_sdpa.md).

    Raises:
        CannotFuse: ``scale_not_scalar``: it varies along another axis, or broadcasts the
            scores; ``scale_not_positive``: a value is not finite.
    """
    shape, rank = scale.shape, len(scores or ())
    if not (3 <= len(shape) <= rank and shape[-3] == scale.size and shape[-3] == scores[-3]):
        raise CannotFuse(
            SDPACode.SCALE_NOT_SCALAR,
            f"{node.name!r} scales the scores by a constant of shape {list(shape)}, not one "
            "number per head: Attention's scale is one number",
        )
    if not np.isfinite(scale).all():
        raise CannotFuse(
            SDPACode.SCALE_NOT_POSITIVE, f"{node.name!r}: a head's scale is not finite"
        )
    return scale
