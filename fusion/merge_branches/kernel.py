"""The merged Conv of a sum of branches: its window on one tap grid, its weight and bias
(docs/fusions/merge_branches.md)."""

from __future__ import annotations

import dataclasses
import math
from functools import reduce

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array, label
from fusion.base import CannotFuse, Code
from fusion.fold_batchnorm.algebra import batchnorm_affine
from fusion.merge_branches.branches import Branch, Sum, bias_of
from fusion.merge_branches.codes import ReparamCode


@dataclasses.dataclass
class Geometry:
    """A Conv branch's window along each spatial axis (an identity: a 1-tap window).

    Attributes:
        kernel, dilation, begin, end, stride: per spatial axis (``begin`` / ``end``: pads).
    """

    kernel: tuple[int, ...]
    dilation: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)

    @property
    def extent(self) -> tuple[int, ...]:
        """``pad_begin + pad_end - dilation * (kernel - 1)`` per axis: equal extents give equal
        output sizes for every input size."""
        return tuple(
            b + e - d * (k - 1)
            for b, e, d, k in zip(self.begin, self.end, self.dilation, self.kernel, strict=True)
        )


@dataclasses.dataclass
class Plan:
    """The merged Conv: which branch's node becomes it, its weight, bias and window."""

    main: ir.Node
    weight: np.ndarray
    bias: np.ndarray
    geometry: Geometry
    counts: dict[str, int]


def merged_conv(found: Sum) -> Plan:
    """The merged Conv of ``found`` (the conditions: docs/fusions/merge_branches.md).

    Raises:
        CannotFuse: the branches cannot be one Conv exactly, or the merge would be slower.
    """
    convs = [b for b in found.branches if b.node is not None and b.node.op_type == "Conv"]
    weights = [const_array(b.node.inputs[1]).astype(np.float64) for b in convs]
    groups = {b.node.attributes.get_int("group", 1) for b in convs}
    shapes = {w.shape[:2] for w in weights}
    ranks = {w.ndim for w in weights}
    if len(groups) != 1 or len(shapes) != 1 or len(ranks) != 1:
        raise CannotFuse(
            ReparamCode.GROUP_MISMATCH,
            f"the Conv branches differ in group ({sorted(groups)}) or channels "
            f"({sorted(shapes)}): no one Conv computes their sum",
        )
    (group,), ((c_out, c_group),), (rank,) = groups, shapes, ranks
    c_in = c_group * group
    axes = rank - 2
    geometries = {
        id(b): _geometry(b.node, w.shape[2:]) for b, w in zip(convs, weights, strict=True)
    }
    others = [b for b in found.branches if b.node is None or b.node.op_type != "Conv"]
    if others and c_in != c_out:
        raise CannotFuse(
            ReparamCode.GROUP_MISMATCH,
            f"an identity or BatchNorm branch beside Convs of {c_in} input and {c_out} output "
            "channels: the identity maps a channel to itself",
        )
    for b in others:
        geometries[id(b)] = Geometry((1,) * axes, (1,) * axes, (0,) * axes, (0,) * axes, None)
    stride = _stride(convs, geometries, bool(others), axes)
    target = _target(list(geometries.values()), stride)
    taps = sum(g.taps for g in geometries.values())
    if target.taps > taps:
        raise CannotFuse(
            ReparamCode.MORE_WORK,
            f"the merged kernel {'x'.join(map(str, target.kernel))} has {target.taps} taps, the "
            f"branches {taps} together: one Conv would do more multiply-adds than they do",
        )
    weight = np.zeros((c_out, c_group, *target.kernel))
    bias = np.zeros(c_out)
    for branch in found.branches:
        coef = branch.sign * _product(branch.factors, c_out, rank)
        kernel, shift = _branch_kernel(branch, c_out, c_group, axes)
        index = _placement(geometries[id(branch)], target)
        weight[(slice(None), slice(None), *index)] += coef.reshape(-1, 1, *[1] * axes) * kernel
        bias += coef * shift
    for sign, factors, constant in found.constants:
        bias += sign * _product(factors, c_out, rank) * _vector(constant, c_out, rank)
    main = max(convs, key=lambda b: geometries[id(b)].taps).node
    counts = {
        "Conv": len(convs),
        "identity": sum(b.node is None for b in found.branches),
        "BatchNorm": sum(b.node is not None and b.node.op_type != "Conv" for b in found.branches),
    }
    return Plan(main, weight, bias, target, {k: n for k, n in counts.items() if n})


def _geometry(conv: ir.Node, kernel: tuple[int, ...]) -> Geometry:
    """A Conv's window per spatial axis.

    Raises:
        CannotFuse: ``pads_not_aligned``: ``auto_pad`` SAME (pads that depend on the input).
    """
    axes = len(kernel)
    auto_pad = conv.attributes.get_string("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        raise CannotFuse(
            ReparamCode.PADS_NOT_ALIGNED,
            f"Conv '{label(conv)}' has auto_pad {auto_pad}: its pads depend on the input size",
        )
    pads = list(conv.attributes.get_ints("pads", [0] * 2 * axes))
    if auto_pad == "VALID":
        pads = [0] * 2 * axes
    return Geometry(
        tuple(kernel),
        tuple(conv.attributes.get_ints("dilations", [1] * axes)),
        tuple(pads[:axes]),
        tuple(pads[axes:]),
        tuple(conv.attributes.get_ints("strides", [1] * axes)),
    )


def _stride(convs: list[Branch], geometries: dict, identity: bool, axes: int) -> tuple:
    """The branches' one stride.

    Raises:
        CannotFuse: ``stride_mismatch``: the Convs' strides differ, or an identity or BatchNorm
            branch sits beside a strided Conv.
    """
    strides = {geometries[id(b)].stride for b in convs}
    if len(strides) != 1:
        raise CannotFuse(
            ReparamCode.STRIDE_MISMATCH,
            f"the Conv branches have different strides {sorted(strides)}",
        )
    (stride,) = strides
    if identity and any(s != 1 for s in stride):
        raise CannotFuse(
            ReparamCode.STRIDE_MISMATCH,
            f"an identity or BatchNorm branch beside Convs of stride {list(stride)}: the "
            "identity does not subsample",
        )
    return stride


def _target(geometries: list[Geometry], stride: tuple) -> Geometry:
    """The merged window: per axis, the tap grid that holds every branch's taps.

    Raises:
        CannotFuse: ``pads_not_aligned``: branches read different windows (their output sizes
            differ for some input size), or the merged Conv would need a negative pad.
    """
    extents = {g.extent for g in geometries}
    if len(extents) != 1:
        raise CannotFuse(
            ReparamCode.PADS_NOT_ALIGNED,
            "the branches' pads and kernels do not line up: pad_begin + pad_end - dilation * "
            f"(kernel - 1) per axis is {sorted(extents)}, not one",
        )
    (extent,) = extents
    kernel, dilation, begin, end = [], [], [], []
    for axis in range(len(extent)):
        starts = [-g.begin[axis] for g in geometries]
        steps = [g.dilation[axis] for g in geometries if g.kernel[axis] > 1]
        low = min(starts)
        grid = reduce(math.gcd, [*steps, *(s - low for s in starts)], 0) or 1
        high = max(-g.begin[axis] + g.dilation[axis] * (g.kernel[axis] - 1) for g in geometries)
        size = (high - low) // grid + 1
        pad_end = extent[axis] - (-low) + grid * (size - 1)
        if pad_end < 0:
            raise CannotFuse(
                ReparamCode.PADS_NOT_ALIGNED,
                f"the merged Conv would need a negative pad on axis {axis}",
            )
        kernel.append(size)
        dilation.append(grid)
        begin.append(-low)
        end.append(pad_end)
    return Geometry(tuple(kernel), tuple(dilation), tuple(begin), tuple(end), stride)


def _placement(branch: Geometry, target: Geometry) -> tuple[slice, ...]:
    """Where a branch's kernel lands in the merged one, per spatial axis."""
    index = []
    for axis, k in enumerate(branch.kernel):
        offset = (target.begin[axis] - branch.begin[axis]) // target.dilation[axis]
        step = branch.dilation[axis] // target.dilation[axis] if k > 1 else 1
        index.append(slice(offset, offset + step * (k - 1) + 1, step))
    return tuple(index)


def _branch_kernel(
    branch: Branch, c_out: int, c_group: int, axes: int
) -> tuple[np.ndarray, np.ndarray]:
    """A branch as a kernel ``(C_out, C_in/group, k...)`` and a bias ``(C_out,)``, float64."""
    node = branch.node
    if node is not None and node.op_type == "Conv":
        weight, bias = const_array(node.inputs[1]).astype(np.float64), bias_of(node)
        return weight, np.zeros(c_out) if bias is None else bias.astype(np.float64)
    scale, shift = np.ones(c_out), np.zeros(c_out)
    if node is not None:
        scale, shift = batchnorm_affine(node)
        if scale.shape != (c_out,):
            raise CannotFuse(
                Code.CHANNEL_MISMATCH,
                f"BatchNormalization '{label(node)}' has {scale.shape[0]} channels, the Convs "
                f"{c_out}",
            )
    kernel = np.zeros((c_out, c_group, *[1] * axes))
    channels = np.arange(c_out)
    kernel[channels, channels % c_group] = scale.reshape(-1, *[1] * axes)
    return kernel, shift


def _product(factors: tuple[np.ndarray, ...], channels: int, rank: int) -> np.ndarray:
    """The per-channel product of ``factors`` as a ``(channels,)`` float64 vector."""
    out = np.ones(channels)
    for factor in factors:
        out = out * _vector(factor, channels, rank)
    return out


def _vector(array: np.ndarray, channels: int, rank: int) -> np.ndarray:
    """A constant operand on a ``rank``-D (N, C, ...) tensor as a ``(C,)`` float64 vector.

    Raises:
        CannotFuse: ``not_per_channel``: it varies along another axis, or has more axes.
    """
    shape = (1,) * (rank - array.ndim) + array.shape if array.ndim <= rank else None
    if shape is None or any(n != 1 for axis, n in enumerate(shape) if axis != 1):
        raise CannotFuse(
            Code.NOT_PER_CHANNEL,
            f"a constant of shape {array.shape} on the sum varies along another axis than the "
            "channels",
        )
    if shape[1] not in (1, channels):
        raise CannotFuse(
            Code.CHANNEL_MISMATCH, f"a constant of {shape[1]} channels on {channels} channels"
        )
    return np.broadcast_to(array.astype(np.float64).reshape(-1), (channels,))
