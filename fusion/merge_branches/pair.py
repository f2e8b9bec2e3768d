"""A 1x1 Conv followed by a Conv, as one Conv (DBB's transform II;
docs/fusions/merge_branches.md)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array
from fusion.merge_branches.branches import bias_of, is_conv


def is_pair(first: ir.Node, second: ir.Node) -> bool:
    """Whether ``first`` is a plain 1x1 Conv (group 1, stride 1, no padding) and ``second`` a
    Conv of group 1 and the same rank, both with constant weights."""
    if not (is_conv(first) and is_conv(second)):
        return False
    w1, w2 = const_array(first.inputs[1]), const_array(second.inputs[1])
    axes = w1.ndim - 2
    return (
        w2.ndim == w1.ndim
        and w1.shape[2:] == (1,) * axes
        and first.attributes.get_int("group", 1) == 1
        and second.attributes.get_int("group", 1) == 1
        and all(s == 1 for s in first.attributes.get_ints("strides", [1] * axes))
        and not any(first.attributes.get_ints("pads", [0] * 2 * axes))
        and first.attributes.get_string("auto_pad", "NOTSET") in ("NOTSET", "VALID")
    )


def sequential_weights(first: ir.Node, second: ir.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """The weight and bias of ``second(first(x))`` as one Conv, in ``second``'s dtype
    (``first`` and ``second`` a pair of :func:`is_pair`); None where the merge would not be
    exact (``second`` pads the output of a 1x1 whose bias is not zero) or would be slower (the
    1x1 narrows the channels): such a pair is left alone, no refusal
    (docs/fusions/merge_branches.md).
    """
    w1 = const_array(first.inputs[1]).astype(np.float64)
    w2 = const_array(second.inputs[1])
    axes = w1.ndim - 2
    b1 = bias_of(first)
    b1 = np.zeros(w1.shape[0]) if b1 is None else b1.astype(np.float64)
    auto_pad = second.attributes.get_string("auto_pad", "NOTSET")
    padded = auto_pad.startswith("SAME") or (
        auto_pad == "NOTSET" and any(second.attributes.get_ints("pads", [0] * 2 * axes))
    )
    if (padded and b1.any()) or w1.shape[1] > w1.shape[0]:
        return None
    w2_64 = w2.astype(np.float64)
    weight = np.moveaxis(np.tensordot(w2_64, w1.reshape(w1.shape[:2]), axes=([1], [0])), -1, 1)
    b2 = bias_of(second)
    spatial = tuple(range(2, w2.ndim))
    bias = (0.0 if b2 is None else b2.astype(np.float64)) + w2_64.sum(axis=spatial) @ b1
    return weight.astype(w2.dtype), np.asarray(bias).astype(w2.dtype)
