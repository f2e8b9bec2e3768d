"""Fuse a hand-written LayerNorm into one ``LayerNormalization`` node (ONNX opset 17 and up).

The math
--------
Layer normalization (Ba, Kiros & Hinton 2016) over the trailing axes ``A = (r-k, ..., r-1)``
of an input ``x`` of rank ``r``::

    mu  = mean_A(x)
    d   = x - mu
    var = mean_A(d * d)                      (the biased variance)
    y   = d / sqrt(var + eps) * w + b

ONNX ``LayerNormalization`` (opset 17, onnx/docs/Operators.md#LayerNormalization) is defined
as the function ``Normalized = Mul(D, Reciprocal(Sqrt(Add(ReduceMean(Mul(D, D)), epsilon))))``,
``Y = Add(Mul(Normalized, Scale), B)`` with ``D = Sub(X, ReduceMean(X))``, both means over
``[axis, ..., r-1]``, computed in float32 under ``stash_type=1``. With ``axis = -k``,
``Scale = w``, ``B = b`` and ``epsilon`` the model's own float32 eps constant, that is the
subgraph above, up to float rounding (one division becomes a reciprocal and a product).

Spellings accepted (as the dynamo and TorchScript exporters write them after
:func:`fusion.cleanup.cleanup` has merged the two copies of ``x - mean``)::

    square       Pow(d, 2) | Mul(d, d)
    divide       Div(d, den) | Mul(d, Reciprocal(den)) | Mul(d, Div(1, den))
    den          Sqrt(Add(var, eps)), eps a one-element float32 constant (either Add order)
    after        [Cast to float32 (a no-op)] [Mul by constant w] [Add of constant b]
                 (either operand order; w and b may vary along the normalized axes only)

Before and after::

    x ─ ReduceMean ─┐
    x ────────────── Sub ─ d ─ Pow(., 2) ─ ReduceMean ─ Add(eps) ─ Sqrt ─┐
                           d ─────────────────────────────────────────── Div ─ Mul(w) ─ Add(b) ─ y

    x ─ LayerNormalization(x, w, b; axis=-k, epsilon=eps, stash_type=1) ─ y

Left intact, with the reason in the report: a model whose opset has no LayerNormalization
(below 17); means over axes that are not the trailing axes of ``x``, or over different axes for
the mean and the variance; an intermediate value read outside the subgraph; a non-constant eps;
a norm computed in a type other than float32; ``eps`` added outside the square root
(``d / (sqrt(var) + eps)`` is a different function). A weight or bias that varies along an axis
that is not normalized stays a separate ``Mul`` / ``Add`` after the fused node (reported).

The public helpers here (everything but :class:`FuseLayerNorm`) are shared with
:mod:`fusion.fuse_rmsnorm`: RMSNorm is this computation without the centering.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    add_initializer,
    as_division,
    const_array,
    escaping_value,
    opset_version,
    other_input,
    rank_of,
    reduce_axes,
    remove_nodes,
    replace_output,
    scalar_const,
    sole_consumer,
)
from fusion.report import FusionReport

FLOAT = ir.DataType.FLOAT


class NormRefused(Exception):
    """A norm candidate that cannot be fused exactly; ``args[0]`` is the reason for the report."""


def producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The standard-domain node of type ``op_type`` that produces ``value``, or None."""
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _square_of(value: ir.Value) -> tuple[ir.Value, ir.Node] | None:
    """``(v, node)`` when ``value`` is ``Pow(v, 2)`` or ``Mul(v, v)``."""
    node = producer(value, "Pow")
    if node is not None and scalar_const(node.inputs[1]) == 2.0:
        return node.inputs[0], node
    node = producer(value, "Mul")
    if node is not None and node.inputs[0] is node.inputs[1]:
        return node.inputs[0], node
    return None


def _mean_square_of(value: ir.Value) -> tuple[ir.Value, ir.Node, ir.Node] | None:
    """``(v, square, reduce)`` when ``value`` is ``ReduceMean(square(v))``."""
    reduce = producer(value, "ReduceMean")
    square = _square_of(reduce.inputs[0]) if reduce is not None else None
    return None if square is None else (square[0], square[1], reduce)


@dataclasses.dataclass
class MeanSquare:
    """``den = Sqrt(Add(ReduceMean(square(v)), eps))``: the core that LayerNorm and RMSNorm share.

    Attributes:
        value: ``v``, the tensor whose mean square is taken.
        reduce: the ReduceMean node (its axes and keepdims are the norm's).
        eps: the eps constant as a 0-d array of its own dtype (the dtype the norm computes in),
            or None when it is not a one-element constant (the caller refuses).
        nodes: the square, ReduceMean, Add and Sqrt nodes.
    """

    value: ir.Value
    reduce: ir.Node
    eps: np.ndarray | None
    nodes: list[ir.Node]


def match_mean_square(den: ir.Value) -> MeanSquare | None:
    """Match ``den = Sqrt(Add(ReduceMean(square(v)), eps))``.

    Returns:
        The match, or None when ``den`` is not of that form (no norm candidate at all).
    """
    sqrt = producer(den, "Sqrt")
    add = producer(sqrt.inputs[0], "Add") if sqrt is not None else None
    if add is None:
        return None
    first, second = add.inputs
    found, eps = _mean_square_of(first), second
    if found is None:
        found, eps = _mean_square_of(second), first
    if found is None:
        return None
    value, square, reduce = found
    eps_array = const_array(eps)
    eps_array = eps_array.reshape(()) if eps_array is not None and eps_array.size == 1 else None
    return MeanSquare(value, reduce, eps_array, [square, reduce, add, sqrt])


def match_eps_outside_sqrt(den: ir.Value) -> ir.Value | None:
    """``v`` when ``den = Add(Sqrt(ReduceMean(square(v))), constant)``: eps outside the root."""
    add = producer(den, "Add")
    if add is None:
        return None
    for root, eps in (add.inputs, add.inputs[::-1]):
        sqrt = producer(root, "Sqrt")
        found = _mean_square_of(sqrt.inputs[0]) if sqrt is not None else None
        if found is not None and const_array(eps) is not None:
            return found[0]
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


def reduced_trailing(reduce: ir.Node, rank: int | None) -> int:
    """``k`` for a ReduceMean over the last k axes with keepdims=1.

    Raises:
        NormRefused: the axes are not constant, not trailing, or the reduction drops them.
    """
    axes = reduce_axes(reduce, rank)
    if axes is None:
        raise NormRefused(f"{reduce.name} reduces over axes that are not constant")
    if reduce.attributes.get_int("keepdims", 1) != 1:
        raise NormRefused(f"{reduce.name} has keepdims=0: not a per-row statistic")
    k = trailing_axes(axes, rank)
    if k is None:
        where = f"a rank-{rank} input" if rank is not None else "an input of unknown rank"
        raise NormRefused(
            f"mean over axes {list(axes)} of {where}: the fused op normalizes the trailing "
            "axes only"
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


def label(node: ir.Node) -> str:
    """A name for ``node`` in the report: its name, else its first output's name."""
    return node.name or (node.outputs[0].name if node.outputs else "") or node.op_type


@dataclasses.dataclass
class _LayerNorm:
    """A matched LayerNorm: ``x``, what replaces it, and the nodes it covers."""

    x: ir.Value
    k: int
    dims: tuple[int | None, ...]
    eps: float
    nodes: list[ir.Node]
    output: ir.Value
    scale: ir.Value | None = None
    bias: ir.Value | None = None


class FuseLayerNorm(ir.passes.InPlacePass):
    """Replace each hand-written LayerNorm in the main graph by one ``LayerNormalization``.

    Every rewrite is counted as ``"layernorm_fused"`` in the report; every candidate that looks
    like a LayerNorm but cannot be fused exactly is left intact and recorded as a ``"layernorm"``
    refusal with its reason (see the module docstring).
    """

    def __init__(self, report: FusionReport):
        """Args: report: where fusions and refusals are recorded (shared between passes)."""
        super().__init__()
        self.report = report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Fuse every LayerNorm that can be fused exactly; return whether the model changed."""
        graph = model.graph
        modified = False
        for node in list(graph):
            if node.graph is not graph:  # removed by an earlier fusion
                continue
            try:
                match = self._match(model, node)
            except NormRefused as refusal:
                self.report.refuse("layernorm", label(node), refusal.args[0])
                continue
            if match is not None:
                self._rewrite(graph, match)
                self.report.record("layernorm_fused", label(node), "LayerNormalization")
                modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _match(self, model: ir.Model, node: ir.Node) -> _LayerNorm | None:
        """Walk up from ``node`` (the division) to ``x``, then down through the affine part."""
        division = as_division(node)
        if division is None:
            return None
        numerator, den, inverse = division
        outside = match_eps_outside_sqrt(den)
        if outside is not None and centered(outside) is not None:
            raise NormRefused(
                "eps outside the square root: (x - mean) / (sqrt(var) + eps) is not a "
                "LayerNormalization, which adds eps to the variance"
            )
        core = match_mean_square(den)
        found = centered(core.value) if core is not None else None
        if found is None:
            return None  # not a norm, or an RMSNorm (FuseRMSNorm's business)
        x, mean, sub = found
        if numerator is not core.value:
            raise NormRefused("divides a tensor other than x - mean(x) by the standard deviation")
        if core.eps is None:
            raise NormRefused("eps is not a one-element constant: it cannot become an attribute")
        rank = rank_of(x, core.value, node.outputs[0])
        k = reduced_trailing(mean, rank)
        if reduced_trailing(core.reduce, rank) != k:
            raise NormRefused("the mean and the variance reduce over different axes")
        if core.eps.dtype != FLOAT.numpy():
            raise NormRefused(
                f"computes in {core.eps.dtype}: only float32 norms are fused (LayerNormalization "
                "with stash_type=1 computes in float32)"
            )
        nodes = [mean, sub, *core.nodes, *inverse, node]
        escaping = escaping_value(nodes, node.outputs[0])
        if escaping is not None:
            raise NormRefused(f"{escaping.name} is also read outside the LayerNorm subgraph")
        opset = opset_version(model)
        if opset < 17:
            raise NormRefused(f"opset {opset} has no LayerNormalization (needs 17)")
        dims = normalized_dims(k, x, core.value, node.outputs[0])
        match = _LayerNorm(x, k, dims, float(core.eps), nodes, node.outputs[0])
        self._absorb_affine(model.graph, match, rank)
        return match

    def _absorb_affine(self, graph: ir.Graph, match: _LayerNorm, rank: int | None) -> None:
        """Extend ``match`` over a no-op Cast, a constant weight Mul and a constant bias Add."""
        cast = sole_consumer(match.output)
        if (
            cast is not None
            and cast.op_type == "Cast"
            and cast.domain == ""
            and cast.attributes.get_int("to") == FLOAT
        ):
            match.nodes.append(cast)
            match.output = cast.outputs[0]
        for op_type, what in (("Mul", "weight"), ("Add", "bias")):
            found = absorb_const(match.output, op_type, FLOAT)
            if found is None:
                continue
            node, operand, array = found
            param = affine_param(array, match.k, rank, match.dims)
            if param is None:
                self.report.refuse(
                    "layernorm",
                    label(node),
                    f"{what} of shape {list(array.shape)} varies along an axis that is not "
                    f"normalized: kept as a separate {op_type} after the LayerNormalization",
                )
                return
            value = param_value(graph, operand, param, f"{label(node)}_{what}")
            setattr(match, "scale" if what == "weight" else "bias", value)
            match.nodes.append(node)
            match.output = node.outputs[0]

    def _rewrite(self, graph: ir.Graph, match: _LayerNorm) -> None:
        """Insert the LayerNormalization, move the readers over, drop the old nodes."""
        if match.scale is None:
            ones = np.ones([d if d is not None else 1 for d in match.dims], dtype=np.float32)
            match.scale = add_initializer(graph, f"{label(match.nodes[-1])}_scale", ones)
        inputs = [match.x, match.scale] + ([match.bias] if match.bias is not None else [])
        fused = ir.node(
            "LayerNormalization",
            inputs,
            {"axis": -match.k, "epsilon": match.eps, "stash_type": 1},
            name=f"{label(match.nodes[-1])}_LayerNormalization",
        )
        graph.insert_before(match.nodes[-1], fused)
        replace_output(graph, match.output, fused.outputs[0])
        remove_nodes(graph, match.nodes)
