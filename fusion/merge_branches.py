"""Merge re-parameterizable blocks into one convolution (structural re-parameterization).

Training-time multi-branch blocks (Ding et al., "RepVGG: Making VGG-style ConvNets Great
Again", CVPR 2021, sec. 3.3; Ding et al., "Diverse Branch Block", CVPR 2021, sec. 3; Vasu et
al., "MobileOne", CVPR 2023, sec. 3.1; FastViT's RepMixer, RepViT's token mixer) compute, at
inference, a linear map of one tensor: exported as they are, every branch stays a Conv and a
BatchNormalization stays on the identity branch. Convolution is linear in its weight, so

**A sum of branches** reading one tensor ``x``::

    y = sum_i c_i * B_i(x) + t

where each branch ``B_i`` is a Conv with a constant weight ``W_i`` (its BatchNorm already
folded by :mod:`fusion.fold_batchnorm`), ``x`` itself, or a BatchNormalization of ``x``
(``s * x + b`` per channel), ``c_i`` a per-output-channel coefficient gathered on the way (Sub,
Neg, Mul by a per-channel constant: FastViT's ``x + gamma * (mixer(x) - norm(x))``) and ``t`` the
per-channel constants added, is one Conv: on a common tap grid (its dilation the gcd of the
branches' dilations and tap offsets), each branch is a kernel placed at its offset (an
identity or BatchNorm is a 1x1 kernel that is ``s_c`` from channel ``c`` to itself, within its
group), and ``W = sum_i c_i W_i``, ``b = sum_i c_i b_i + t``. Exact when

- every Conv has the same stride and group; an identity or BatchNorm branch needs stride 1 and
  as many input as output channels;
- every branch reads the same window of the input around each output: ``pad_begin + pad_end -
  dilation * (k - 1)`` equal (the output sizes then agree for every input size) and the taps on
  the common grid;
- the merged kernel has no more taps than the branches together (else it is slower: refused).

A BatchNorm or per-channel affine map after the sum (RepViT's token mixer) is then folded into
the merged Conv (:func:`fusion.fold_batchnorm.after.fold_chain_after`).

**A 1x1 Conv then a kxk Conv** (DBB, transform II): ``Conv_k(Conv_1(x))`` with the 1x1 of group
1, stride 1 and no padding, the kxk of group 1, is ``W[n, c] = sum_m W_k[n, m] W_1[m, c]``,
``b = b_k + sum_m (sum of W_k[n, m]) b_1[m]``. Exact only where the kxk Conv pads nothing or
``b_1`` is zero (its padded zeros are not ``b_1``); merged only where the 1x1 has at least as
many output as input channels (else the merged Conv does more multiply-adds).

Outcomes: each merge is a ``reparam_merged``; each BatchNormalization it absorbs (an identity
branch's) a ``batchnorm_folded``, as is the fold after it. Refusals are of the ``batchnorm``
family (re-parameterization is BatchNorm folding's second half), with the codes
``branch_not_conv``, ``stride_mismatch``, ``group_mismatch``, ``pads_not_aligned``,
``more_work``, ``padded_conv`` and the shared ones.
"""

from __future__ import annotations

import dataclasses
import math
from functools import reduce

import numpy as np
import onnx_ir as ir

from fusion._ir import KnownShapes, const_array, label, remove_nodes, replace_output, set_input
from fusion.base import CannotFuse, Code, FusionPass, Kind
from fusion.fold_batchnorm.after import fold_chain_after
from fusion.fold_batchnorm.algebra import batchnorm_affine

__all__ = ["MergeBranches"]

#: How many nodes up a branch that is no Conv, identity or BatchNorm is followed to find that it
#: reads the block's input through another op (a ReLU in a branch): then it is refused, not
#: ignored.
_BRANCH_DEPTH = 3


@dataclasses.dataclass
class _Branch:
    """One term of the sum: ``sign * prod(factors) * B(x)``.

    Attributes:
        node: the Conv or BatchNormalization; None for the tensor itself.
        value: the tensor the branch reads (its ``x``).
        sign: +1 or -1.
        factors: the constant operands of the Muls on the way (per-channel or scalar).
    """

    node: ir.Node | None
    value: ir.Value
    sign: float
    factors: tuple[np.ndarray, ...]


@dataclasses.dataclass
class _Sum:
    """A tree of Add / Sub / Neg / Mul-by-constant nodes and its branches.

    Attributes:
        root: the tree's last node.
        branches: the terms that read a tensor.
        constants: ``(sign, factors, constant)`` per constant added.
        nodes: the tree's nodes (the root included; the branches' Conv / BN nodes not).
    """

    root: ir.Node
    branches: list[_Branch] = dataclasses.field(default_factory=list)
    constants: list[tuple[float, tuple[np.ndarray, ...], np.ndarray]] = dataclasses.field(
        default_factory=list
    )
    nodes: list[ir.Node] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Geometry:
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


class MergeBranches(FusionPass):
    """Merge sums of convolution, identity and BatchNorm branches reading one tensor, and 1x1
    Convs followed by a kxk Conv, into one Conv (see the module docstring for the math and
    the conditions). Runs after :class:`~fusion.fold_batchnorm.FoldBatchNorm`, whose folds
    leave each branch a Conv with a bias. Graph outputs keep their names.
    """

    kinds = (Kind("reparam_merged", "batchnorm", norm=False),)

    def apply(self, model: ir.Model) -> bool:
        """Merge in place: 1x1 -> kxk pairs first (a pair may be a branch of a sum), then the
        sums, each from its last node; return whether anything was merged."""
        graph = model.graph
        shapes = KnownShapes(model)
        modified = False
        for node in [n for n in graph if _is_conv(n)]:
            if node.graph is graph and label(node) not in self.excluded:
                modified |= self._sequential(graph, node)
        for root in reversed([n for n in graph if n.op_type in ("Add", "Sub")]):
            if root.graph is not graph or root.domain or label(root) in self.excluded:
                continue
            try:
                found = _collect(root)
                if found is None:
                    continue
                plan = _plan(found)
            except CannotFuse as refusal:
                self.refused(root, refusal)
                continue
            self._merge(graph, found, plan, shapes)
            modified = True
        return modified

    def _sequential(self, graph: ir.Graph, conv: ir.Node) -> bool:
        """Merge the 1x1 Conv before ``conv`` into it, where that is exact and no slower."""
        first = conv.inputs[0].producer()
        if first is None or not _read_once(conv.inputs[0]) or not _is_pair(first, conv):
            return False
        try:
            weight, bias = _sequential_weights(first, conv)
        except CannotFuse as refusal:
            self.refused(conv, refusal)
            return False
        name = label(conv)
        set_input(graph, conv, 1, weight, f"{conv.inputs[1].name}_merged")
        set_input(graph, conv, 2, bias, f"{conv.inputs[1].name}_merged_bias")
        conv.replace_input_with(0, first.inputs[0])
        remove_nodes(graph, [first])
        self.fused(name, f"Conv (1x1 Conv '{label(first)}' merged into it)")
        return True

    def _merge(self, graph: ir.Graph, found: _Sum, plan: _Plan, shapes: KnownShapes) -> None:
        """Rewrite ``found`` into ``plan.main`` and fold what follows it."""
        main, root_name = plan.main, label(found.root)
        dtype = const_array(main.inputs[1]).dtype
        hint = main.inputs[1].name
        set_input(graph, main, 1, plan.weight.astype(dtype), f"{hint}_merged")
        set_input(graph, main, 2, plan.bias.astype(dtype), f"{hint}_merged_bias")
        geometry = plan.geometry
        main.attributes.pop("auto_pad", None)
        main.attributes["kernel_shape"] = ir.AttrInt64s("kernel_shape", list(geometry.kernel))
        main.attributes["pads"] = ir.AttrInt64s("pads", [*geometry.begin, *geometry.end])
        main.attributes["dilations"] = ir.AttrInt64s("dilations", list(geometry.dilation))
        main.attributes["strides"] = ir.AttrInt64s("strides", list(geometry.stride))
        replace_output(graph, found.root.outputs[0], main.outputs[0])
        others = [b.node for b in found.branches if b.node is not None and b.node is not main]
        bns = [label(n) for n in others if n.op_type == "BatchNormalization"]
        remove_nodes(graph, [*found.nodes, *others])
        what = ", ".join(f"{n} {k}" for k, n in plan.counts.items())
        self.fused(root_name, f"Conv '{label(main)}' ({what})")
        for bn in bns:
            self.fused(bn, f"merged into Conv '{label(main)}'", kind="batchnorm_folded")
        folded = fold_chain_after(graph, main, {}, shapes)
        if folded is not None:
            self.fused(folded.node, folded.became, kind=folded.kind, count=folded.count)


def _is_conv(node: ir.Node) -> bool:
    """A Conv with a constant weight (and bias, where it has one)."""
    if node.op_type != "Conv" or node.domain or len(node.inputs) < 2:
        return False
    if const_array(node.inputs[1]) is None:
        return False
    return _bias(node) is not None or len(node.inputs) < 3 or node.inputs[2] is None


def _bias(conv: ir.Node) -> np.ndarray | None:
    """A Conv's constant bias (None where it has none, or it is not constant)."""
    return const_array(conv.inputs[2]) if len(conv.inputs) > 2 else None


# --- the sum ----------------------------------------------------------------------------------


def _collect(root: ir.Node) -> _Sum | None:
    """The sum ending at ``root`` and its branches, where at least two branches read one tensor
    and one of them is a Conv; None where there is no such sum (a residual Add of two tensors).

    Raises:
        CannotFuse: ``branch_not_conv``: a branch reads that tensor through another op.
    """
    found = _Sum(root)
    _visit(found, root.outputs[0], 1.0, (), top=True)
    counts: dict[ir.Value, list[_Branch]] = {}
    for branch in found.branches:
        counts.setdefault(branch.value, []).append(branch)
    candidates = [
        (len(bs), x)
        for x, bs in counts.items()
        if len(bs) >= 2 and any(b.node is not None and b.node.op_type == "Conv" for b in bs)
    ]
    if not candidates:
        return None
    x = max(candidates, key=lambda c: c[0])[1]
    for branch in found.branches:
        if branch.value is not x:
            through = _reaches(branch.value, x)
            if through is None:
                return None  # a tensor from elsewhere: no block of branches of x
            raise CannotFuse(
                Code.BRANCH_NOT_CONV,
                f"a branch reads '{x.name}' through {through.op_type} '{label(through)}': "
                "only Convs, the identity and BatchNorms of it merge into one Conv",
            )
    return found


def _visit(found: _Sum, value: ir.Value, sign: float, factors: tuple, top: bool = False) -> None:
    """Add ``sign * prod(factors) * value`` to ``found``, expanding the tree's nodes."""
    node = value.producer()
    inside = node is not None and not node.domain and (top or _read_once(value))
    if inside and node.op_type in ("Add", "Sub") and len(node.inputs) == 2:
        found.nodes.append(node)
        a, b = node.inputs
        minus = -sign if node.op_type == "Sub" else sign
        if const_array(b) is not None:
            found.constants.append((minus, factors, const_array(b)))
            _visit(found, a, sign, factors)
        elif const_array(a) is not None:
            found.constants.append((sign, factors, const_array(a)))
            _visit(found, b, minus, factors)
        else:
            _visit(found, a, sign, factors)
            _visit(found, b, minus, factors)
        return
    if inside and node.op_type == "Neg":
        found.nodes.append(node)
        _visit(found, node.inputs[0], -sign, factors)
        return
    if inside and node.op_type == "Mul" and len(node.inputs) == 2:
        a, b = (const_array(v) for v in node.inputs)
        if (a is None) != (b is None):  # data times a constant
            found.nodes.append(node)
            data = node.inputs[0] if a is None else node.inputs[1]
            _visit(found, data, sign, (*factors, b if a is None else a))
            return
    if inside and (_is_conv(node) or node.op_type == "BatchNormalization"):
        found.branches.append(_Branch(node, node.inputs[0], sign, factors))
        return
    found.branches.append(_Branch(None, value, sign, factors))


def _read_once(value: ir.Value) -> bool:
    """Whether ``value`` has one reader and is no graph output (a node of the tree may go)."""
    return not value.is_graph_output() and len(list(value.uses())) == 1


def _reaches(value: ir.Value, x: ir.Value) -> ir.Node | None:
    """``value``'s producer, where it reads ``x`` within :data:`_BRANCH_DEPTH` nodes up (along
    first inputs); else None."""
    first = value.producer()
    for _ in range(_BRANCH_DEPTH):
        node = value.producer()
        if node is None or not node.inputs or node.inputs[0] is None:
            return None
        if any(v is x for v in node.inputs):
            return first
        value = node.inputs[0]
    return None


@dataclasses.dataclass
class _Plan:
    """The merged Conv: which branch's node becomes it, its weight, bias and window."""

    main: ir.Node
    weight: np.ndarray
    bias: np.ndarray
    geometry: _Geometry
    counts: dict[str, int]


def _plan(found: _Sum) -> _Plan:
    """The merged Conv of ``found`` (see the module docstring).

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
            Code.GROUP_MISMATCH,
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
            Code.GROUP_MISMATCH,
            f"an identity or BatchNorm branch beside Convs of {c_in} input and {c_out} output "
            "channels: the identity maps a channel to itself",
        )
    for b in others:
        geometries[id(b)] = _Geometry((1,) * axes, (1,) * axes, (0,) * axes, (0,) * axes, None)
    stride = _stride(convs, geometries, bool(others), axes)
    target = _target(list(geometries.values()), stride)
    taps = sum(g.taps for g in geometries.values())
    if target.taps > taps:
        raise CannotFuse(
            Code.MORE_WORK,
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
    return _Plan(main, weight, bias, target, {k: n for k, n in counts.items() if n})


def _geometry(conv: ir.Node, kernel: tuple[int, ...]) -> _Geometry:
    """A Conv's window per spatial axis.

    Raises:
        CannotFuse: ``pads_not_aligned``: ``auto_pad`` SAME (pads that depend on the input).
    """
    axes = len(kernel)
    auto_pad = conv.attributes.get_string("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        raise CannotFuse(
            Code.PADS_NOT_ALIGNED,
            f"Conv '{label(conv)}' has auto_pad {auto_pad}: its pads depend on the input size",
        )
    pads = list(conv.attributes.get_ints("pads", [0] * 2 * axes))
    if auto_pad == "VALID":
        pads = [0] * 2 * axes
    return _Geometry(
        tuple(kernel),
        tuple(conv.attributes.get_ints("dilations", [1] * axes)),
        tuple(pads[:axes]),
        tuple(pads[axes:]),
        tuple(conv.attributes.get_ints("strides", [1] * axes)),
    )


def _stride(convs: list[_Branch], geometries: dict, identity: bool, axes: int) -> tuple:
    """The branches' one stride.

    Raises:
        CannotFuse: ``stride_mismatch``: the Convs' strides differ, or an identity or BatchNorm
            branch sits beside a strided Conv.
    """
    strides = {geometries[id(b)].stride for b in convs}
    if len(strides) != 1:
        raise CannotFuse(
            Code.STRIDE_MISMATCH, f"the Conv branches have different strides {sorted(strides)}"
        )
    (stride,) = strides
    if identity and any(s != 1 for s in stride):
        raise CannotFuse(
            Code.STRIDE_MISMATCH,
            f"an identity or BatchNorm branch beside Convs of stride {list(stride)}: the "
            "identity does not subsample",
        )
    return stride


def _target(geometries: list[_Geometry], stride: tuple) -> _Geometry:
    """The merged window: per axis, the tap grid that holds every branch's taps.

    Raises:
        CannotFuse: ``pads_not_aligned``: branches read different windows (their output sizes
            differ for some input size), or the merged Conv would need a negative pad.
    """
    extents = {g.extent for g in geometries}
    if len(extents) != 1:
        raise CannotFuse(
            Code.PADS_NOT_ALIGNED,
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
                Code.PADS_NOT_ALIGNED, f"the merged Conv would need a negative pad on axis {axis}"
            )
        kernel.append(size)
        dilation.append(grid)
        begin.append(-low)
        end.append(pad_end)
    return _Geometry(tuple(kernel), tuple(dilation), tuple(begin), tuple(end), stride)


def _placement(branch: _Geometry, target: _Geometry) -> tuple[slice, ...]:
    """Where a branch's kernel lands in the merged one, per spatial axis."""
    index = []
    for axis, k in enumerate(branch.kernel):
        offset = (target.begin[axis] - branch.begin[axis]) // target.dilation[axis]
        step = branch.dilation[axis] // target.dilation[axis] if k > 1 else 1
        index.append(slice(offset, offset + step * (k - 1) + 1, step))
    return tuple(index)


def _branch_kernel(
    branch: _Branch, c_out: int, c_group: int, axes: int
) -> tuple[np.ndarray, np.ndarray]:
    """A branch as a kernel ``(C_out, C_in/group, k...)`` and a bias ``(C_out,)``, float64."""
    node = branch.node
    if node is not None and node.op_type == "Conv":
        weight, bias = const_array(node.inputs[1]).astype(np.float64), _bias(node)
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


# --- 1x1 then kxk -----------------------------------------------------------------------------


def _is_pair(first: ir.Node, second: ir.Node) -> bool:
    """Whether ``first`` is a plain 1x1 Conv (group 1, stride 1, no padding) and ``second`` a
    Conv of group 1 and the same rank, both with constant weights."""
    if not (_is_conv(first) and _is_conv(second)):
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


def _sequential_weights(first: ir.Node, second: ir.Node) -> tuple[np.ndarray, np.ndarray]:
    """The weight and bias of ``second(first(x))`` as one Conv, in ``second``'s dtype
    (``first`` and ``second`` a pair of :func:`_is_pair`).

    Raises:
        CannotFuse: ``padded_conv`` (``second`` pads the output of a 1x1 with a bias),
            ``more_work`` (the 1x1 narrows the channels).
    """
    w1 = const_array(first.inputs[1]).astype(np.float64)
    w2 = const_array(second.inputs[1])
    axes = w1.ndim - 2
    b1 = _bias(first)
    b1 = np.zeros(w1.shape[0]) if b1 is None else b1.astype(np.float64)
    auto_pad = second.attributes.get_string("auto_pad", "NOTSET")
    padded = auto_pad.startswith("SAME") or (
        auto_pad == "NOTSET" and any(second.attributes.get_ints("pads", [0] * 2 * axes))
    )
    if padded and b1.any():
        raise CannotFuse(
            Code.PADDED_CONV,
            f"Conv '{label(second)}' pads the output of the 1x1 Conv '{label(first)}', whose "
            "bias is not zero: a padded zero is not that bias",
        )
    if w1.shape[1] > w1.shape[0]:
        raise CannotFuse(
            Code.MORE_WORK,
            f"the 1x1 Conv '{label(first)}' narrows {w1.shape[1]} channels to {w1.shape[0]}: "
            "the merged Conv would do more multiply-adds",
        )
    w2_64 = w2.astype(np.float64)
    weight = np.moveaxis(np.tensordot(w2_64, w1.reshape(w1.shape[:2]), axes=([1], [0])), -1, 1)
    b2 = _bias(second)
    spatial = tuple(range(2, w2.ndim))
    bias = (0.0 if b2 is None else b2.astype(np.float64)) + w2_64.sum(axis=spatial) @ b1
    return weight.astype(w2.dtype), np.asarray(bias).astype(w2.dtype)
