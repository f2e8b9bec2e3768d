"""A matched norm and what its fused node needs (:class:`NormMatch`).

The match is extended over what follows the norm: a no-op Cast or a half-precision round trip
(:meth:`NormMatch.absorb_casts`), constant weight and bias ops whose constants vary along the
normalized axes only (:meth:`NormMatch.absorb_affine`, :func:`affine_param`), or a weight
applied before the division (:func:`weight_first`). :meth:`NormMatch.scale` and
:attr:`NormMatch.epsilon` move the mean square's factor into the fused op, and
:meth:`NormMatch.replace` puts the fused node in place. A norm with no eps is fused with
epsilon 0 and says so (:data:`NO_EPS`, :func:`no_eps_note`).
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
    remove_nodes,
    replace_output,
    sole_consumer,
)
from fusion.base import CannotFuse, Code, FusionPass
from fusion.norm_match.core import FLOAT, NORM_TYPES

#: Types whose round trip through float32 around a norm becomes one fused op on them.
HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

#: The types ONNX Runtime's CPU provider runs each fused norm op in (1.31, asked by opening a
#: session on each: tests/fusion/test_half_norms_graphs.py). RMSNormalization has no
#: bfloat16 kernel: ORT expands it into its function body, whose Mul has none.
ORT_CPU_TYPES = {
    "LayerNormalization": (FLOAT, *HALF_TYPES),
    "SimplifiedLayerNormalization": (FLOAT, *HALF_TYPES),
    "RMSNormalization": (FLOAT, ir.DataType.FLOAT16),
}


def require_kernel(op_type: str, dtype: ir.DataType) -> None:
    """Require that ONNX Runtime's CPU provider runs ``op_type`` in ``dtype``
    (:data:`ORT_CPU_TYPES`).

    Raises:
        CannotFuse: ``no_ort_kernel``.
    """
    if dtype not in ORT_CPU_TYPES[op_type]:
        raise CannotFuse(
            Code.NO_ORT_KERNEL,
            f"ONNX Runtime's CPU provider has no {dtype.name.lower()} kernel for {op_type} "
            "(it expands the op into its function body, which has none either): the norm "
            "stays as written",
        )


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
    constant of a norm's type (:data:`~fusion.norm_match.core.NORM_TYPES`) and ``v`` not one:
    the weight applied before the division, in the tutorials' order ``g * (x - m) / sqrt(var +
    eps)``; ``w * v / s = (v / s) * w``."""
    mul = producer(numerator, "Mul")
    if mul is None or len(mul.inputs) != 2:
        return None
    types = [t.numpy() for t in NORM_TYPES]
    for value, weight in (mul.inputs, mul.inputs[::-1]):
        array = const_array(weight)
        if array is not None and array.dtype in types and const_array(value) is None:
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
        dtype: the type of ``x``, ``Scale`` and ``B``: the type the norm computes in
            (float32, float16, bfloat16), or float16 / bfloat16 when a round trip through
            float32 was absorbed.
        weight, bias: the absorbed constants, ``(value, array over the normalized axes)``.
        shared: intermediate values that other norms of the same pass read too (see
            :class:`~fusion.norm_match.NormFusionPass`).
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
        where = "multiplies before the division"
        self.weight = (operand, self._param(array, rank, "weight", where, "Scale"))

    def take_bias(self, beta: ir.Value, rank: int | None) -> None:
        """Take ``beta``, the constant a batch-norm-style shift adds
        (:func:`~fusion.norm_match.folded.subtracted_mean`), as the bias.

        Raises:
            CannotFuse: ``axis_not_normalized``: it varies along an axis that is not
                normalized (no B of the fused op).
        """
        array = const_array(beta)
        where = "is added with the mean subtracted"
        self.bias = (beta, self._param(array, rank, "bias", where, "B"))

    def _param(self, array: np.ndarray, rank: int | None, what: str, where: str, input_name: str):
        """``array`` over the normalized axes (:func:`affine_param`).

        Raises:
            CannotFuse: ``axis_not_normalized``, naming ``what`` and ``where`` it is applied.
        """
        param = affine_param(array, self.k, rank, self.dims)
        if param is None:
            raise CannotFuse(
                Code.AXIS_NOT_NORMALIZED,
                f"the {what} of shape {list(array.shape)} {where} and varies along an axis "
                f"that is not normalized: no {input_name} of the fused op",
            )
        return param

    def absorb_casts(self) -> None:
        """Extend over a no-op Cast after the norm (to its own type), or a half-precision round
        trip around a float32 norm.

        The round trip is ``Cast(x16, float32)`` before and ``Cast(float16)`` after (or
        bfloat16 both times), with nothing else reading the float32 values: the fused op then
        takes ``x16`` with ``stash_type=1`` (docs/fusions/fuse_layernorm.md).
        """
        cast = sole_consumer(self.output)
        if cast is None or cast.op_type != "Cast" or cast.domain != "":
            return
        to = cast.attributes.get_int("to")
        upcast = producer(self.x, "Cast")
        source = upcast.inputs[0] if upcast is not None else None
        if to == self.dtype:
            self.nodes.append(cast)
        elif (
            self.dtype == FLOAT
            and source is not None
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
        "removes an eps of 1e-8 or less as if it were 0; export from the PyTorch file again "
        "with that optimizer off: torch.onnx.export(..., optimize=False)"
    )
