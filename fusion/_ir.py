"""Small graph helpers shared by the fusion passes (onnx_ir models, nothing else)."""

from __future__ import annotations

import ast
import itertools

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from fusion._inference import propagates
from fusion._symbolic import symbolic_shapes


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant behind ``value`` as a numpy array, or None.

    A value is constant when it is an initializer that is not also a graph input (a graph input
    with an initializer is a default the caller may override) or the output of a Constant node.
    """
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The standard-domain (ai.onnx) node of type ``op_type`` that produces ``value``, or None."""
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def label(node: ir.Node) -> str:
    """A name for ``node`` in reports: its name, else its first output's name, else its op."""
    return node.name or (node.outputs[0].name if node.outputs else "") or node.op_type


#: The metadata key under which PyTorch's dynamo exporter records a node's module scopes (its
#: ``nn_module_stack``): a list, the last the op, the one before it the module path.
NAME_SCOPES = "pkg.torch.onnx.name_scopes"


def module_path(node: ir.Node) -> str | None:
    """The path of the ``nn.Module`` the user wrote that ``node`` came from (``layer1.0.bn1``),
    where the exporter recorded it (:data:`NAME_SCOPES`), else None."""
    text = node.metadata_props.get(NAME_SCOPES)
    try:
        scopes = ast.literal_eval(text) if text else None
    except (ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or len(scopes) < 2 or not scopes[-2]:
        return None
    return str(scopes[-2])


def sole_consumer(value: ir.Value) -> ir.Node | None:
    """The only node that reads ``value``, or None if it has several uses or is a graph output."""
    if value.is_graph_output():
        return None
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 else None


def num_consumers(value: ir.Value) -> int:
    """How many times ``value`` is read: its uses by nodes, plus one if it is a graph output."""
    return len(list(value.uses())) + int(value.is_graph_output())


def value_reader(value: ir.Value) -> ir.Node | None:
    """The only node that reads the elements of ``value``, or None (several, or a graph output).

    ``Shape`` and ``Size`` read only the shape, which a rewrite that keeps shapes never changes:
    the TorchScript exporter writes ``x.reshape(x.shape[0], -1)`` with a ``Shape`` of ``x``.
    """
    if value.is_graph_output():
        return None
    readers = [use.node for use in value.uses() if use.node.op_type not in ("Shape", "Size")]
    return readers[0] if len(readers) == 1 else None


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


def scalar_const(value: ir.Value | None) -> float | None:
    """The number behind a one-element constant ``value`` (any shape), or None."""
    array = const_array(value)
    return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None


def rank_of(*values: ir.Value | None) -> int | None:
    """The rank of the first of ``values`` whose shape is known, or None."""
    for value in values:
        if value is not None and value.shape is not None:
            return len(value.shape)
    return None


def reduce_axes(node: ir.Node, rank: int | None) -> tuple[int, ...] | None:
    """The axes a Reduce* node reduces over, as written (may be negative); None if unknown.

    Axes are an attribute below opset 18 and an input from 18. No axes means all axes (which
    needs ``rank``), except under ``noop_with_empty_axes=1``, where the node reduces nothing
    (None). Axes held in a non-constant input are unknown (None). ``GlobalAveragePool`` is the
    mean over every axis after the first two, its output keeping them (Operators.md,
    GlobalAveragePool-1: the "spatial" axes of ``(N, C, D1, ..., Dn)``; tf2onnx writes
    TensorFlow's mean over the last axis of a 3-D tensor so): that needs ``rank``.
    """
    if node.op_type == "GlobalAveragePool":
        return tuple(range(2, rank)) if rank is not None and rank > 2 else None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = const_array(node.inputs[1])
        if array is None:
            return None
        axes = tuple(int(a) for a in array.reshape(-1))
    else:
        axes = tuple(node.attributes.get_ints("axes", ()))
    if axes:
        return axes
    if node.attributes.get_int("noop_with_empty_axes", 0) or rank is None:
        return None
    return tuple(range(rank))


def as_division(node: ir.Node) -> tuple[ir.Value, ir.Value, list[ir.Node]] | None:
    """``(numerator, denominator, inverse_nodes)`` when ``node`` divides a tensor by a value.

    Recognized: ``Div(n, d)``, ``Mul(n, Reciprocal(d))`` and ``Mul(n, Div(1, d))`` (either Mul
    operand order), the inverse maybe times an exact 1 (torch writes ``1.0 / t`` as
    ``Reciprocal(t) * 1``); ``inverse_nodes`` holds the nodes between ``node`` and ``d``. A
    constant numerator makes an inverse, not a division of a tensor: None.
    """
    if len(node.inputs) != 2 or node.domain != "":
        return None
    if node.op_type == "Div" and const_array(node.inputs[0]) is None:
        return node.inputs[0], node.inputs[1], []
    if node.op_type != "Mul":
        return None
    for numerator, inverse in (node.inputs, node.inputs[::-1]):
        if numerator is None or inverse is None or const_array(numerator) is not None:
            continue
        nodes = []
        producer = inverse.producer()
        if producer is not None and producer.op_type == "Mul" and producer.domain == "":
            one = next((v for v in producer.inputs if scalar_const(v) == 1.0), None)
            inverse = other_input(producer, one) if one is not None else None
            nodes = [producer]
            producer = inverse.producer() if inverse is not None else None
        if producer is None or producer.domain != "":
            continue
        if producer.op_type == "Reciprocal":
            return numerator, producer.inputs[0], [*nodes, producer]
        if producer.op_type == "Div" and scalar_const(producer.inputs[0]) == 1.0:
            return numerator, producer.inputs[1], [*nodes, producer]
    return None


def escaping_value(nodes: list[ir.Node], *keep: ir.Value) -> ir.Value | None:
    """An output of ``nodes`` other than those in ``keep`` that is read outside them, or None.

    A value counts as read outside when a node not in ``nodes`` uses it or it is a graph output.
    """
    inside = set(nodes)
    for node in nodes:
        for value in node.outputs:
            if any(value is k for k in keep):
                continue
            if value.is_graph_output() or any(use.node not in inside for use in value.uses()):
                return value
    return None


def remove_nodes(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove ``nodes`` (whose outputs must be unused by then) and the constants only they read.

    A Constant node or an initializer (not a graph input) that no remaining node reads goes too.
    """
    inputs = {value for node in nodes for value in node.inputs if value is not None}
    graph.remove(nodes, safe=True)
    for value in inputs:
        drop_if_unused(graph, value)


def drop_if_unused(graph: ir.Graph, value: ir.Value | None) -> None:
    """Remove the constant ``value`` (an initializer of ``graph`` that is not a graph input, or
    the output of a Constant node in it) when nothing reads it any more; else do nothing."""
    if value is None or value.uses() or value.is_graph_output() or value.is_graph_input():
        return
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.graph is graph:
        graph.remove(producer, safe=True)
    elif value.is_initializer() and graph.initializers.get(value.name) is value:
        graph.initializers.pop(value.name)


def set_input(graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, hint: str) -> None:
    """Make input ``index`` of ``node`` a new initializer holding ``array``, named after ``hint``
    (adding the input slot if ``node`` has fewer inputs); the old constant goes if unused."""
    if index >= len(node.inputs):
        node.resize_inputs(index + 1)
    old = node.inputs[index]
    node.replace_input_with(index, add_initializer(graph, hint, array))
    drop_if_unused(graph, old)


def unused_name(graph: ir.Graph, hint: str) -> str:
    """``hint``, or ``hint_<n>``: a value name that no input, initializer or node output of
    ``graph`` has."""
    taken = {v.name for v in graph.inputs} | set(graph.initializers)
    taken |= {v.name for node in graph for v in node.outputs}
    name, n = hint, 0
    while name in taken:
        n += 1
        name = f"{hint}_{n}"
    return name


def fully_known(shape: ir.Shape | None) -> bool:
    """Whether every dimension of ``shape`` is a number or a named symbol."""
    return shape is not None and all(isinstance(d, int) or d.value is not None for d in shape)


def fresh(dim: int | ir.SymbolicDim) -> bool:
    """Whether ``dim`` is named ``unk__N``, as ONNX shape inference and tf2onnx name a size they
    do not know: a dimension of its own, unrelated to any other by its name."""
    return not isinstance(dim, int) and dim.value is not None and dim.value.startswith("unk__")


def _vague(shape: ir.Shape | None) -> bool:
    """Whether ONNX shape inference left ``shape`` (or a dimension of it) unknown: no shape, a
    dimension with no name, or a :func:`fresh` one."""
    if shape is None:
        return True
    return any(not isinstance(d, int) and (d.value is None or fresh(d)) for d in shape)


class KnownShapes:
    """Static shapes (and element types) of a model's values, in its main graph and its
    subgraphs, for passes that need more than the model carries.

    A value's own shape is used when every dimension is known (a number or a named symbol), its
    own type when it has one. Otherwise ONNX shape inference is run on a clone of the whole
    model (which shares the tensors; the model itself is not changed), the first time such a
    value is asked about: the TorchScript exporter, for one, leaves most intermediate shapes
    out. It runs without data propagation, then, on a fresh clone, with it where no 1-D value
    is too long for it (:func:`propagates`). ONNX's inference goes into the subgraphs of
    ``If``, ``Loop`` and ``Scan`` with the outer scope's shapes; each graph's values are
    matched with the clone's by name within that graph. Where that inference leaves main-graph
    dimensions unknown, ONNX Runtime's symbolic inference (:mod:`fusion._symbolic`) gives them
    where it can. Call the instance with a value to get its shape, or None when neither source
    knows it; :meth:`dtype` gives its element type. Values that a pass creates after that
    first inference are answered from what they carry.

    Args:
        model: the model, or a :class:`fusion._scopes.Scope` of it (its ``main`` is used).
    """

    def __init__(self, model: ir.Model):
        self._model: ir.Model = getattr(model, "main", model)
        self._inferred: dict[ir.Value, ir.Value] | None = None

    def _inference(self, value: ir.Value) -> ir.Value | None:
        """The clone's copy of ``value`` after shape inference (None if it has no name there)."""
        if self._inferred is None:
            options = {"check_type": False, "strict_mode": False}
            clone = self._model.clone()
            onnx_ir.passes.common.ShapeInferencePass(**options, data_prop=False)(clone)
            if propagates(clone):  # once more, with the values of shape arithmetic
                clone = self._model.clone()
                onnx_ir.passes.common.ShapeInferencePass(**options, data_prop=True)(clone)
            self._inferred = {}
            for graph, inferred in zip(self._model.graphs(), clone.graphs(), strict=True):
                theirs = _graph_values(inferred)
                mine = _graph_values(graph).items()
                self._inferred.update({v: theirs[n] for n, v in mine if n in theirs})
            if any(_vague(v.shape) for node in clone.graph for v in node.outputs):
                self._sharpen()
        return self._inferred.get(value)

    def _sharpen(self) -> None:
        """Give the inferred main-graph values that ONNX's inference left vague
        (:func:`_vague`) the shape ONNX Runtime's symbolic inference finds
        (:mod:`fusion._symbolic`), of the same rank."""
        mine = _graph_values(self._model.graph)
        for name, shape in symbolic_shapes(self._model).items():
            found = self._inferred.get(mine.get(name))
            vague = found is not None and _vague(found.shape)
            if vague and (found.shape is None or len(found.shape) == len(shape)):
                found.shape = shape

    def __call__(self, value: ir.Value) -> ir.Shape | None:
        if fully_known(value.shape):
            return value.shape
        inferred = self.inferred(value)
        return inferred if inferred is not None else value.shape

    def inferred(self, value: ir.Value) -> ir.Shape | None:
        """The shape inference gives ``value`` (ONNX's; where it left dimensions vague, ONNX
        Runtime's symbolic one), whatever ``value`` carries; None where neither gives one."""
        inferred = self._inference(value)
        return inferred.shape if inferred is not None else None

    def dtype(self, value: ir.Value) -> ir.DataType | None:
        """The element type of ``value``, or None when neither source knows it."""
        if value.dtype is not None:
            return value.dtype
        inferred = self._inference(value)
        return inferred.dtype if inferred is not None else None


def _graph_values(graph: ir.Graph) -> dict[str, ir.Value]:
    """The named values of ``graph`` itself (inputs, initializers, node outputs; not those of
    its subgraphs), by name."""
    return ir.convenience.create_value_mapping(graph, include_subgraphs=False)


def same_dim(a: int | ir.SymbolicDim, b: int | ir.SymbolicDim) -> bool:
    """Whether two dimensions are provably equal (equal numbers, or the same named symbol)."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a.value is not None and a.value == b.value


def same_shape(a, b) -> bool:
    """Whether two sequences of dimensions are provably equal, axis by axis (:func:`same_dim`:
    two unknown dimensions are not; onnx_ir's ``==`` says they are)."""
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b, strict=True))


def dims(value: ir.Value | None) -> list[int | ir.SymbolicDim] | None:
    """The dimensions of ``value``'s shape, or None where its shape is unknown."""
    shape = value.shape if value is not None else None
    return None if shape is None else list(shape.dims)


def shape_text(shape: ir.Shape) -> str:
    """``(batch, 4, 64)``: a shape for a message, unknown dimensions as ``?``."""
    names = [str(d) if isinstance(d, int) or d.value is not None else "?" for d in shape]
    return f"({', '.join(names)})"
