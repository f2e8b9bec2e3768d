"""Exact forms that keep ONNX Runtime's own LayerNorm fusions (``LayerNormFusion``,
``SimplifiedLayerNormFusion``, run under its default ``ORT_ENABLE_ALL``) from misfiring on a
graph: :func:`avoid_ort_misfusions`, one rewrite per known ONNX Runtime issue
(:data:`ISSUES`). Each is the same function by the ONNX spec; what each avoids and how it was
found: docs/parity.md#judged-as-deployed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    KnownShapes,
    add_initializer,
    const_array,
    opset_version,
    producer,
    replace_output,
    unused_name,
)

#: The ONNX Runtime issue each rewrite of :func:`avoid_ort_misfusions` avoids, by key.
ISSUES = {
    "keepdims": "onnxruntime#30513",
    "constant_last": "onnxruntime#31147",
    "full_rank_scale": "onnxruntime#31980",
}


def avoid_ort_misfusions(model: ir.Model) -> dict[str, int]:
    """Rewrite ``model``'s main graph in place into forms ONNX Runtime's LayerNorm fusions do
    not misread (docs/parity.md#judged-as-deployed):

    - ``keepdims``: each ``ReduceMean`` with ``keepdims=0`` becomes ``ReduceMean`` with
      ``keepdims=1`` and a ``Squeeze`` of the same axes (the fusion matches a ReduceMean read
      by ``Sub`` without checking keepdims);
    - ``constant_last``: a ``Mul`` of a constant and a ``Div``'s output, or an ``Add`` of a
      constant and a ``Mul``'s output, where that output is known to be of rank 1, gets the
      constant as its second input (the fusion takes the last input whose rank is the number
      of axes as the scale or bias: on a rank-1 input that was the Div's own output);
    - ``full_rank_scale``: the constant of such a ``Mul`` or ``Add`` that broadcasts the
      other input to a larger shape gets leading ones up to that input's rank (the fusion
      takes it as a scale of the normalized axes and its kernel then refuses it).

    Each rewrites only where its issue's condition holds, so that a model's rewrites cite the
    issues that concern it and only those.

    Returns:
        How many nodes each rewrite changed, by the keys of :data:`ISSUES` (those that changed
        any).
    """
    graph, opset = model.graph, opset_version(model)
    changed = {"keepdims": sum(_keepdims(graph, node, opset) for node in list(graph))}
    shapes = KnownShapes(model)
    changed["constant_last"] = sum(_constant_last(node, shapes) for node in graph)
    changed["full_rank_scale"] = sum(_full_rank_scale(graph, node, shapes) for node in graph)
    return {key: count for key, count in changed.items() if count}


def _keepdims(graph: ir.Graph, node: ir.Node, opset: int) -> bool:
    """``ReduceMean(keepdims=0)`` as ``Squeeze(ReduceMean(keepdims=1))``, where it reduces
    (``noop_with_empty_axes=1`` with no axes reduces nothing: left alone)."""
    if node.op_type != "ReduceMean" or node.domain != "":
        return False
    if node.attributes.get_int("keepdims", 1) != 0:
        return False
    axes_input = node.inputs[1] if len(node.inputs) > 1 else None
    axes = node.attributes.get_ints("axes", None)
    if axes_input is None and not axes and node.attributes.get_int("noop_with_empty_axes", 0):
        return False
    node.attributes["keepdims"] = ir.AttrInt64("keepdims", 1)
    kept = node.outputs[0]
    if opset < 13:
        squeeze = ir.node("Squeeze", [kept], {"axes": list(axes)} if axes else None)
    else:
        if axes_input is None and axes:
            axes_input = add_initializer(graph, "reduce_axes", np.array(axes, dtype=np.int64))
        squeeze = ir.node("Squeeze", [kept, axes_input] if axes_input is not None else [kept])
    squeezed, original = squeeze.outputs[0], kept.name
    replace_output(graph, kept, squeezed)  # the Squeeze's own input too: set again below
    squeeze.replace_input_with(0, kept)
    kept.name, kept.shape = unused_name(graph, f"{original}_kept"), None
    squeezed.name = original
    graph.insert_after(node, squeeze)
    return True


def _norm_end(node: ir.Node) -> tuple[int, int] | None:
    """For a ``Mul`` reading a ``Div``'s output, or an ``Add`` reading a ``Mul``'s, with a
    constant as its other input: (the constant's index, the other's); else None."""
    reads = {"Mul": "Div", "Add": "Mul"}.get(node.op_type)
    if reads is None or node.domain != "" or len(node.inputs) != 2:
        return None
    for const, other in ((0, 1), (1, 0)):
        if const_array(node.inputs[const]) is not None and producer(node.inputs[other], reads):
            return const, other
    return None


def _constant_last(node: ir.Node, shapes: KnownShapes) -> bool:
    """Swap the inputs of a norm's ``Mul`` or ``Add`` (:func:`_norm_end`) whose constant comes
    first and whose other input is known to be of rank 1 (both ops commute, element by element
    and in broadcasting)."""
    found = _norm_end(node)
    if found is None or found[0] != 0:
        return False
    shape = shapes(node.inputs[1])
    if shape is None or len(shape) != 1:
        return False
    first, second = node.inputs
    node.replace_input_with(0, second)
    node.replace_input_with(1, first)
    return True


def _full_rank_scale(graph: ir.Graph, node: ir.Node, shapes: KnownShapes) -> bool:
    """Give a norm's constant scale or bias (:func:`_norm_end`) of lower rank than the other
    input leading ones up to that rank, where it is known to broadcast that input to a larger
    shape (the same broadcast: leading ones change no result)."""
    found = _norm_end(node)
    if found is None:
        return False
    const, other = found
    array = const_array(node.inputs[const])
    shape = shapes(node.inputs[other])
    if shape is None or array.ndim >= len(shape):
        return False
    aligned = list(shape)[len(shape) - array.ndim :]
    if not any(d == 1 and n > 1 for d, n in zip(aligned, array.shape, strict=True)):
        return False
    full = array.reshape((1,) * (len(shape) - array.ndim) + array.shape)
    node.replace_input_with(const, add_initializer(graph, f"{node.inputs[const].name}_full", full))
    return True
