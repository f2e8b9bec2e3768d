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
    label,
    other_input,
    producer,
    reduce_axes,
    remove_nodes,
    replace_output,
    scalar_const,
    sole_consumer,
)
from fusion.base import CannotFuse, Code, FusionPass, FusionReport, NodeFusionPass

FLOAT = ir.DataType.FLOAT

#: The reductions a mean may be written with: ``ReduceMean``, or ``ReduceSum`` times a constant.
REDUCTIONS = ("ReduceMean", "ReduceSum")

#: How far from 1 a product of float32 constants may be and still count as 1: a few float32
#: roundings (``1/d`` rounded to float32 is within ``2^-24`` of it, relatively). A wrong divisor
#: such as ``d - 1`` is ``1/d`` off, far more for any realistic ``d``.
EXACT = 2.0**-21

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


def _scalar_step(node: ir.Node) -> tuple[ir.Value, float] | None:
    """``(v, c)`` when ``node`` is ``v * c`` (``Mul``, either operand order) or ``v / (1/c)``
    (``Div``) with ``c`` a one-element constant (:func:`scalar_factor`); None otherwise."""
    if node.domain != "" or len(node.inputs) != 2:
        return None
    if node.op_type == "Mul":
        for value, constant in (node.inputs, node.inputs[::-1]):
            if (c := scalar_factor(constant)) is not None:
                return value, c
    if node.op_type == "Div" and (c := scalar_factor(node.inputs[1])) is not None:
        return node.inputs[0], 1.0 / c if c else math.inf
    return None


def _is_one(factor: float) -> bool:
    """Whether ``factor`` is 1 up to a few float32 roundings (see :data:`EXACT`)."""
    return abs(factor - 1.0) <= EXACT


def _count(reduce: ir.Node, dims: tuple[int | None, ...]) -> int:
    """How many elements a ReduceSum over the normalized ``dims`` adds up (1 for a ReduceMean,
    which divides by that number itself).

    Raises:
        CannotFuse: ``unknown_shape``: a ReduceSum over axes whose sizes are not known.
    """
    if reduce.op_type != "ReduceSum":
        return 1
    if None in dims:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE,
            f"ReduceSum '{reduce.name}' is divided by a constant, and the number of elements it "
            "sums is not known from the shape: cannot check that the quotient is a mean",
        )
    return math.prod(dims)


@dataclasses.dataclass
class MeanSquare:
    """``den = Sqrt(Add(f * ReduceMean(square(v)), eps))``: the core LayerNorm and RMSNorm share.

    The mean may be written as a sum, ``ReduceSum(square(v))`` times a constant (``f`` then
    holds the constant, and :func:`check_core` multiplies it by the number of elements summed),
    and eps may be absent (``Sqrt`` of the scaled mean square itself: epsilon 0).

    Attributes:
        value: ``v``, the tensor whose mean square is taken.
        reduce: the ReduceMean or ReduceSum node (its axes and keepdims are the norm's).
        eps: the eps constant as a 0-d array of its own dtype (the dtype the norm computes in),
            or None when it is not a one-element constant (the caller refuses) or absent.
        factor: ``f``, the product of the constants the mean is multiplied (or divided) by.
        restores: Reshape / Expand nodes between the mean and the Add, in graph order (they
            must put back the reduced axes that ``keepdims=0`` dropped; see :func:`check_core`).
        nodes: every node from the square to the Sqrt.
        eps_constant: whether eps is a constant (of any size).
        no_eps: whether there is no eps at all (no Add before the Sqrt).
    """

    value: ir.Value
    reduce: ir.Node
    eps: np.ndarray | None
    factor: float
    restores: list[ir.Node]
    nodes: list[ir.Node]
    eps_constant: bool = False
    no_eps: bool = False


def _scaled_mean_square(value: ir.Value) -> MeanSquare | None:
    """Walk up from ``value = f * ReduceMean(square(v))`` (or ``f * ReduceSum(square(v))``)
    through scalar Mul / Div and Reshape / Expand; None when ``value`` is not of that form.
    ``eps`` is left unset."""
    chain: list[ir.Node] = []
    factor = 1.0
    while True:
        node = value.producer() if value is not None else None
        if node is None or node.domain != "":
            return None
        if node.op_type in REDUCTIONS:
            square = _square_of(node.inputs[0])
            if square is None:
                return None
            restores = [n for n in chain if n.op_type in ("Reshape", "Expand")]
            return MeanSquare(square[0], node, None, factor, restores, [square[1], node, *chain])
        if node.op_type in ("Reshape", "Expand"):
            value = node.inputs[0]
        elif (step := _scalar_step(node)) is not None:
            value, c = step
            factor *= c
        else:
            return None
        chain.insert(0, node)


def match_mean_square(den: ir.Value) -> MeanSquare | None:
    """Match ``den = Sqrt(Add(f * ReduceMean(square(v)), eps))``, or ``Sqrt(f * ReduceMean(
    square(v)))`` with no eps (see :class:`MeanSquare`).

    Returns:
        The match, or None when ``den`` is not of that form (no norm candidate at all).
    """
    sqrt = producer(den, "Sqrt")
    if sqrt is None:
        return None
    found = _scaled_mean_square(sqrt.inputs[0])
    if found is not None:
        found.no_eps = True
        found.nodes.append(sqrt)
        return found
    add = producer(sqrt.inputs[0], "Add")
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


@dataclasses.dataclass
class Centering:
    """``x - f * Reduce(x)``: ``x`` minus its mean, written with ``ReduceMean`` (``f = 1``) or
    as a sum times a constant (``x.sum(-1, keepdim=True) / d``: ``ReduceSum``, ``f = 1/d``).

    Attributes:
        x: the input.
        reduce: the ReduceMean or ReduceSum node.
        factor: ``f``, the product of the constants the reduction is multiplied (or divided) by.
        nodes: the reduction, the scalar Mul / Div nodes, the Sub, and a no-op Cast after it.
    """

    x: ir.Value
    reduce: ir.Node
    factor: float
    nodes: list[ir.Node]

    def check(self, k: int, rank: int | None, dims: tuple[int | None, ...]) -> None:
        """Check that the mean is over the ``k`` normalized axes (of sizes ``dims``) and is the
        mean: a ReduceMean, or a ReduceSum divided by exactly the number of elements it sums.

        Raises:
            CannotFuse: ``different_axes``, ``wrong_mean_divisor``, or a code of
                :func:`reduced_trailing` and :func:`_count`.
        """
        if reduced_trailing(self.reduce, rank) != k:
            raise CannotFuse(
                Code.DIFFERENT_AXES, "the mean and the variance reduce over different axes"
            )
        count = _count(self.reduce, dims)
        if not _is_one(self.factor * count):
            divisor = f"{1 / self.factor:.7g}" if self.factor else "0"
            raise CannotFuse(
                Code.WRONG_MEAN_DIVISOR,
                f"{self.reduce.op_type} '{self.reduce.name}' over {count} element(s) is divided "
                f"by {divisor}: x minus that is not x minus its mean (the mean divides the sum "
                f"by {count})",
            )


def centered(value: ir.Value) -> Centering | None:
    """The centering when ``value = Sub(x, f * Reduce(x))`` (see :class:`Centering`), maybe
    followed by a Cast to the type of ``x`` (a no-op, kept by old files whose intermediate
    types are not recorded); None otherwise."""
    cast = producer(value, "Cast")
    if cast is not None:
        value = cast.inputs[0]
    sub = producer(value, "Sub")
    if sub is None:
        return None
    x, mean = sub.inputs
    chain: list[ir.Node] = []
    factor = 1.0
    while (node := mean.producer() if mean is not None else None) is not None:
        if (step := _scalar_step(node)) is None:
            break
        mean, c = step
        factor *= c
        chain.insert(0, node)
    if node is None or node.op_type not in REDUCTIONS or node.domain != "":
        return None
    if node.inputs[0] is not x:
        return None
    if cast is not None and (x.dtype is None or cast.attributes.get_int("to") != x.dtype):
        return None
    return Centering(x, node, factor, [node, *chain, sub, *([cast] if cast is not None else [])])


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


def _absent_eps(core: MeanSquare, x: ir.Value) -> np.ndarray:
    """eps 0 in the type the norm computes in (that of ``x``, or of the mean square).

    Raises:
        CannotFuse: ``unsupported_dtype``: the type is not recorded.
    """
    values = (x, core.value, core.reduce.outputs[0])
    dtype = next((v.dtype for v in values if v.dtype is not None), None)
    if dtype is None:
        raise CannotFuse(
            Code.UNSUPPORTED_DTYPE,
            "the norm has no eps and its type is not recorded: cannot tell that it is float32",
        )
    return np.zeros((), dtype.numpy())


def check_core(core: MeanSquare, x: ir.Value, rank: int | None) -> int:
    """The checks LayerNorm and RMSNorm share; return ``k``, the number of normalized axes.

    Completes ``core``: ``eps`` becomes 0 where there is none, and a mean square written as a
    sum gets the number of elements summed into ``factor`` (a factor within a few float32
    roundings of 1 becomes exactly 1).

    Raises:
        CannotFuse: ``not_constant`` / ``eps_not_scalar`` (eps is not a one-element
            constant), the codes of :func:`reduced_trailing`, :func:`_check_restored` and
            :func:`_count`, ``factor_not_positive``, ``unsupported_dtype`` (the norm is not in
            float32).
    """
    if core.no_eps:
        core.eps = _absent_eps(core, x)
    if core.eps is None and not core.eps_constant:
        raise CannotFuse(Code.NOT_CONSTANT, "eps is not a constant: it cannot become an attribute")
    if core.eps is None:
        raise CannotFuse(
            Code.EPS_NOT_SCALAR, "eps is not a one-element constant: it cannot become an attribute"
        )
    k = reduced_trailing(core.reduce, rank, restored=bool(core.restores))
    _check_restored(core, x, k)
    core.factor *= _count(core.reduce, normalized_dims(k, x, core.value))
    if _is_one(core.factor):
        core.factor = 1.0
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


def weight_first(numerator: ir.Value) -> tuple[ir.Value, ir.Node, ir.Value, np.ndarray] | None:
    """``(v, mul, w, array)`` when ``numerator = Mul(w, v)`` (either operand order) with ``w`` a
    float32 constant and ``v`` not one: the weight applied before the division, in the
    tutorials' order ``g * (x - m) / sqrt(var + eps)``; ``w * v / s = (v / s) * w``."""
    mul = producer(numerator, "Mul")
    if mul is None or len(mul.inputs) != 2:
        return None
    for value, weight in (mul.inputs, mul.inputs[::-1]):
        array = const_array(weight)
        if array is not None and array.dtype == FLOAT.numpy() and const_array(value) is None:
            return value, mul, weight, array
    return None


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
        shared: intermediate values that other norms of the same pass read too (see
            :class:`NormFusionPass`).
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
    shared: list[ir.Value] = dataclasses.field(default_factory=list)

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

    def take_weight(self, found: tuple, rank: int | None) -> None:
        """Take the weight of :func:`weight_first` (``found``), applied before the division
        (the caller lists its Mul among :attr:`nodes`).

        Raises:
            CannotFuse: ``axis_not_normalized``: it varies along an axis that is not normalized
                (it cannot become the Scale, and it multiplies before the fused op would).
        """
        _, _, operand, array = found
        param = affine_param(array, self.k, rank, self.dims)
        if param is None:
            raise CannotFuse(
                Code.AXIS_NOT_NORMALIZED,
                f"the weight of shape {list(array.shape)} multiplies before the division and "
                "varies along an axis that is not normalized: no Scale of the fused op",
            )
        self.weight = (operand, param)

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


#: What a rewrite with epsilon 0 became says this after the op's name (the note says more).
NO_EPS = "epsilon 0: the file's norm has no eps (or eps 0), see the note"


def no_eps_note(norm: str, row: str) -> str:
    """The report's note for a ``norm`` (``"LayerNorm"``, ``"RMSNorm"``) fused with epsilon 0,
    which gives NaN on ``row`` (a constant row, a row of zeros): why, and the fix."""
    return (
        f"a {norm} with no eps (or eps 0) was fused with epsilon=0, which keeps the file's "
        f"function: it gives NaN on {row}. torch.onnx.export's own optimizer (on by default) "
        "removes an eps of 1e-8 or less as if it were 0; export from the PyTorch file through "
        "normexport, or with torch.onnx.export(..., optimize=False)"
    )


def _outside_readers(value: ir.Value, inside: set[ir.Node]) -> bool:
    """Whether ``value`` is a graph output or read by a node not in ``inside``."""
    return value.is_graph_output() or any(use.node not in inside for use in value.uses())


class NormFusionPass(NodeFusionPass):
    """A :class:`~fusion.base.NodeFusionPass` whose norms may share intermediate values.

    Two norms of one input with different eps (or an RMSNorm and a scaled copy) compute the
    same ``x - mean(x)``, square and variance; common-subexpression elimination makes them one
    value. Each fused node computes its norm from ``x`` again, so a shared value blocks nothing
    when every reader of it belongs to a norm that is fused too: it goes once the last of them
    is. :meth:`apply` first matches every candidate without rewriting (a plan), drops until
    nothing changes those that share a value with a node no kept candidate covers, then runs
    the base pass, whose :meth:`match` calls :meth:`check_shared`.
    """

    _fusing: set[ir.Node] | None = None

    def apply(self, model: ir.Model) -> bool:
        """Plan (:meth:`_plan`), then fuse as :meth:`NodeFusionPass.apply` does."""
        self._fusing = self._plan(model)
        try:
            return super().apply(model)
        finally:
            self._fusing = None

    def _plan(self, model: ir.Model) -> set[ir.Node]:
        """The nodes of the candidates that can all be fused together (see the class)."""
        outcomes, self.outcomes, self._fusing = self.outcomes, FusionReport(), None
        matches = []
        try:
            for node in list(model.graph):
                if label(node) in self.excluded:
                    continue
                try:
                    found = self.match(model, node)
                except CannotFuse:
                    continue
                if found is not None:
                    matches.append(found)
        finally:
            self.outcomes = outcomes
        while True:
            covered = {n for m in matches for n in m.nodes}
            kept = [m for m in matches if not any(_outside_readers(v, covered) for v in m.shared)]
            if len(kept) == len(matches):
                return covered
            matches = kept

    def check_shared(self, nodes: list[ir.Node], keep: ir.Value, what: str) -> list[ir.Value]:
        """The outputs of ``nodes`` other than ``keep`` that are read outside them.

        While planning every such value is allowed (and returned, for :attr:`NormMatch.shared`);
        then only those whose readers all belong to planned norms.

        Raises:
            CannotFuse: ``shared_output``: a value is a graph output or read by a node that no
                norm being fused covers.
        """
        inside = set(nodes)
        shared = [
            v for n in nodes for v in n.outputs if v is not keep and _outside_readers(v, inside)
        ]
        if self._fusing is None:
            return shared
        for value in shared:
            if _outside_readers(value, self._fusing | inside):
                others = (u.node for u in value.uses() if u.node not in self._fusing | inside)
                reader = next(others, None)
                where = f"by '{label(reader)}'" if reader is not None else "as a graph output"
                raise CannotFuse(
                    Code.SHARED_OUTPUT,
                    f"{value.name} is also read outside the {what} subgraph ({where}), not only "
                    "by other norms being fused",
                )
        return shared
