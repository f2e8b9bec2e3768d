"""A decoder's additive attention mask, evaluated where it is computed from constants and the
shapes of the model's inputs alone, and what GroupQueryAttention makes of it
(:mod:`fusion.fuse_gqa`).

A mask of an export at a fixed length is a constant subgraph the constant folder leaves (its
``(1, 1, S, S)`` booleans are over the folder's size limit). With symbolic axes it is computed
from ``Shape`` of an input (``Range``, ``LessOrEqual``, ``Where``: transformers' causal mask),
and reads nothing else of it: then it is evaluated, by the ONNX reference implementation, at
every assignment of :data:`SIZES` to the symbolic axes, and must be causal (or absent) at each.
That is a check at those sizes, not a proof for every size; the run's parity check adds the
sizes it runs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from fusion._ir import const_array
from fusion.base import CannotFuse, Code

#: A mask entry at most this is "masked": ``exp(score + mask - max)`` is 0 in float32 beside
#: any score a model makes (transformers masks with ``finfo(float32).min``).
MASKED = -1e30

#: The sizes the symbolic axes of the inputs take, one assignment per row: the k-th distinct
#: axis name takes the row's k-th size (cycling).
SIZES = ((1,), (2, 5, 3), (3, 7, 2), (1, 9, 4))

#: Ops that read only the shape of their input.
_SHAPE_OPS = ("Shape", "Size")


def _subgraph(value: ir.Value, max_nodes: int):
    """``(nodes, constants, inputs)`` computing ``value``, or None where a graph input is read
    other than by its shape, a node is not ai.onnx, or there are over ``max_nodes``."""
    nodes: set[ir.Node] = set()
    constants: dict[str, np.ndarray] = {}
    inputs: dict[str, ir.Value] = {}
    pending = [value]
    while pending:
        current = pending.pop()
        array = const_array(current)
        if array is not None:
            constants[current.name] = array
        elif current.is_graph_input():
            inputs[current.name] = current
        else:
            node = current.producer()
            if node is None or node.domain != "" or len(nodes) >= max_nodes:
                return None
            if node not in nodes:
                nodes.add(node)
                pending.extend(v for v in node.inputs if v is not None)
    for value_in in inputs.values():
        if any(u.node in nodes and u.node.op_type not in _SHAPE_OPS for u in value_in.uses()):
            return None
    return nodes, constants, inputs


def _feeds(inputs: dict[str, ir.Value], sizes: tuple[int, ...]) -> dict[str, np.ndarray] | None:
    """Zeros of each input's shape with its symbolic axes given ``sizes``; None where an axis
    has no name or a type is unknown."""
    names: dict[str, int] = {}
    feeds = {}
    for name, value in inputs.items():
        if value.shape is None or value.dtype is None:
            return None
        dims = []
        for dim in value.shape:
            if isinstance(dim, int):
                dims.append(dim)
            elif dim.value is None:
                return None
            else:
                dims.append(names.setdefault(dim.value, sizes[len(names) % len(sizes)]))
        feeds[name] = np.zeros(dims, dtype=value.dtype.numpy())
    return feeds


def evaluate(value: ir.Value, opset: int, max_nodes: int = 32) -> list[np.ndarray] | None:
    """``value`` at each assignment of :data:`SIZES` (one array when it reads no input), where
    it is computed from constants and the shapes of inputs alone (see the module docstring);
    else None."""
    found = _subgraph(value, max_nodes)
    if found is None:
        return None
    nodes, constants, inputs = found
    if not nodes:
        return [constants[value.name]]
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in value.producer().graph if n in nodes],
        "mask",
        [onnx.helper.make_tensor_value_info(n, v.dtype.value, None) for n, v in inputs.items()],
        [onnx.helper.make_empty_tensor_value_info(value.name)],
        [onnx.numpy_helper.from_array(a, name) for name, a in constants.items()],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    evaluator = ReferenceEvaluator(model)
    assignments = [_feeds(inputs, sizes) for sizes in SIZES] if inputs else [{}]
    if any(feeds is None for feeds in assignments):
        return None
    return [np.asarray(evaluator.run(None, feeds)[0]) for feeds in assignments]


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


def _as_4d(array: np.ndarray) -> np.ndarray | None:
    """A float32 mask of rank 2 to 4 as the op's ``(B|1, N|1, S, T)``, or None."""
    if array.dtype != np.float32 or not 2 <= array.ndim <= 4:
        return None
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def _causal(rows: int, cols: int) -> np.ndarray:
    """Where a causal mask of ``rows`` queries over ``cols`` keys (the last ``rows`` of them
    new) masks."""
    return np.triu(np.ones((rows, cols), bool), k=1 + cols - rows)
