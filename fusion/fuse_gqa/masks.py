"""A decoder's additive attention mask, evaluated where it is computed from constants and the
shapes of the model's inputs alone (:func:`evaluate`, at the sizes :data:`SIZES`), and what
GroupQueryAttention makes of it (:func:`classify`, :func:`masking`) (:mod:`fusion.fuse_gqa`).
What is checked, and at which sizes: see docs/fusions/fuse_gqa.md.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from fusion._ir import const_array, dims, same_dim
from fusion.base import CannotFuse, Code
from fusion.fuse_gqa import parts

#: A mask entry at most this is "masked": ``exp(score + mask - max)`` is 0 in float32 beside
#: any score a model makes (transformers masks with ``finfo(float32).min``).
MASKED = -1e30

#: The sizes the symbolic axes of the inputs take, one assignment per row: the k-th distinct
#: axis name takes the row's k-th size (cycling).
SIZES = ((1,), (2, 5, 3), (3, 7, 2), (1, 9, 4))


def _subgraph(value: ir.Value, max_nodes: int):
    """``(nodes, constants, shapes)`` computing ``value``: its nodes, the constants they read,
    and the ``Shape`` nodes among them whose input's shape is known axis by axis (a number or a
    named symbol), which are not followed further; None where the value reads anything else
    (an input's elements, a node outside ai.onnx) or takes over ``max_nodes`` nodes."""
    nodes: set[ir.Node] = set()
    constants: dict[str, np.ndarray] = {}
    shapes: set[ir.Node] = set()
    pending = [value]
    while pending:
        current = pending.pop()
        array = const_array(current)
        if array is not None:
            constants[current.name] = array
            continue
        node = current.producer()
        if node is None or node.domain != "" or len(nodes) >= max_nodes:
            return None
        if node in nodes or node in shapes:
            continue
        if node.op_type == "Shape":
            shape = node.inputs[0].shape
            if shape is None or any(not isinstance(d, int) and d.value is None for d in shape):
                return None
            shapes.add(node)
        else:
            nodes.add(node)
            pending.extend(v for v in node.inputs if v is not None)
    return nodes, constants, shapes


def _shape_feeds(shapes: set[ir.Node], sizes: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Each ``Shape`` node's output with the symbolic axes given ``sizes``: the k-th distinct
    axis name, in the order met, takes ``sizes[k % len(sizes)]``."""
    names: dict[str, int] = {}
    feeds = {}
    for node in sorted(shapes, key=lambda n: n.outputs[0].name):
        dims = [
            d if isinstance(d, int) else names.setdefault(d.value, sizes[len(names) % len(sizes)])
            for d in node.inputs[0].shape
        ]
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", len(dims))
        feeds[node.outputs[0].name] = np.array(dims[start:end], np.int64)
    return feeds


def _beyond_sizes(constants: dict[str, np.ndarray]) -> int | None:
    """An integer constant larger than every size of :data:`SIZES` (the ``2**63 - 1`` of "to
    the end" aside) among ``constants``, or None: with one, a mask checked at those sizes may
    still differ at larger ones (docs/fusions/fuse_gqa.md)."""
    limit = max(max(sizes) for sizes in SIZES)
    for array in constants.values():
        if array.dtype.kind in "iu" and array.size <= 64:
            big = [int(v) for v in array.reshape(-1) if limit < abs(int(v)) < 2**62]
            if big:
                return big[0]
    return None


def evaluate(value: ir.Value, opset: int, max_nodes: int = 256) -> list[np.ndarray] | None:
    """``value`` at each assignment of :data:`SIZES` (one array when it reads no shape), where
    it is computed from constants and shapes alone (docs/fusions/fuse_gqa.md);
    else None.

    Raises:
        CannotFuse: it reads shapes and holds an integer constant beyond those sizes.
    """
    found = _subgraph(value, max_nodes)
    if found is None:
        return None
    nodes, constants, shapes = found
    if shapes and (big := _beyond_sizes(constants)) is not None:
        raise CannotFuse(
            Code.NOT_CONSTANT,
            f"the attention mask is computed with the constant {big}, beyond the sizes it can be "
            "checked at (a sliding window?): it may differ at longer sequences",
        )
    assignments = [_shape_feeds(shapes, sizes) for sizes in SIZES] if shapes else [{}]
    if not nodes:
        return [constants[value.name]] if not shapes else list(assignments[0].values())
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in value.producer().graph if n in nodes],
        "mask",
        [onnx.helper.make_tensor_value_info(n.outputs[0].name, onnx.TensorProto.INT64, None)
         for n in shapes],
        [onnx.helper.make_empty_tensor_value_info(value.name)],
        [onnx.numpy_helper.from_array(a, name) for name, a in constants.items()],
    )  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        evaluator = ReferenceEvaluator(model)
        return [np.asarray(evaluator.run(None, feeds)[0]) for feeds in assignments]
    except Exception:  # a size the model cannot run at (an export specialized to batch 1)
        return None


def classify(mask: ir.Value | None, opset: int) -> tuple[bool, np.ndarray | None]:
    """``(causal, attention_bias)`` of the op for the model's additive ``mask`` (None: no mask):
    causal where it is 0 on and below the diagonal and masked above it at every size it is
    evaluated at, no bias where it is all zeros, else the constant mask as the op's bias.

    Raises:
        CannotFuse: ``not_constant``: the mask reads the model's inputs (an attention_mask, a
            KV cache), or is computed from their shapes and neither causal nor absent;
            ``shape_mismatch``: a row is all masked (the model's softmax of it is NaN).
    """
    if mask is None:
        return False, None
    arrays = evaluate(mask, opset)
    arrays = [_as_4d(a) for a in arrays] if arrays is not None else [None]
    if any(a is None for a in arrays):
        raise CannotFuse(
            Code.NOT_CONSTANT,
            "the attention mask is computed from the model's inputs (an attention_mask input or "
            "a KV cache): GroupQueryAttention masks by sequence lengths",
        )
    masked = [a <= MASKED for a in arrays]
    if any(m.all(axis=-1).any() for m in masked):
        raise CannotFuse(Code.SHAPE_MISMATCH, "a row of the attention mask is all masked")
    plain = all((m | (a == 0)).all() for m, a in zip(masked, arrays, strict=True))
    if plain and all((m == _causal(*m.shape[-2:])).all() for m in masked):
        return True, None
    if plain and not any(m.any() for m in masked):
        return False, None
    if len(arrays) == 1:
        return False, arrays[0]
    raise CannotFuse(
        Code.NOT_CONSTANT,
        "the attention mask is computed from the inputs' sizes and is neither causal nor absent",
    )


def causal(mask: ir.Value | None, opset: int) -> bool:
    """Whether the additive ``mask`` is causal at every size it is evaluated at
    (:func:`classify`): the mark of a decoder's attention. False where there is no mask, or one
    computed from the model's inputs, or one :func:`classify` refuses."""
    try:
        return mask is not None and classify(mask, opset)[0]
    except CannotFuse:
        return False


def _as_4d(array: np.ndarray) -> np.ndarray | None:
    """A float32 mask of rank 2 to 4 as the op's ``(B|1, N|1, S, T)``, or None."""
    if array.dtype != np.float32 or not 2 <= array.ndim <= 4:
        return None
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def _causal(rows: int, cols: int) -> np.ndarray:
    """Where a causal mask of ``rows`` queries over ``cols`` keys (the last ``rows`` of them
    new) masks."""
    return np.triu(np.ones((rows, cols), bool), k=1 + cols - rows)


def runtime_bias(mask: ir.Value, batch, heads: int, length, total) -> bool:
    """Whether the model's additive ``mask``, computed at run time, is the op's
    ``attention_bias`` as it is: float32 of shape ``(B | 1, N | 1, S, T)`` for ``batch``,
    ``heads``, query ``length`` and key ``total`` (dimensions compared provably; ``total``
    None: any last axis but a literal 1, which the model would broadcast over the keys and ONNX's
    Attention pads)."""
    shape = dims(mask)
    if mask.dtype != ir.DataType.FLOAT or shape is None or len(shape) != 4:
        return False
    return (
        (shape[0] == 1 or same_dim(shape[0], batch))
        and shape[1] in (1, heads)
        and same_dim(shape[2], length)
        and (shape[3] != 1 if total is None else same_dim(shape[3], total))
    )


def masking(mask, opset: int, tables, query: parts.Heads, key: parts.Heads, past):
    """``(causal, bias)`` of the op for the model's additive ``mask`` (None: no mask): from
    :func:`classify` where it is constant or computed from shapes alone; else, where the
    query and key are rotated, the mask itself as a run-time ``attention_bias`` (always so with a
    past, whose mask spans the past). None where nothing is rotated and the mask is not causal
    (an encoder's attention, :mod:`fusion.fuse_attention`'s).

    Raises:
        CannotFuse: :func:`classify`'s refusals but ``not_constant`` (a row all masked
            among them) where the query and key are rotated; a run-time mask not of the op's
            ``attention_bias`` shape.
    """
    if past is None:
        try:
            causal, bias = classify(mask, opset)
        except CannotFuse as refusal:
            if tables is None:
                return None
            if refusal.code != Code.NOT_CONSTANT:
                raise
        else:
            return None if tables is None and not causal else (causal, bias)
    elif tables is None:
        return None
    split = dims(query.split)
    # With a past, a mask of a length not provably the keys' (a sliding-window cache crops the
    # past: Mistral's, Gemma 2's) is taken where the model adds it, so wherever the model runs
    # it spans the keys; only ONNX's Attention takes it (:func:`mask_spans_keys`).
    total = None if past is not None else dims(key.split)[1]
    if mask is not None and not runtime_bias(mask, split[0], query.count, split[1], total):
        raise CannotFuse(
            Code.SHAPE_MISMATCH,
            "the attention mask, computed at run time, is not of the op's attention_bias shape "
            "(B or 1, N or 1, S, T)",
        )
    return False, mask


def mask_spans_keys(mask: ir.Value | None, past) -> bool:
    """Whether a run-time ``mask`` provably spans the keys: as long as the present (the past
    and the new keys, ``past`` as :func:`masking` takes it), or no mask, or no past."""
    if not isinstance(mask, ir.Value) or past is None:
        return True
    return same_dim(dims(mask)[3], dims(past[2])[2])
