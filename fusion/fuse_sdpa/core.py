"""The scaled dot-product attention core around a Softmax, however it was decomposed
(:mod:`fusion.fuse_sdpa`): the weights' product with ``V``, the scores' scale, mask and bias,
and ``Q`` and ``K`` as ``Attention`` takes them. The forms read: see docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    const_array,
    dims,
    producer,
    same_dim,
    same_shape,
    scalar_const,
    sole_consumer,
)
from fusion.base import CannotFuse, Code
from fusion.fuse_gqa import core as gqa_core
from fusion.fuse_sdpa import scales
from fusion.fuse_sdpa.codes import SDPACode

#: The ops between ``Q @ K^T`` and the Softmax that the scores are parsed through.
_CHAIN = ("Add", "Mul", "Div", "Where", "Reshape")

#: The ops a Softmax's input may come through from a MatMul for the Softmax to be an
#: attention's (a candidate): :data:`_CHAIN`, and what else scores go through (Gemma 2's
#: soft-capping ``Tanh``, a ``Cast``; the views of an Einsum decomposed by tf2onnx that
#: :mod:`fusion.simplify.batched` could not read), which the parser refuses, naming the op.
_TOWARDS = (*_CHAIN, "Tanh", "Cast", "Sub", "Neg", "Clip", "Transpose", "Squeeze", "Unsqueeze")
#: The ops a Softmax's output may go through to the MatMul that reads it, for a candidate.
_TO_VALUES = ("IsNaN", "Where", "Transpose", "Cast", "Unsqueeze", "Reshape", "Squeeze")


@dataclasses.dataclass
class Operand:
    """``K`` or ``V`` as ``Attention`` takes it: ``source``, ``Transpose(source, perm)``, or
    ``Reshape(source, shape)`` (a static shape that splits or merges the leading axes only)."""

    source: ir.Value
    perm: tuple[int, ...] | None
    nodes: list[ir.Node] = dataclasses.field(default_factory=list)
    shape: tuple[int, ...] | None = None


@dataclasses.dataclass
class Scores:
    """The Softmax's input parsed: ``factor * heads * (Q @ K^T)`` with its mask.

    Attributes:
        matmul: ``Q @ K^T``.
        factor: the constant scale on it.
        heads: the constant scale of each head on it (float64, of a shape that is 1 but in
            the heads' axis, the third from last, :func:`.scales.per_head`), or None.
        terms: the values added to the scores (outside a view).
        where: the ``Where`` of a boolean mask, or None.
        view: the terms added through a view of the scores, ``(terms, reshape in, reshape
            back)``, or None.
        nodes: the nodes from the MatMul to the Softmax's input.
    """

    matmul: ir.Node | None = None
    factor: float = 1.0
    terms: list[ir.Value] = dataclasses.field(default_factory=list)
    where: ir.Node | None = None
    view: tuple[list[ir.Value], ir.Node, ir.Node] | None = None
    nodes: list[ir.Node] = dataclasses.field(default_factory=list)
    heads: np.ndarray | None = None

    @property
    def scaled(self) -> bool:
        """Whether a scale was found (a mask added under it would be scaled with the scores)."""
        return self.factor != 1.0 or self.heads is not None


def swap(rank: int) -> tuple[int, ...]:
    """The Transpose ``perm`` that swaps the last two of ``rank`` axes."""
    return (*range(rank - 2), rank - 1, rank - 2)


def _reaches_matmul(value: ir.Value | None, ops=_CHAIN, depth: int = 8) -> bool:
    """Whether ``value`` is computed from a MatMul through ``ops`` on it."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "" or depth == 0:
        return False
    if node.op_type == "MatMul":
        return True
    if node.op_type not in ops:
        return False
    inputs = node.inputs[:1] if node.op_type == "Reshape" else node.inputs
    return any(_reaches_matmul(v, ops, depth - 1) for v in inputs if scalar_const(v) is None)


def is_candidate(softmax: ir.Node) -> bool:
    """Whether ``softmax`` is an attention's: its input computed from a MatMul (through
    :data:`_TOWARDS` ops), its output read by a MatMul (maybe through the dynamo exporter's NaN
    guard or a Transpose). Only these are refused with a reason."""
    if softmax.op_type != "Softmax" or softmax.domain != "":
        return False
    if not _reaches_matmul(softmax.inputs[0], _TOWARDS):
        return False
    frontier = [softmax.outputs[0]]
    for _ in range(3):
        readers = [u.node for v in frontier for u in v.uses()]
        if any(r.op_type == "MatMul" for r in readers):
            return True
        passed = [r for r in readers if r.op_type in _TO_VALUES]
        frontier = [o for r in passed for o in r.outputs]
    return False


@dataclasses.dataclass
class Weights:
    """How the Softmax's output reaches its product with ``V``.

    Attributes:
        product: the MatMul ``P @ V`` (YOLO's ``V @ P^T`` where ``transposed``).
        nodes: the nodes after the Softmax up to it.
        transposed: the product is ``V @ P^T``.
        guard: the weights pass the dynamo exporter's NaN guard.
        perm: the product reads ``Transpose(P, perm)``, a permutation of the leading axes only
            (the last two kept), or None.
    """

    product: ir.Node
    nodes: list[ir.Node]
    transposed: bool = False
    guard: bool = False
    perm: tuple[int, ...] | None = None


def weights(softmax: ir.Node) -> Weights:
    """The weights' product with ``V``: ``P @ V`` (maybe behind the NaN guard,
    :func:`fusion.fuse_gqa.core.weights_reader`), ``Transpose(P, perm) @ V`` with ``perm``
    moving leading axes only (SwinV2's one-head attention once :mod:`fusion.simplify.batched`
    dropped its unit axes), or YOLO's ``V @ P^T`` (transposed).

    Raises:
        CannotFuse: ``shared_output``: the weights are read elsewhere; ``scores_form``: they
            reach their ``@ V`` through other ops.
    """
    found = gqa_core.weights_reader(softmax)
    if found is not None:
        return Weights(found[0], found[1], guard=bool(found[1]))
    weights = softmax.outputs[0]
    transpose = sole_consumer(weights)
    perm = ()
    if transpose is not None and transpose.op_type == "Transpose" and transpose.domain == "":
        perm = tuple(transpose.attributes.get_ints("perm", ()))
    rank = len(perm)
    matmul = sole_consumer(transpose.outputs[0]) if rank >= 3 else None
    if matmul is not None and matmul.op_type == "MatMul":
        if perm == swap(rank) and matmul.inputs[1] is transpose.outputs[0]:
            return Weights(matmul, [transpose], transposed=True)
        leading = perm[-2:] == (rank - 2, rank - 1) and perm != tuple(range(rank))
        if leading and matmul.inputs[0] is transpose.outputs[0]:
            return Weights(matmul, [transpose], perm=perm)
    if weights.is_graph_output() or len(list(weights.uses())) > 1:
        raise CannotFuse(Code.SHARED_OUTPUT, "the attention weights are read elsewhere")
    reader = next(iter(weights.uses())).node
    raise _form(
        f"the attention weights reach their @ V through other ops ({reader.op_type} "
        f"{reader.name!r} first)"
    )


def lifted(shape: list, rank: int) -> list:
    """``shape`` with leading axes of size 1 up to ``rank``: how MatMul broadcasts a
    lower-rank operand (numpy's rule)."""
    return [1] * (rank - len(shape)) + list(shape)


def lifted_perm(perm: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """``perm`` on the last ``len(perm)`` of ``rank`` axes, the leading ones kept."""
    lead = rank - len(perm)
    return (*range(lead), *(lead + p for p in perm))


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``perm``."""
    return tuple(int(i) for i in np.argsort(perm))


def operand(transposed: ir.Value, rank: int) -> Operand:
    """The tensor whose last two axes ``transposed`` swaps: the source of a Transpose (through
    one Transpose of the composed perm where it is no swap alone), of the dynamo exporter's
    ``Reshape -> Transpose(0, 2, 1) -> Reshape`` (:func:`_swapped_view`), a Reshape of the
    source of ``Transpose(x, swap) -> Reshape`` over the leading axes (:func:`_swapped_reshape`:
    ``nn.MultiheadAttention``'s key as torch's decomposition of its attention views it), else a
    new Transpose of ``transposed``."""
    transpose = producer(transposed, "Transpose")
    if transpose is not None:
        perm = list(transpose.attributes.get_ints("perm", range(rank)[::-1]))
        composed = tuple(perm[i] for i in swap(rank))
        identity = composed == tuple(range(rank))
        return Operand(transpose.inputs[0], None if identity else composed, [transpose])
    view = _swapped_view(transposed)
    if view is not None:
        return Operand(view[0], None, view[1])
    reshaped = _swapped_reshape(transposed)
    if reshaped is not None:
        return reshaped
    return Operand(transposed, swap(rank))


def _swapped_reshape(value: ir.Value) -> Operand | None:
    """``Reshape(x, lead + (A, B))`` where ``value = Reshape(Transpose(x, swap), lead + (B,
    A))`` with ``x`` of static shape ``m + (A, B)``, ``prod(m) == prod(lead)``: a Reshape that
    splits or merges the leading axes only (row-major) commutes with swapping the last two."""
    back = producer(value, "Reshape")
    transpose = producer(back.inputs[0], "Transpose") if back is not None else None
    if transpose is None:
        return None
    x = transpose.inputs[0]
    source, out = dims(x), dims(value)
    if source is None or out is None or len(source) < 2 or len(out) < 2:
        return None
    if not all(isinstance(d, int) for d in (*source, *out)):
        return None
    if tuple(transpose.attributes.get_ints("perm", ())) != swap(len(source)):
        return None
    if tuple(out[-2:]) != (source[-1], source[-2]) or math.prod(out[:-2]) != math.prod(source[:-2]):
        return None
    return Operand(x, None, [back, transpose], (*out[:-2], source[-2], source[-1]))


def _swapped_view(value: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(x, nodes)`` where ``value = Reshape(Transpose(Reshape(x, (M, A, B)), (0, 2, 1)),
    lead + (B, A))`` with ``x`` of shape ``lead + (A, B)``: the leading axes merged and split
    back (row-major, the order of their elements kept), the last two swapped."""
    back = producer(value, "Reshape")
    transpose = producer(back.inputs[0], "Transpose") if back is not None else None
    merge = producer(transpose.inputs[0], "Reshape") if transpose is not None else None
    if merge is None:
        return None
    x = merge.inputs[0]
    source, merged, out = dims(x), dims(merge.outputs[0]), dims(value)
    if source is None or merged is None or out is None or len(source) < 2 or len(merged) < 2:
        return None
    if tuple(transpose.attributes.get_ints("perm", ())) != swap(len(merged)):
        return None
    if not same_shape(merged[-2:], source[-2:]):
        return None
    if not same_shape(out, [*source[:-2], source[-1], source[-2]]):
        return None
    return x, [back, transpose, merge]


def scores(value: ir.Value) -> Scores:
    """The Softmax's input ``value`` parsed into :class:`Scores` (the forms:
    docs/fusions/fuse_sdpa.md).

    Raises:
        CannotFuse: ``scores_form``, ``not_constant``, ``scale_not_scalar``,
            ``scale_not_positive`` (:func:`.scales.per_head`).
    """
    found = Scores()
    value = _view(value, found)
    while (node := value.producer()) is not None and node.domain == "":
        if node.op_type == "MatMul":
            found.matmul = node
            found.nodes.append(node)
            return found
        if node.op_type in ("Mul", "Div"):
            value = _factor(node, found)
        elif node.op_type == "Add":
            if found.scaled:
                raise _form(f"the mask or bias {node.name!r} is scaled with the scores")
            value, term = _sides(node)
            found.terms.append(term)
        elif node.op_type == "Where" and found.where is None and not found.scaled:
            found.where = node
            fills = [i for i in (1, 2) if scalar_const(node.inputs[i]) is not None]
            if len(fills) != 1:
                raise _form(f"the Where {node.name!r} does not set scores to one constant")
            value = node.inputs[3 - fills[0]]
        else:
            raise _form(f"{node.op_type} {node.name!r} between Q @ K^T and the Softmax")
        found.nodes.append(node)
    raise _form("the scores do not come from Q @ K^T")


def _form(detail: str) -> CannotFuse:
    return CannotFuse(SDPACode.SCORES_FORM, detail)


def _factor(node: ir.Node, found: Scores) -> ir.Value:
    """Fold the scale of a Mul or Div on the scores into ``found`` (one number into its
    ``factor``, a constant per head into its ``heads``); return the scaled value."""
    arrays = [const_array(v) for v in node.inputs]
    index = 0 if node.op_type == "Mul" and arrays[0] is not None else 1
    if arrays[index] is None:
        raise CannotFuse(
            Code.NOT_CONSTANT, f"{node.name!r} scales the scores by a value computed at run time"
        )
    scale = arrays[index].astype(np.float64)
    if node.op_type == "Div":
        with np.errstate(divide="ignore"):
            scale = 1.0 / scale
    scores = node.inputs[1 - index]
    if scale.size == 1:
        found.factor *= float(scale.reshape(-1)[0])
    else:
        heads = scales.per_head(node, scale, dims(scores))
        found.heads = heads if found.heads is None else found.heads * heads
    return scores


def _sides(add: ir.Node) -> tuple[ir.Value, ir.Value]:
    """``(scores, term)`` of an Add on the scores: the operand computed from ``Q @ K^T`` (of
    the Add's shape, where both are), and the other."""
    main = [v for v in add.inputs if _reaches_matmul(v)]
    if len(main) > 1:
        full = [v for v in main if v.shape is not None and add.outputs[0].shape is not None
                and same_shape(list(v.shape), list(add.outputs[0].shape))]  # fmt: skip
        main = full or main
    if not main:
        raise _form(f"neither operand of {add.name!r} comes from Q @ K^T")
    term = add.inputs[1] if main[0] is add.inputs[0] else add.inputs[0]
    return main[0], term


def _view(value: ir.Value, found: Scores) -> ir.Value:
    """Parse ``Reshape(Reshape(s, X) + t_1 + .., shape(s))`` (terms added through a view of
    the scores ``s``) into ``found.view``; return ``s`` (``value`` where it is no such view).

    Raises:
        CannotFuse: ``scores_form``: the Reshape back is not to the shape of ``s``.
    """
    back = producer(value, "Reshape")
    if back is None:
        return value
    terms, inner, nodes = [], back.inputs[0], [back]
    while (add := producer(inner, "Add")) is not None:
        inner, term = _sides(add)
        terms.append(term)
        nodes.append(add)
    split = producer(inner, "Reshape")
    if split is None:
        raise _form(f"the Reshape {back.name!r} of the scores is no view of them")
    source, out = dims(split.inputs[0]), dims(value)
    if source is None or out is None or not same_shape(source, out):
        raise _form(f"the Reshapes {split.name!r} and {back.name!r} are not inverse views")
    found.view = (terms, split, back)
    found.nodes += [*nodes, split]
    return split.inputs[0]


def check_shapes(
    query: ir.Value, key_t: ir.Value, value: list | None, perm: tuple[int, ...] | None = None
) -> int:
    """The rank (3 or 4) of the attention, after checking that ``Attention`` takes the
    query, the key (``key_t`` is ``K^T``) and the value (its ``value`` dims, ``(.., L, Hv)``)
    as the MatMuls do: one batch, key and value heads alike (or one key head), one length.
    Each may be 3-D or 4-D: the rank is the largest, a 3-D one read as the MatMuls broadcast it
    (:func:`lifted`); ``perm``: the weights reach ``V`` through ``Transpose(P, perm)`` of their
    leading axes (:class:`Weights`), so ``V`` is read through the inverse permutation.

    Raises:
        CannotFuse: ``unknown_shape``, ``unsupported_rank``, ``shape_mismatch``,
            ``unsupported_dtype``.
    """
    q, kt = dims(query), dims(key_t)
    if q is None or kt is None or value is None:
        raise CannotFuse(Code.UNKNOWN_SHAPE, "the shapes of Q, K and V are not known")
    ranks = {len(q), len(kt), len(value)}
    if not ranks <= {3, 4}:
        raise CannotFuse(
            Code.UNSUPPORTED_RANK, "Q, K and V are not each 3-D or 4-D: Attention takes those"
        )
    rank = max(ranks)
    q, kt, value = (lifted(d, rank) for d in (q, kt, value))
    if perm is not None:
        value = [value[i] for i in inverse(lifted_perm(perm, rank))]
    if query.dtype != ir.DataType.FLOAT:
        raise CannotFuse(Code.UNSUPPORTED_DTYPE, f"the attention computes in {query.dtype}")
    if not (same_dim(q[0], kt[0]) and same_dim(q[0], value[0])):
        raise CannotFuse(Code.SHAPE_MISMATCH, "Q, K and V do not have one batch")
    if rank == 4 and not same_dim(kt[1], value[1]):
        raise CannotFuse(Code.SHAPE_MISMATCH, "K and V do not have one head count")
    if rank == 4 and not (same_dim(q[1], kt[1]) or same_dim(kt[1], 1)):
        raise CannotFuse(Code.SHAPE_MISMATCH, "Q and K have head counts that do not group")
    if not same_dim(kt[-1], value[-2]):
        raise CannotFuse(Code.SHAPE_MISMATCH, "the value's length differs from the key's")
    return rank


def slices(query: ir.Value) -> int:
    """The (batch, head) pairs of an attention whose ``Q`` (3-D or 4-D, checked) is
    ``query``: the product of its leading dimensions, an unknown batch of a 4-D ``Q`` counted
    as 1 (a latency's batch); where the heads are unknown (a 3-D ``Q``'s first dimension, a 4-D
    one's second), as many as there may be threads (:data:`sys.maxsize`)."""
    q = dims(query)
    heads = q[0] if len(q) == 3 else q[1]
    if not isinstance(heads, int):
        return sys.maxsize
    batch = q[0] if len(q) == 4 and isinstance(q[0], int) else 1
    return batch * heads
