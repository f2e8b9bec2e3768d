"""What is added to (or masked in) the scores, as ``Attention``'s ``attn_mask``
(:mod:`fusion.fuse_sdpa`): additive terms (:func:`additive_term`), boolean masks
(:func:`boolean`), terms added through a view of the scores (:class:`View`), and the fit to the
kernel's shape (:func:`fit`), gathered into a :class:`Mask` (:func:`of_scores`).

How ONNX Runtime's kernel treats masked rows and which masks are exact: see
docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from fusion._ir import const_array, dims, producer, same_dim, scalar_const
from fusion.base import CannotFuse, Code
from fusion.fuse_gqa import masks as gqa_masks
from fusion.fuse_gqa import standard
from fusion.fuse_sdpa.codes import SDPACode

#: The highest fill of a boolean mask taken as masking (see docs/fusions/fuse_sdpa.md).
LARGE_NEGATIVE = -1e4

#: Ops that carry a mask the caller passes on to the scores unchanged in value.
_VIEWS = ("Unsqueeze", "Squeeze", "Reshape", "Expand", "Cast", "Slice", "Transpose", "Identity")


@dataclasses.dataclass
class View:
    """Terms added to the scores through a view of them (segment-anything's decomposed
    relative positions): ``Reshape(Reshape(s, X) + t_1 + .., shape(s))`` is ``s + bias`` with
    ``bias = Reshape(Expand(t_1 + .., X), target)``.

    Attributes:
        terms: the terms, each broadcast to ``X``.
        shape: ``X``, when the terms' sum may be smaller (then expanded to it), else None.
        target, allowzero: the Reshape back to the scores' shape, as the model writes it.
    """

    terms: list[ir.Value]
    shape: list[int] | None
    target: ir.Value | np.ndarray
    allowzero: int


@dataclasses.dataclass
class Mask:
    """The ``attn_mask`` the rewrite builds (:func:`build`).

    Attributes:
        additive: terms summed (constants as arrays, float32's lowest already raised).
        view: a :class:`View` term, or None.
        condition: a boolean mask's condition (then ``additive`` is empty), or None.
        attend: the value of ``condition`` where the model attends.
        above: the condition becomes ``Where(attend, 0, above)``: the model fills lowest.
        raise_where: the one additive term is a ``Where`` of constants holding lowest
            (:func:`fusion.fuse_gqa.standard.attention_mask` raises it).
        raise_at_run_time: lowest raised in the sum at run time.
        expand: expanded to the scores' last two axes ``(S, L)``.
        unsqueeze: given a head axis (3-D scores).
    """

    additive: list[ir.Value | np.ndarray] = dataclasses.field(default_factory=list)
    view: View | None = None
    condition: ir.Value | None = None
    attend: bool = True
    above: bool = False
    raise_where: bool = False
    raise_at_run_time: bool = False
    expand: bool = False
    unsqueeze: bool = False


def _refuse(detail: str) -> CannotFuse:
    return CannotFuse(SDPACode.MASK_NOT_EXACT, detail)


def _evaluated(value: ir.Value, opset: int) -> list[np.ndarray] | None:
    """``value`` at the sizes :func:`fusion.fuse_gqa.masks.evaluate` takes, where it is
    computed from constants and shapes alone; else None."""
    try:
        return gqa_masks.evaluate(value, opset)
    except CannotFuse:  # a window beyond the sizes it is evaluated at: unknown
        return None


def _from_caller(value: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` is a mask the caller passes (a graph input, through ops that keep its
    values), or is computed from a constant holding ``-inf`` or float32's lowest within
    ``depth`` nodes: a mask whose rows may be masked everywhere."""
    current = value
    while (node := current.producer()) is not None and node.op_type in _VIEWS:
        current = node.inputs[0]
    if current.is_graph_input():
        return True
    pending, seen = [value], 0
    while pending and seen < depth:
        node = pending.pop().producer()
        if node is None:
            continue
        seen += 1
        for v in (v for v in node.inputs if v is not None):
            array = const_array(v)
            if array is None:
                pending.append(v)
            elif array.dtype.kind == "f" and array.size <= 1 << 16 and _masking(array):
                return True
    return False


def _masking(array: np.ndarray) -> bool:
    """Whether ``array`` holds ``-inf`` or float32's lowest."""
    return bool((np.isneginf(array) | (array == standard.LOWEST)).any())


def additive_term(term: ir.Value, guard: bool, opset: int, mask: Mask) -> None:
    """Add ``term`` (a float32 value added to the scores) to ``mask`` (docs/fusions/fuse_sdpa.md);
    ``guard``: the model maps NaN weights to 0.

    Raises:
        CannotFuse: ``mask_not_exact``: a row masked everywhere would differ.
    """
    arrays = _evaluated(term, opset)
    if arrays is not None:
        if any((np.isnan(a) | np.isposinf(a)).any() for a in arrays):
            raise _refuse(f"the mask {term.name!r} holds NaN or +inf")
        if not guard and any(np.isneginf(a).all(axis=-1).any() for a in arrays):
            raise _refuse(f"a row of the mask {term.name!r} is -inf at every key: NaN in the "
                          "model, zeros from Attention")  # fmt: skip
        array = const_array(term)
        if array is not None:
            raised = np.where(array == standard.LOWEST, standard.ABOVE_LOWEST, array)
            mask.additive.append(raised.astype(array.dtype))
            return
        lowest = any((a == standard.LOWEST).any() for a in arrays)
        mask.raise_where |= lowest and standard.bias(term, True) == "raised"
        mask.raise_at_run_time |= lowest and not mask.raise_where
    elif _constant_branches(term):
        how = standard.bias(term, guard)
        if how is None:
            raise _refuse(f"the mask {term.name!r} may mask a row everywhere with -inf: NaN in "
                          "the model, zeros from Attention")  # fmt: skip
        mask.raise_where |= how == "raised"
    elif _from_caller(term):
        if not guard:
            raise _refuse(f"the mask {term.name!r} comes from the caller: a row of it -inf at "
                          "every key gives NaN in the model, zeros from Attention")  # fmt: skip
        mask.raise_at_run_time = True
    mask.additive.append(term)


def _constant_branches(value: ir.Value) -> bool:
    """Whether ``value`` is ``Where(c, a, b)`` with ``a`` and ``b`` one-element constants."""
    where = producer(value, "Where")
    return where is not None and all(scalar_const(v) is not None for v in where.inputs[1:])


def check_terms(mask: Mask) -> None:
    """Refuse a mask of several terms where one of them is a mask (:func:`additive_term`
    raised or kept something in it): its rows would need the sum's analysis.

    Raises:
        CannotFuse: ``mask_not_exact``.
    """
    count = len(mask.additive) + (len(mask.view.terms) if mask.view is not None else 0)
    special = (
        mask.raise_where
        or mask.raise_at_run_time
        or any(isinstance(t, np.ndarray) and not np.isfinite(t).all() for t in mask.additive)
    )
    if count > 1 and special:
        raise _refuse("a mask beside another bias on the scores")


def boolean(where: ir.Node, guard: bool, opset: int) -> Mask:
    """The mask of ``Where(c, scores, f)`` or ``Where(c, f, scores)`` with ``f`` a one-element
    constant (see docs/fusions/fuse_sdpa.md); ``guard``: the model maps NaN weights to 0.

    Raises:
        CannotFuse: ``mask_not_exact``: a fill Attention cannot match, or a row that may be
            masked everywhere where the op would differ.
    """
    attend = scalar_const(where.inputs[2]) is not None  # the scores where the condition holds
    condition, fill = where.inputs[0], scalar_const(where.inputs[2 if attend else 1])
    not_ = producer(condition, "Not")
    if not_ is not None:
        condition, attend = not_.inputs[0], not attend
    if fill == standard.LOWEST:
        return Mask(condition=condition, attend=attend, above=True)
    if math.isnan(fill) or fill > LARGE_NEGATIVE:
        raise _refuse(f"the masked scores are set to {fill}: masked keys keep a weight")
    arrays = _evaluated(condition, opset)
    whole = arrays is None or any((a != attend).all(axis=-1).any() for a in arrays)
    if whole and not (guard and fill == -math.inf):
        gives = "NaN" if fill == -math.inf else "the mean of the values"
        raise _refuse(f"a row of {condition.name!r} may be masked at every key: the model's "
                      f"fill {fill} gives it {gives}, Attention zeros")  # fmt: skip
    return Mask(condition=condition, attend=attend)


def view_term(term: ir.Value, guard: bool, opset: int) -> None:
    """Check a term added inside a :class:`View`: a bias from the data, or a constant with
    no ``-inf``, lowest or NaN (a mask inside the view would need the analysis of the sum).

    Raises:
        CannotFuse: ``mask_not_exact``.
    """
    scratch = Mask()
    additive_term(term, guard, opset, scratch)
    kept = scratch.additive[0]
    if (
        scratch.raise_where
        or scratch.raise_at_run_time
        or (isinstance(kept, np.ndarray) and not np.isfinite(kept).all())
    ):
        raise _refuse(f"a mask {term.name!r} added through a view of the scores")


def fit(mask: Mask, shapes: list[list | None], scores: list) -> None:
    """Set how ``mask`` is fitted to the kernel (:attr:`Mask.expand`, :attr:`Mask.unsqueeze`)
    from the ``shapes`` of its terms (of its condition) and the ``scores`` shape.

    Raises:
        CannotFuse: ``unknown_shape``; ``broadcast_changes_shape``: a term of more axes than the
            scores; ``shape_mismatch``: a term that may broadcast the scores to a larger shape.
    """
    if any(shape is None for shape in shapes):
        raise CannotFuse(Code.UNKNOWN_SHAPE, "the shape of the mask is not known")
    rank = len(scores)
    for shape in shapes:
        if len(shape) > rank:
            raise CannotFuse(Code.BROADCAST_CHANGES_SHAPE, "the mask has more axes than the scores")
        for d, s in zip(shape[::-1], scores[::-1], strict=False):
            fits = same_dim(d, 1) or same_dim(d, s) or (isinstance(s, int) and s > 1)
            if not fits:
                raise CannotFuse(Code.SHAPE_MISMATCH, "the mask may broadcast the scores")

    def known(axis: int) -> bool:  # the mask's size on the scores' axis is provably theirs
        return any(len(sh) >= -axis and same_dim(sh[axis], scores[axis]) for sh in shapes)

    mask.expand = not (known(-1) and known(-2))
    top = max(2, *(len(sh) for sh in shapes))
    ones = all(len(sh) < 3 or (isinstance(sh[-3], int) and sh[-3] == 1) for sh in shapes)
    mask.unsqueeze = rank == 3 and top == 3 and not ones


def shapes_of(mask: Mask, scores: list) -> list[list | None]:
    """The shapes of ``mask``'s terms (its condition's), the view's as the scores'."""
    if mask.condition is not None:
        return [dims(mask.condition)]
    found = [list(t.shape) if isinstance(t, np.ndarray) else dims(t) for t in mask.additive]
    return found + ([scores] if mask.view is not None else [])


def of_scores(scores, guard: bool, opset: int, shape: list) -> Mask | None:
    """The :class:`Mask` of parsed scores (a :class:`fusion.fuse_sdpa.core.Scores`), fitted to
    their ``shape``; None where nothing is added to them.

    Raises:
        CannotFuse: see docs/fusions/fuse_sdpa.md; ``scores_form``: a boolean mask beside another.
    """
    if scores.where is not None:
        if scores.terms or scores.view is not None:
            raise CannotFuse(SDPACode.SCORES_FORM, "a boolean mask beside another mask or bias")
        mask = boolean(scores.where, guard, opset)
    elif scores.terms or scores.view is not None:
        mask = Mask()
        for term in scores.terms:
            additive_term(term, guard, opset, mask)
        if scores.view is not None:
            mask.view = _view(*scores.view, guard, opset, shape, scores.nodes)
        check_terms(mask)
    else:
        return None
    fit(mask, shapes_of(mask, shape), shape)
    return mask


def _view(terms: list, split, back, guard: bool, opset: int, scores: list, replaced: list):
    """The :class:`View` of ``terms`` added between the Reshapes ``split`` and ``back`` (of
    scores of shape ``scores``; ``replaced``: the nodes the rewrite removes).

    Raises:
        CannotFuse: ``mask_not_exact`` (:func:`view_term`); ``unknown_shape``: the terms' sum
            may be smaller than the view and the view's shape is not known, or the shape back
            is not known and computed from the nodes replaced.
    """
    for term in terms:
        view_term(term, guard, opset)
    shape = dims(split.outputs[0])
    if shape is None:
        raise CannotFuse(Code.UNKNOWN_SHAPE, "the shape of the view of the scores is not known")
    term_dims = [dims(t) for t in terms]
    spans = all(
        any(d is not None and len(d) > i and same_dim(d[-1 - i], size) for d in term_dims)
        for i, size in enumerate(shape[::-1])
    )
    if not spans and not all(isinstance(d, int) for d in shape):
        raise CannotFuse(Code.UNKNOWN_SHAPE, "the bias may need expanding to an unknown shape")
    target, allowzero = back.inputs[1], back.attributes.get_int("allowzero", 0)
    if all(isinstance(d, int) for d in scores):
        target, allowzero = np.array(scores, np.int64), 0
    elif not _independent(target, set(replaced)):
        raise CannotFuse(Code.UNKNOWN_SHAPE, "the shape of the scores is computed from them")
    return View(terms, None if spans else list(shape), target, allowzero)


def _independent(value: ir.Value, nodes: set[ir.Node], limit: int = 64) -> bool:
    """Whether ``value`` is computed without any of ``nodes`` (within ``limit`` nodes up)."""
    pending, seen = [value], set()
    while pending:
        node = pending.pop().producer()
        if node is None or node in seen:
            continue
        if node in nodes or len(seen) >= limit:
            return False
        seen.add(node)
        pending.extend(v for v in node.inputs if v is not None)
    return True
