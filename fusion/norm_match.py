"""Matching helpers shared by the LayerNorm and RMSNorm passes (and the passes built on them).

LayerNorm (Ba, Kiros & Hinton 2016) and RMSNorm (Zhang & Sennrich 2019) share one core: a
denominator ``sqrt(f * mean_A(v * v) + eps)`` over the trailing axes ``A`` of some ``v`` (the
centered input ``x - mean_A(x)`` for LayerNorm, ``x`` itself for RMSNorm), a division by it,
then an optional Cast, constant weight and bias. ONNX's ``LayerNormalization`` (opset 17) and
``RMSNormalization`` (opset 23) are defined as those function bodies (onnx/docs/Operators.md),
with ``axis = -k`` for ``k`` normalized axes and ``stash_type=1`` (statistics in float32).

This module finds that core (:func:`match_mean_square`, :func:`centered`), checks what both
passes require of it (:func:`check_core`), and holds a matched norm with what its fused node
needs (:class:`NormMatch`). Each check that fails raises :class:`~fusion.base.CannotFuse` with
a stable :class:`~fusion.base.Code`.

A constant factor ``f > 0`` on the mean square is exact to move into the fused op::

    v / sqrt(f * ms + eps) = f^(-1/2) * v / sqrt(ms + eps / f)

so the op takes ``epsilon = eps / f`` and ``Scale = w / sqrt(f)`` (:attr:`NormMatch.epsilon`,
:meth:`NormMatch.scale`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    add_initializer,
    const_array,
    escaping_value,
    other_input,
    producer,
    reduce_axes,
    remove_nodes,
    replace_output,
    scalar_const,
    sole_consumer,
)
from fusion.base import CannotFuse, Code, FusionPass

FLOAT = ir.DataType.FLOAT

#: Types whose round trip through float32 around a norm becomes one fused op on them.
HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _square_of(value: ir.Value) -> tuple[ir.Value, ir.Node] | None:
    """``(v, node)`` when ``value`` is ``Pow(v, 2)`` or ``Mul(v, v)``."""
    node = producer(value, "Pow")
    if node is not None and scalar_const(node.inputs[1]) == 2.0:
        return node.inputs[0], node
    node = producer(value, "Mul")
    if node is not None and node.inputs[0] is node.inputs[1]:
        return node.inputs[0], node
    return None


def scalar_factor(value: ir.Value | None) -> float | None:
    """The number behind a constant ``value`` of one element and at most one axis, or None.

    Such a constant broadcasts against anything without changing its shape.
    """
    array = const_array(value)
    if array is None or array.size != 1 or array.ndim > 1:
        return None
    return float(array.reshape(()))


@dataclasses.dataclass
class MeanSquare:
    """``den = Sqrt(Add(f * ReduceMean(square(v)), eps))``: the core LayerNorm and RMSNorm share.

    Attributes:
        value: ``v``, the tensor whose mean square is taken.
        reduce: the ReduceMean node (its axes and keepdims are the norm's).
        eps: the eps constant as a 0-d array of its own dtype (the dtype the norm computes in),
            or None when it is not a one-element constant (the caller refuses).
        factor: ``f``, the product of the constants the mean is multiplied (or divided) by.
        restores: Reshape / Expand nodes between the mean and the Add, in graph order (they
            must put back the reduced axes that ``keepdims=0`` dropped; see :func:`check_core`).
        nodes: every node from the square to the Sqrt.
        eps_constant: whether eps is a constant (of any size).
    """

    value: ir.Value
    reduce: ir.Node
    eps: np.ndarray | None
    factor: float
    restores: list[ir.Node]
    nodes: list[ir.Node]
    eps_constant: bool = False


def _scaled_mean_square(value: ir.Value) -> MeanSquare | None:
    """Walk up from ``value = f * ReduceMean(square(v))`` through scalar Mul / Div and
    Reshape / Expand; None when ``value`` is not of that form. ``eps`` is left unset."""
    chain: list[ir.Node] = []
    factor = 1.0
    while True:
        node = value.producer() if value is not None else None
        if node is None or node.domain != "":
            return None
        if node.op_type == "ReduceMean":
            square = _square_of(node.inputs[0])
            if square is None:
                return None
            restores = [n for n in chain if n.op_type in ("Reshape", "Expand")]
            return MeanSquare(square[0], node, None, factor, restores, [square[1], node, *chain])
        if node.op_type in ("Reshape", "Expand"):
            value = node.inputs[0]
        elif node.op_type == "Mul" and len(node.inputs) == 2:
            c = scalar_factor(node.inputs[1])
            value = node.inputs[0]
            if c is None:
                c, value = scalar_factor(node.inputs[0]), node.inputs[1]
            if c is None:
                return None
            factor *= c
        elif node.op_type == "Div" and (c := scalar_factor(node.inputs[1])) is not None:
            value = node.inputs[0]
            factor = factor / c if c else math.inf
        else:
            return None
        chain.insert(0, node)


def match_mean_square(den: ir.Value) -> MeanSquare | None:
    """Match ``den = Sqrt(Add(f * ReduceMean(square(v)), eps))`` (see :class:`MeanSquare`).

    Returns:
        The match, or None when ``den`` is not of that form (no norm candidate at all).
    """
    sqrt = producer(den, "Sqrt")
    add = producer(sqrt.inputs[0], "Add") if sqrt is not None else None
    if add is None:
        return None
    first, second = add.inputs
    found, eps = _scaled_mean_square(first), second
    if found is None:
        found, eps = _scaled_mean_square(second), first
    if found is None:
        return None
    eps_array = const_array(eps)
    found.eps = eps_array.reshape(()) if eps_array is not None and eps_array.size == 1 else None
    found.eps_constant = eps_array is not None
    found.nodes += [add, sqrt]
    return found


def match_eps_outside_sqrt(den: ir.Value) -> ir.Value | None:
    """``v`` when ``den = Add(Sqrt(f * ReduceMean(square(v))), constant)``: eps outside the root."""
    add = producer(den, "Add")
    if add is None:
        return None
    for root, eps in (add.inputs, add.inputs[::-1]):
        sqrt = producer(root, "Sqrt")
        found = _scaled_mean_square(sqrt.inputs[0]) if sqrt is not None else None
        if found is not None and const_array(eps) is not None:
            return found.value
    return None


def centered(value: ir.Value) -> tuple[ir.Value, ir.Node, ir.Node] | None:
    """``(x, mean, sub)`` when ``value = Sub(x, ReduceMean(x))``."""
    sub = producer(value, "Sub")
    mean = producer(sub.inputs[1], "ReduceMean") if sub is not None else None
    if mean is None or mean.inputs[0] is not sub.inputs[0]:
        return None
    return sub.inputs[0], mean, sub


def trailing_axes(axes: tuple[int, ...], rank: int | None) -> int | None:
    """How many trailing axes ``axes`` are (``k``), or None if they are not the last k axes.

    Without a known rank only negative axes can be placed: ``(-2, -1)`` is the last two axes
    of any input.
    """
    if rank is not None:
        if any(not -rank <= a < rank for a in axes):
            return None
        axes = tuple(a - rank if a >= 0 else a for a in axes)
    k = len(set(axes))
    return k if k == len(axes) and set(axes) == set(range(-k, 0)) else None


def reduced_trailing(reduce: ir.Node, rank: int | None, *, restored: bool = False) -> int:
    """``k`` for a ReduceMean over the last k axes with keepdims=1.

    Args:
        reduce: the ReduceMean node.
        rank: the rank of its input, if known.
        restored: keepdims=0 is accepted, because Reshape / Expand nodes after the mean put the
            axes back (the caller checks them).

    Raises:
        CannotFuse: ``not_constant`` (the axes), ``axes_not_trailing``, or ``keepdims_zero``
            (the reduction drops the axes and nothing restores them).
    """
    axes = reduce_axes(reduce, rank)
    if axes is None:
        raise CannotFuse(
            Code.NOT_CONSTANT, f"{reduce.name} reduces over axes that are not constant"
        )
    if reduce.attributes.get_int("keepdims", 1) != 1 and not restored:
        raise CannotFuse(
            Code.KEEPDIMS_ZERO, f"{reduce.name} has keepdims=0: not a per-row statistic"
        )
    k = trailing_axes(axes, rank)
    if k is None:
        where = f"a rank-{rank} input" if rank is not None else "an input of unknown rank"
        raise CannotFuse(
            Code.AXES_NOT_TRAILING,
            f"mean over axes {list(axes)} of {where}: the fused op normalizes the trailing "
            "axes only",
        )
    return k


def _check_restored(core: MeanSquare, x: ir.Value, k: int) -> None:
    """The Reshape / Expand nodes after the mean must leave it in its keepdims shape.

    Raises:
        CannotFuse: ``unknown_shape`` (the shape of ``x`` is not static) or
            ``variance_reshaped`` (a target shape is not a constant of explicit dimensions, or
            the result is not ``x``'s shape with the ``k`` normalized axes set to 1).
    """
    if not core.restores:
        return
    dims = tuple(x.shape.dims) if x.shape is not None else ()
    if not dims or not all(isinstance(d, int) for d in dims):
        raise CannotFuse(
            Code.UNKNOWN_SHAPE,
            "the variance is reshaped, and the input's shape is not static: cannot check that "
            "the reshape only restores the reduced axes",
        )
    keep = dims[: len(dims) - k] + (1,) * k
    shape = keep if core.reduce.attributes.get_int("keepdims", 1) else keep[: len(dims) - k]
    for node in core.restores:
        target = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        target = tuple(int(t) for t in target.reshape(-1)) if target is not None else None
        if target is None or (node.op_type == "Reshape" and min(target, default=1) < 1):
            raise CannotFuse(
                Code.VARIANCE_RESHAPED,
                f"the variance goes through {node.op_type} '{node.name}' to a shape that is not "
                "a constant of explicit dimensions",
            )
        shape = target if node.op_type == "Reshape" else np.broadcast_shapes(shape, target)
    if tuple(shape) != keep:
        raise CannotFuse(
            Code.VARIANCE_RESHAPED,
            f"the variance is reshaped to {list(shape)}, not to its keepdims shape {list(keep)}",
        )


def check_core(core: MeanSquare, x: ir.Value, rank: int | None) -> int:
    """The checks LayerNorm and RMSNorm share; return ``k``, the number of normalized axes.

    Raises:
        CannotFuse: ``not_constant`` / ``eps_not_scalar`` (eps is not a one-element
            constant), the codes of :func:`reduced_trailing` and :func:`_check_restored`,
            ``factor_not_positive``, ``unsupported_dtype`` (the norm is not in float32).
    """
    if core.eps is None and not core.eps_constant:
        raise CannotFuse(Code.NOT_CONSTANT, "eps is not a constant: it cannot become an attribute")
    if core.eps is None:
        raise CannotFuse(
            Code.EPS_NOT_SCALAR, "eps is not a one-element constant: it cannot become an attribute"
        )
    k = reduced_trailing(core.reduce, rank, restored=bool(core.restores))
    _check_restored(core, x, k)
    if not (math.isfinite(core.factor) and core.factor > 0):
        raise CannotFuse(
            Code.FACTOR_NOT_POSITIVE,
            f"the mean square is multiplied by {core.factor:g}: only a positive factor can move "
            "into epsilon and the scale",
        )
    if core.eps.dtype != FLOAT.numpy():
        raise CannotFuse(
            Code.UNSUPPORTED_DTYPE,
            f"computes in {core.eps.dtype}: only float32 norms are fused (the fused op with "
            "stash_type=1 computes in float32, a different function)",
        )
    return k


def normalized_dims(k: int, *values: ir.Value | None) -> tuple[int | None, ...]:
    """The sizes of the last ``k`` axes (None where symbolic), from the first known shape."""
    for value in values:
        if value is not None and value.shape is not None and len(value.shape) >= k:
            dims = value.shape.dims[len(value.shape) - k :]
            return tuple(d if isinstance(d, int) else None for d in dims)
    return (None,) * k


def affine_param(
    array: np.ndarray, k: int, rank: int | None, dims: tuple[int | None, ...]
) -> np.ndarray | None:
    """``array`` (a weight or bias) as a tensor over the ``k`` normalized axes, or None.

    None when multiplying or adding it would do more than scale or shift along the normalized
    axes: it varies along another axis, or it has more axes than the input (the output's rank
    would grow). The result has ``k`` axes, broadcast to the full normalized shape when all
    ``dims`` are known (a symbolic normalized size is taken to match the array's).
    """
    if array.ndim > (rank if rank is not None else k):
        return None
    lead = array.shape[: max(array.ndim - k, 0)]
    if any(d != 1 for d in lead):
        return None
    tail = array.reshape((1,) * max(k - array.ndim, 0) + array.shape[len(lead) :])
    if any(t != 1 and d is not None and t != d for t, d in zip(tail.shape, dims, strict=True)):
        return None
    if None not in dims:
        tail = np.ascontiguousarray(np.broadcast_to(tail, dims))
    return tail


def param_value(graph: ir.Graph, source: ir.Value | None, array: np.ndarray, hint: str) -> ir.Value:
    """``source`` itself when its constant already is ``array``'s shape, else a new initializer."""
    original = const_array(source)
    if original is not None and original.shape == array.shape:
        return source
    return add_initializer(graph, hint, array)


def absorb_const(
    value: ir.Value, op_type: str, dtype: ir.DataType
) -> tuple[ir.Node, ir.Value, np.ndarray] | None:
    """``(node, operand, array)`` when the only reader of ``value`` is ``op_type(value, c)``
    (either order) with ``c`` a constant of ``dtype``; None otherwise."""
    node = sole_consumer(value)
    if node is None or node.op_type != op_type or node.domain != "":
        return None
    operand = other_input(node, value)
    array = const_array(operand)
    if array is None or array.dtype != dtype.numpy():
        return None
    return node, operand, array


@dataclasses.dataclass
class NormMatch:
    """A matched LayerNorm or RMSNorm: what the fused node needs, and the nodes it replaces.

    Attributes:
        x: the fused node's input.
        k: how many trailing axes are normalized (the fused op's ``axis`` is ``-k``).
        dims: the sizes of those axes (None where symbolic).
        eps: the model's eps.
        factor: the constant the mean square is multiplied by (1 for the textbook form).
        nodes: the nodes the fused node replaces.
        output: the value the fused node's output replaces.
        dtype: the type of ``x``, ``Scale`` and ``B``: float32, or float16 / bfloat16 when a
            round trip through float32 was absorbed.
        weight, bias: the absorbed constants, ``(value, array over the normalized axes)``.
    """

    x: ir.Value
    k: int
    dims: tuple[int | None, ...]
    eps: float
    factor: float
    nodes: list[ir.Node]
    output: ir.Value
    dtype: ir.DataType = FLOAT
    weight: tuple[ir.Value, np.ndarray] | None = None
    bias: tuple[ir.Value, np.ndarray] | None = None

    @property
    def epsilon(self) -> float:
        """The fused op's epsilon: ``eps / factor``."""
        return self.eps / self.factor

    def scale(self, graph: ir.Graph, hint: str) -> ir.Value:
        """The fused op's Scale: the weight (ones when there is none) over ``sqrt(factor)``."""
        if self.weight is not None and self.factor == 1.0:
            return param_value(graph, self.weight[0], self.weight[1], f"{hint}_weight")
        if self.weight is not None:
            array = self.weight[1]
        else:
            array = np.ones([d if d is not None else 1 for d in self.dims], self.dtype.numpy())
        scaled = array.astype(np.float64) / math.sqrt(self.factor)
        return add_initializer(graph, f"{hint}_scale", scaled.astype(array.dtype))

    def absorb_casts(self) -> None:
        """Extend over a no-op Cast to float32 after the norm, or a half-precision round trip.

        The round trip is ``Cast(x16, float32)`` before and ``Cast(float16)`` after (or
        bfloat16 both times), with nothing else reading the float32 values: the fused op then
        takes ``x16`` with ``stash_type=1`` (see the module docstring).
        """
        cast = sole_consumer(self.output)
        if cast is None or cast.op_type != "Cast" or cast.domain != "":
            return
        to = cast.attributes.get_int("to")
        upcast = producer(self.x, "Cast")
        source = upcast.inputs[0] if upcast is not None else None
        if to == FLOAT:
            self.nodes.append(cast)
        elif (
            source is not None
            and source.dtype in HALF_TYPES
            and to == source.dtype
            and escaping_value([upcast, *self.nodes], self.output) is None
        ):
            self.nodes = [upcast, *self.nodes, cast]
            self.x = source
            self.dtype = source.dtype
        else:
            return
        self.output = cast.outputs[0]

    def absorb_affine(
        self,
        fusion_pass: FusionPass,
        rank: int | None,
        ops: tuple[tuple[str, str], ...],
        fused: str,
    ) -> None:
        """Extend over constant weight / bias ops after the norm, in the order of ``ops``.

        Args:
            fusion_pass: the pass that records a weight that cannot be absorbed.
            rank: the rank of ``x``, if known.
            ops: ``(op_type, "weight" | "bias")`` pairs, e.g. ``(("Mul", "weight"),)``.
            fused: how the fused op is named in a refusal.
        """
        for op_type, what in ops:
            found = absorb_const(self.output, op_type, self.dtype)
            if found is None:
                continue
            node, operand, array = found
            param = affine_param(array, self.k, rank, self.dims)
            if param is None:
                fusion_pass.refused(
                    node,
                    CannotFuse(
                        Code.AXIS_NOT_NORMALIZED,
                        f"{what} of shape {list(array.shape)} varies along an axis that is not "
                        f"normalized: kept as a separate {op_type} after the {fused}",
                    ),
                )
                return
            setattr(self, what, (operand, param))
            self.nodes.append(node)
            self.output = node.outputs[0]

    def replace(self, graph: ir.Graph, fused: ir.Node) -> None:
        """Put ``fused`` in place of the matched nodes: its output (of the type and shape of
        ``x``, as for every norm op) takes over the readers of :attr:`output`."""
        fused.outputs[0].type = self.x.type
        fused.outputs[0].shape = self.x.shape.copy() if self.x.shape is not None else None
        graph.insert_before(self.nodes[-1], fused)
        replace_output(graph, self.output, fused.outputs[0])
        # Matched nodes whose outputs are read elsewhere (a shared x - mean(x)) stay.
        dead = set(self.nodes)
        changed = True
        while changed:
            changed = False
            for n in list(dead):
                if any(
                    out.is_graph_output() or any(use.node not in dead for use in out.uses())
                    for out in n.outputs
                ):
                    dead.discard(n)
                    changed = True
        remove_nodes(graph, [n for n in self.nodes if n in dead])
