"""Nodes that change nothing, read through (:mod:`fusion.simplify`): neutral elements, and with
the inferred shapes, sizes that are numbers, whole Slices, Expands that broadcast nothing new and
Casts to a value's own type. See docs/fusions/cleanup.md.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, const_array, dims, producer, rank_of, same_dim, same_shape

#: ``op: (neutral element, operand indices it may sit at)``: ``x op e == x`` exactly, in every
#: IEEE float (NaN, infinities and signed zeros kept: ``x * 1``, ``x / 1``, ``x + -0``,
#: ``x - 0``) and boolean and integer. ``x + 0`` (and ``x - -0``) is ``x`` but for ``x = -0``,
#: whose sum is ``+0`` (``1 / x`` then ``+inf``, not ``-inf``): read through only where ``x`` is
#: never ``-0`` (:func:`_never_negative_zero`).
_NEUTRAL = {
    "And": (True, (0, 1)),
    "Or": (False, (0, 1)),
    "Mul": (1, (0, 1)),
    "Div": (1, (1,)),
    "Add": (0, (0, 1)),
    "Sub": (0, (1,)),
}


def _no_negative_zero(value: ir.Value | None) -> bool:
    """Whether ``value`` is a constant with no ``-0`` element."""
    array = const_array(value)
    return array is not None and not (np.signbit(array) & (array == 0)).any()


def _never_negative_zero(x: ir.Value) -> bool:
    """Whether no element of ``x`` can be ``-0``: an integer, or a Conv's or ConvTranspose's
    output with a constant bias, or an Add of a constant, none of whose elements is ``-0``
    (why: docs/fusions/cleanup.md)."""
    if x.dtype is not None and not x.dtype.is_floating_point():
        return True
    node = x.producer()
    if node is None or node.domain != "":
        return False
    if node.op_type in ("Conv", "ConvTranspose"):
        return len(node.inputs) > 2 and _no_negative_zero(node.inputs[2])
    return node.op_type == "Add" and any(_no_negative_zero(v) for v in node.inputs)


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The array of a constant ``value``, or of ``ConstantOfShape`` of a constant shape of one
    element (which onnxscript's folder leaves: transformers' ``ones`` of the mask), or None."""
    array = const_array(value)
    node = producer(value, "ConstantOfShape") if array is None else None
    shape = const_array(node.inputs[0]) if node is not None else None
    if shape is None or np.prod(shape) != 1:
        return array
    fill = node.attributes.get("value")
    element = fill.as_tensor().numpy().reshape(-1)[0] if fill is not None else np.float32(0)
    return np.full(shape.astype(np.int64), element)


def drop_neutral_ops(graph: ir.Graph) -> int:
    """Read ``x`` for each ``And(x, True)``, ``Or(x, False)``, ``Mul(x, 1)``, ``Div(x, 1)``,
    ``Add(x, 0)`` and ``Sub(x, 0)`` (:data:`_NEUTRAL`; docs/fusions/cleanup.md) whose
    constant is one element of ``x``'s type and of rank at most ``x``'s (so it adds no axis and
    casts nothing), and whose result is no graph output; ``x + 0`` and ``x - -0`` only where
    ``x`` is never ``-0`` (:data:`_NEUTRAL`); return how many."""
    dropped = 0
    for node in list(graph):
        neutral = _NEUTRAL.get(node.op_type) if node.domain == "" else None
        if neutral is None or node.graph is not graph or node.outputs[0].is_graph_output():
            continue
        for index in neutral[1]:
            constant, x = _constant(node.inputs[index]), node.inputs[1 - index]
            rank = rank_of(x)
            if constant is None or constant.size != 1 or rank is None or constant.ndim > rank:
                continue
            same_type = x.dtype == ir.DataType.from_numpy(constant.dtype)
            if not same_type and node.op_type not in ("And", "Or"):  # And, Or: booleans only
                continue
            element, op = constant.reshape(-1)[0], node.op_type
            signed = op in ("Add", "Sub") and np.signbit(element) == (op == "Sub")  # x + 0, x - -0
            if element == neutral[0] and (not signed or _never_negative_zero(x)):
                node.outputs[0].replace_all_uses_with(x)
                graph.remove(node, safe=True)
                dropped += 1
                break
    return dropped


def explicit_softmax_axis(graph: ir.Graph) -> int:
    """Write ``axis=-1`` on each Softmax that leaves it to its default, the same op from opset
    13 (docs/fusions/cleanup.md); the caller runs it on opset 13 or above only. Return how
    many."""
    done = 0
    for node in graph:
        if node.op_type == "Softmax" and node.domain == "" and "axis" not in node.attributes:
            node.attributes["axis"] = ir.AttrInt64("axis", -1)
            done += 1
    return done


def fold_known_sizes(graph: ir.Graph) -> int:
    """Replace each ``Gather(Shape(x), i)`` (constant ``i``, a scalar or a vector; ``Shape``'s
    ``start``/``end`` honoured) whose dimensions of ``x`` are numbers by a constant
    (docs/fusions/cleanup.md); return how many."""
    folded = 0
    for node in list(graph):
        if node.op_type != "Gather" or node.domain != "" or node.graph is not graph:
            continue
        shape = producer(node.inputs[0], "Shape")
        index = const_array(node.inputs[1])
        sizes = dims(shape.inputs[0]) if shape is not None else None
        if sizes is None or index is None or index.ndim > 1 or node.attributes.get_int("axis", 0):
            continue
        start = shape.attributes.get_int("start", 0)
        sizes = sizes[start : shape.attributes.get_int("end", len(sizes))]
        if not all(-len(sizes) <= i < len(sizes) for i in index.reshape(-1)):
            continue
        picked = [sizes[int(i)] for i in index.reshape(-1)]
        if not all(isinstance(d, int) for d in picked) or node.outputs[0].is_graph_output():
            continue
        array = np.array(picked, np.int64).reshape(index.shape)
        node.outputs[0].replace_all_uses_with(add_initializer(graph, "known_size", array))
        graph.remove(node, safe=True)
        folded += 1
    return folded


def drop_whole_slices(graph: ir.Graph) -> int:
    """Read ``x`` for each Slice of ``x`` with steps of 1 whose result has ``x``'s shape
    (provably, :func:`fusion._ir.same_shape`), whatever its bounds compute to
    (docs/fusions/cleanup.md); return how many."""
    dropped = 0
    for node in list(graph):
        if node.op_type != "Slice" or node.domain != "" or node.graph is not graph:
            continue
        steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
        if len(node.inputs) > 4 and node.inputs[4] is not None and steps is None:
            continue
        whole = dims(node.inputs[0]), dims(node.outputs[0])
        if steps is not None and (steps != 1).any() or None in whole:
            continue
        if not same_shape(*whole) or node.outputs[0].is_graph_output():
            continue
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)
        dropped += 1
    return dropped


def _broadcast_only(expand: ir.Node, matmul: ir.Node) -> bool:
    """Whether ``matmul`` computes the same with the input of ``expand`` (one of its operands)
    as with its output: the Expand keeps the last two axes and the rank, and each batch axis it
    widens from 1 the other operand has at that width (docs/fusions/cleanup.md)."""
    source, wide = dims(expand.inputs[0]), dims(expand.outputs[0])
    others = [v for v in matmul.inputs if v is not expand.outputs[0]]
    other = dims(others[0]) if len(others) == 1 else None
    if None in (source, wide, other) or len(source) != len(wide) or len(wide) < 3:
        return False
    if len(other) != len(wide) or not same_shape(source[-2:], wide[-2:]):
        return False
    return all(
        same_dim(s, w) or (s == 1 and same_dim(o, w))
        for s, w, o in zip(source[:-2], wide[:-2], other[:-2], strict=True)
    )


def drop_neutral_expands(graph: ir.Graph) -> int:
    """Read ``x`` for each ``Expand(x, shape)`` that changes nothing: its result has ``x``'s
    shape (provably), or every reader is a MatMul that broadcasts ``x`` as the Expand would
    (:func:`_broadcast_only`; docs/fusions/cleanup.md); return how many."""
    dropped = 0
    for node in list(graph):
        if node.op_type != "Expand" or node.domain != "" or node.graph is not graph:
            continue
        out = node.outputs[0]
        source, wide = dims(node.inputs[0]), dims(out)
        if out.is_graph_output() or source is None or wide is None:
            continue
        readers = [use.node for use in out.uses()]
        same = same_shape(source, wide)
        if not same and not all(
            r.op_type == "MatMul" and r.domain == "" and _broadcast_only(node, r) for r in readers
        ):
            continue
        out.replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)
        dropped += 1
    return dropped


def drop_same_type_casts(graph: ir.Graph) -> int:
    """Read ``x`` for each ``Cast(x, to)`` whose ``x`` already has the type ``to``, known once
    the values carry their inferred types (docs/fusions/cleanup.md); return how many."""
    dropped = 0
    for node in list(graph):
        if node.op_type != "Cast" or node.domain != "" or node.graph is not graph:
            continue
        source, to = node.inputs[0].dtype, node.attributes.get_int("to")
        if source is None or to is None or source != ir.DataType(to):
            continue
        if node.outputs[0].is_graph_output():
            continue
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        graph.remove(node, safe=True)
        dropped += 1
    return dropped
