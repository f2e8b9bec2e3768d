"""A dense layer with constant weights as the exporters write ``nn.Linear``: ``x @ W`` or
``x @ W + b`` (the MatMul, then an Add of the bias on either side), ``W`` ``(D, width)``, ``b``
``(width,)`` (:func:`dense`); and the layer made of some of its columns (:func:`columns`). Used
by docs/fusions/fuse_attention.md and docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import add_initializer, const_array, dims, producer


@dataclasses.dataclass
class Dense:
    """``x @ weight (+ bias)``.

    Attributes:
        x: the layer's input, ``(..., D)``.
        weight: ``(D, width)``.
        bias: ``(width,)``, or None where there is no Add.
        nodes: the Add (where there is one), then the MatMul.
    """

    x: ir.Value
    weight: np.ndarray
    bias: np.ndarray | None
    nodes: list[ir.Node]


def dense(value: ir.Value) -> Dense | None:
    """``value`` as a :class:`Dense` layer with an input of rank 3, or None."""
    add = producer(value, "Add")
    bias, nodes = None, []
    if add is not None:
        constants = [const_array(v) for v in add.inputs]
        side = 1 if constants[1] is not None else 0
        bias, value, nodes = constants[side], add.inputs[1 - side], [add]
    matmul = producer(value, "MatMul")
    weight = const_array(matmul.inputs[1]) if matmul is not None else None
    if weight is None or weight.ndim != 2 or len(dims(matmul.inputs[0]) or ()) != 3:
        return None
    if add is not None and (bias is None or bias.shape != (weight.shape[1],)):
        return None
    return Dense(matmul.inputs[0], weight, bias, [*nodes, matmul])


def columns(
    graph: ir.Graph, layer: Dense, start: int, stop: int, inserted: list[ir.Node]
) -> ir.Value:
    """``x @ W[:, start:stop] (+ b[start:stop])``, new nodes appended to ``inserted`` (their
    weights new initializers of ``graph``): the layer's output columns ``start`` to ``stop``,
    each computed from the same row and column as in the whole layer."""
    shape = ir.Shape([*dims(layer.x)[:-1], stop - start])
    weight = add_initializer(graph, "dense_columns", layer.weight[:, start:stop].copy())
    steps = [("MatMul", weight)]
    if layer.bias is not None:
        steps.append(("Add", add_initializer(graph, "dense_bias", layer.bias[start:stop].copy())))
    out = layer.x
    for op, constant in steps:
        node = ir.node(op, [out, constant])
        inserted.append(node)
        out = node.outputs[0]
        out.shape, out.dtype = shape, layer.x.dtype
    return out
