"""The core LayerNorm and RMSNorm share, found and checked.

:func:`match_mean_square` finds the denominator ``sqrt(f * mean_A(v * v) + eps)``
(:class:`MeanSquare`), :func:`match_eps_outside_sqrt` the form with eps outside the root (a
refusal), :func:`centered` the centering ``x - mean_A(x)`` of LayerNorm (:class:`Centering`),
and :func:`check_core` what both passes require of the core: eps a one-element constant, the
mean over the trailing axes (:mod:`fusion.norm_match.axes`), a positive factor, a type of
:data:`NORM_TYPES`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array, producer, scalar_const
from fusion.base import CannotFuse, Code
from fusion.norm_match.axes import is_one, normalized_dims, reduced_trailing, summed_count
from fusion.norm_match.restored import check_restores

FLOAT = ir.DataType.FLOAT

#: The types a norm may compute in and be fused: float32, and the half types whose fused op
#: computes the statistics in float32 (``stash_type=1``; docs/fusions/fuse_layernorm.md).
NORM_TYPES = (FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

#: The reductions a mean may be written with: ``ReduceMean``, ``GlobalAveragePool`` (the mean
#: over every axis after the first two, :func:`fusion._ir.reduce_axes`), or ``ReduceSum`` times
#: a constant.
REDUCTIONS = ("ReduceMean", "GlobalAveragePool", "ReduceSum")


def square_of(value: ir.Value) -> tuple[ir.Value, ir.Node] | None:
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
        mean: where the variance is written from the moments, ``E[v^2] - E[v]^2``
            (:mod:`fusion.norm_match.moments`), ``E[v]`` as a :class:`Centering` (its
            reduction and scalar steps, no Sub); None otherwise.
    """

    value: ir.Value
    reduce: ir.Node
    eps: np.ndarray | None
    factor: float
    restores: list[ir.Node]
    nodes: list[ir.Node]
    eps_constant: bool = False
    no_eps: bool = False
    mean: Centering | None = None

    @property
    def dtype(self) -> ir.DataType:
        """The type the norm computes in: that of its eps (set by :func:`check_core`)."""
        return ir.DataType.from_numpy(self.eps.dtype)

    def take_eps(self, eps: ir.Value) -> None:
        """Record ``eps``, the value added under the root: its number where it is a
        one-element constant (:attr:`eps`), and whether it is a constant at all."""
        array = const_array(eps)
        self.eps = array.reshape(()) if array is not None and array.size == 1 else None
        self.eps_constant = array is not None


def scaled_mean_square(value: ir.Value) -> MeanSquare | None:
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
            square = square_of(node.inputs[0])
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
    return under_sqrt(den, match_radicand)


def under_sqrt(den: ir.Value, radicand) -> MeanSquare | None:
    """``radicand(v)`` (a matcher of what is under the root) where ``den = Sqrt(v)``, with the
    Sqrt among its nodes; None otherwise."""
    sqrt = producer(den, "Sqrt")
    found = radicand(sqrt.inputs[0]) if sqrt is not None else None
    if found is not None:
        found.nodes.append(sqrt)
    return found


def match_radicand(value: ir.Value) -> MeanSquare | None:
    """Match what is under the root: ``Add(f * ReduceMean(square(v)), eps)``, or ``f *
    ReduceMean(square(v))`` with no eps (:func:`match_mean_square` without the ``Sqrt``; a
    ``Pow(., -0.5)`` takes the root itself: :mod:`fusion.norm_match.folded`)."""
    found = scaled_mean_square(value)
    if found is not None:
        found.no_eps = True
        return found
    add = producer(value, "Add")
    if add is None:
        return None
    first, second = add.inputs
    found, eps = scaled_mean_square(first), second
    if found is None:
        found, eps = scaled_mean_square(second), first
    if found is None:
        return None
    found.take_eps(eps)
    found.nodes.append(add)
    return found


def match_eps_outside_sqrt(den: ir.Value) -> ir.Value | None:
    """``v`` when ``den = Add(Sqrt(f * ReduceMean(square(v))), constant)``: eps outside the root."""
    add = producer(den, "Add")
    if add is None:
        return None
    for root, eps in (add.inputs, add.inputs[::-1]):
        sqrt = producer(root, "Sqrt")
        found = scaled_mean_square(sqrt.inputs[0]) if sqrt is not None else None
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
        restores: Reshape / Expand nodes that put back the axes a ``keepdims=0`` mean dropped
            (between the mean and the Sub, or those the variance from the moments goes
            through), in graph order; :meth:`require_mean` checks them.
    """

    x: ir.Value
    reduce: ir.Node
    factor: float
    nodes: list[ir.Node]
    restores: list[ir.Node] = dataclasses.field(default_factory=list)

    @property
    def mean(self) -> ir.Value:
        """The mean's value: the output of the last scalar step after the reduction (of the
        reduction itself where there is none)."""
        steps = [
            n for n in self.nodes if n.op_type not in ("Sub", "Cast") and n not in self.restores
        ]
        return steps[-1].outputs[0]

    def require_mean(self, k: int, rank: int | None, dims: tuple[int | None, ...]) -> None:
        """Require that the mean is over the ``k`` normalized axes (of sizes ``dims``) and is the
        mean: a ReduceMean, or a ReduceSum divided by exactly the number of elements it sums.

        Raises:
            CannotFuse: ``different_axes``, ``wrong_mean_divisor``, or a code of
                :func:`~fusion.norm_match.axes.reduced_trailing`,
                :func:`~fusion.norm_match.restored.check_restores` and
                :func:`~fusion.norm_match.axes.summed_count`.
        """
        if reduced_trailing(self.reduce, rank, restored=bool(self.restores)) != k:
            raise CannotFuse(
                Code.DIFFERENT_AXES, "the mean and the variance reduce over different axes"
            )
        check_restores(self.restores, self.reduce, self.x, k)
        count = summed_count(self.reduce, dims)
        if not is_one(self.factor * count):
            divisor = f"{1 / self.factor:.7g}" if self.factor else "0"
            raise CannotFuse(
                Code.WRONG_MEAN_DIVISOR,
                f"{self.reduce.op_type} '{self.reduce.name}' over {count} element(s) is divided "
                f"by {divisor}: x minus that is not x minus its mean (the mean divides the sum "
                f"by {count})",
            )


def scaled_reduction(value: ir.Value) -> tuple[ir.Node, float, list[ir.Node]] | None:
    """``(reduce, f, steps)`` when ``value = f * Reduce(v)`` through scalar Mul / Div steps
    (``ReduceMean``, or ``ReduceSum`` divided by a constant; :data:`REDUCTIONS`), the steps in
    graph order; None otherwise."""
    steps: list[ir.Node] = []
    factor = 1.0
    while (node := value.producer() if value is not None else None) is not None:
        if (step := _scalar_step(node)) is None:
            break
        value, c = step
        factor *= c
        steps.insert(0, node)
    if node is None or node.op_type not in REDUCTIONS or node.domain != "":
        return None
    return node, factor, steps


def restored(value: ir.Value | None) -> tuple[ir.Value | None, list[ir.Node]]:
    """``(v, nodes)``: ``value`` followed up through Reshape / Expand nodes (their data input)
    to ``v``, ``nodes`` those nodes in graph order (none where ``value`` is no such output)."""
    nodes: list[ir.Node] = []
    while (node := producer(value, "Reshape") or producer(value, "Expand")) is not None:
        nodes.insert(0, node)
        value = node.inputs[0]
    return value, nodes


def centered(value: ir.Value, *, restores: bool = False) -> Centering | None:
    """The centering when ``value = Sub(x, f * Reduce(x))`` (see :class:`Centering`), maybe
    followed by a Cast to the type of ``x`` (a no-op, kept by old files whose intermediate
    types are not recorded); with ``restores``, the mean may go through Reshape / Expand nodes
    before the Sub (:attr:`Centering.restores`, for the caller to check). None otherwise."""
    cast = producer(value, "Cast")
    if cast is not None:
        value = cast.inputs[0]
    sub = producer(value, "Sub")
    if sub is None:
        return None
    x, mean = sub.inputs
    mean, chain = restored(mean) if restores else (mean, [])
    found = scaled_reduction(mean)
    if found is None or found[0].inputs[0] is not x:
        return None
    if cast is not None and (x.dtype is None or cast.attributes.get_int("to") != x.dtype):
        return None
    node, factor, steps = found
    nodes = [node, *steps, *chain, sub, *([cast] if cast is not None else [])]
    return Centering(x, node, factor, nodes, chain)


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
            constant), the codes of :func:`~fusion.norm_match.axes.reduced_trailing`,
            :func:`~fusion.norm_match.restored.check_restores` and
            :func:`~fusion.norm_match.axes.summed_count`,
            ``factor_not_positive``, ``unsupported_dtype`` (the norm computes in a type
            other than float32, float16 or bfloat16: :data:`NORM_TYPES`).
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
    check_restores(core.restores, core.reduce, x, k)
    core.factor *= summed_count(core.reduce, normalized_dims(k, x, core.value))
    if is_one(core.factor):
        core.factor = 1.0
    if not (math.isfinite(core.factor) and core.factor > 0):
        raise CannotFuse(
            Code.FACTOR_NOT_POSITIVE,
            f"the mean square is multiplied by {core.factor:g}: only a positive factor can move "
            "into epsilon and the scale",
        )
    if core.eps.dtype not in [t.numpy() for t in NORM_TYPES]:
        raise CannotFuse(
            Code.UNSUPPORTED_DTYPE,
            f"computes in {core.eps.dtype}: only float32, float16 and bfloat16 norms are fused "
            "(the fused op with stash_type=1 computes in float32, a different function)",
        )
    return k
