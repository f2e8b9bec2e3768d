"""Small graph helpers shared by the fusion passes (onnx_ir models, nothing else)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant behind ``value`` as a numpy array, or None.

    A value is constant when it is an initializer that is not also a graph input (a graph input
    with an initializer is a default the caller may override) or the output of a Constant node.
    """
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def sole_consumer(value: ir.Value) -> ir.Node | None:
    """The only node that reads ``value``, or None if it has several uses or is a graph output."""
    if value.is_graph_output():
        return None
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 else None


def opset_version(model: ir.Model, domain: str = "") -> int:
    """The model's opset version for ``domain`` ("" is ai.onnx); 0 when it imports none."""
    return model.opset_imports.get(domain, model.graph.opset_imports.get(domain, 0))


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """For a two-input node (Add, Mul, Sub, Div), the input that is not ``value``."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is value:
        return b
    return a if b is value else None


_counter = itertools.count()


def add_initializer(graph: ir.Graph, hint: str, array: np.ndarray) -> ir.Value:
    """Register ``array`` as a new initializer named after ``hint`` (made unique) and return it."""
    name = f"{hint}"
    while name in graph.initializers:
        name = f"{hint}_{next(_counter)}"
    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        const_value=ir.tensor(array, name=name),
    )
    graph.register_initializer(value)
    return value


def replace_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Point every user of ``old`` at ``new``; a graph output keeps its name and type info."""
    if old.is_graph_output():
        new.name = old.name
        old.name = None
    if new.type is None:
        new.type = old.type
    if new.shape is None:
        new.shape = old.shape
    old.replace_all_uses_with(new, replace_graph_outputs=True)
