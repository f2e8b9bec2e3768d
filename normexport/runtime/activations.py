"""What a run of a model holds besides its weights, counted before any session opens: the
values it computes on the example inputs (their shapes inferred by ONNX's shape inference,
nothing run), each alive from the node that makes it to the last node that reads it, and the
largest Conv's unfolded input (im2col); apart from them, the values it computes from its
weights alone (a ``Transpose`` of a weight, as an exporter writes a linear layer with its
optimizer off), which ONNX Runtime holds all at once. :func:`estimate` gives the
:class:`Activations` the memory plan (:mod:`normexport.runtime.plan`) counts for the raw model's
runs and for the float64 oracle's, :func:`computed_from_weights` those values one by one for
the blocks' cuts (:mod:`normexport.verdict.blocks`); docs/memory.md#the-memory-plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

#: Initializers and ``Constant`` nodes of an integer type with at most this many elements are
#: given to shape inference with their values (a Reshape's target shape, a Slice's bounds, a
#: ReduceMean's axes); larger ones by type and shape only.
#: Shape inference runs without data propagation: that computes the values of the ops it
#: follows, a ``ConstantOfShape`` of 1e8 elements among them (14 GB, onnx 1.19); a shape
#: computed at run time is then unknown, and a Reshape's output counts as its input.
VALUES_KEPT = 1024


@dataclasses.dataclass(frozen=True)
class Activations:
    """A run's memory besides its weights (bytes).

    Attributes:
        peak_bytes: the most bytes of values alive at once in a float32 run of the main graph
            in topological order (a value's bytes where shape inference fixes its shape,
            else those of its node's largest input computed at run time), with the largest
            Conv's unfolded input (``C / group * prod(kernel) * prod(output spatial)``
            elements) on top; the values computed from the weights alone are not among them.
        float64_peak_bytes: the same with every float32 value in float64 (twice its bytes):
            the float64 oracle's run.
        weight_values_bytes: the values computed from the weights alone
            (:func:`computed_from_weights`), all of them: ONNX Runtime runs a node as soon as
            its inputs are ready, and its priority order runs every such node before the
            ``Cast`` it inserts in front of a half-precision weight's first reader (the
            cast's node index is the graph's last), so a run holds them at once, on top of
            the weights (docs/memory.md#the-memory-plan).
        float64_weight_values_bytes: the same with every float32 value in float64.
        output_bytes: the graph outputs' bytes in float32 (what each reference keeps per
            input set).
        unknown: values whose shape inference could not fix (counted by their node's
            largest input).
    """

    peak_bytes: int
    float64_peak_bytes: int
    output_bytes: int
    unknown: int
    weight_values_bytes: int = 0
    float64_weight_values_bytes: int = 0


def estimate(model: ir.Model, feeds: Mapping[str, np.ndarray]) -> Activations:
    """The :class:`Activations` of ``model``'s main graph run on ``feeds`` (graph input name
    -> array; only their shapes and dtypes are read). No tensor is loaded: initializers are
    given to shape inference by their headers, small integer ones (:data:`VALUES_KEPT`) with
    their values. Subgraphs (``If``, ``Loop``) count as their node's outputs.

    Raises nothing: where shape inference fails, every value counts as its producer's
    largest input (at worst the inputs' size). The protobuf is built here rather than by
    cloning the model for onnx_ir's ``ShapeInferencePass``: its clone refuses graphs whose
    nodes are out of order or read values nothing makes (files from the field: ONNX Runtime's
    test files, the fuzzer's cycles and dangling inputs).
    """
    graph = model.graph
    sizes: dict[str, tuple[int, int]] = {}  # value name -> (bytes, of which float32)
    for name, array in feeds.items():
        sizes[name] = (array.nbytes, array.nbytes if array.dtype == np.float32 else 0)
    inferred = _inferred(model, feeds)
    order = _topological(graph)
    weight_values = _weight_values(graph, order, inferred)
    users: dict[str, int] = {}
    for step, node in enumerate(order):
        for value in node.inputs:
            if value is not None:
                users[value.name] = step
    outputs = {v.name for v in graph.outputs}
    unknown, im2col = 0, 0
    alive: dict[str, tuple[int, int]] = {n: s for n, s in sizes.items() if n in users}
    live32 = sum(nbytes for nbytes, _ in alive.values())
    live64 = live32 + sum(f32 for _, f32 in alive.values())
    peak32, peak64 = live32, live64
    for step, node in enumerate(order):
        if node.outputs and all(v.name in weight_values for v in node.outputs):
            continue  # held with the weights, counted apart
        read = [sizes.get(v.name, (0, 0)) for v in node.inputs if v is not None]
        largest = max(read, default=(0, 0))
        made = []
        for value in node.outputs:
            found = inferred.get(value.name)
            if found is None:
                unknown += 1
                found = largest
            sizes[value.name] = found
            made.append((value.name, found))
        work = _im2col_bytes(node, inferred)
        im2col = max(im2col, work)
        for name, (nbytes, f32) in made:
            alive[name] = (nbytes, f32)
            live32, live64 = live32 + nbytes, live64 + nbytes + f32
        peak32, peak64 = max(peak32, live32 + work), max(peak64, live64 + 2 * work)
        for name in [n for n in alive if users.get(n, -1) <= step and n not in outputs]:
            nbytes, f32 = alive.pop(name)
            live32, live64 = live32 - nbytes, live64 - nbytes - f32
    output_bytes = sum(sizes.get(v.name, (0, 0))[0] for v in graph.outputs)
    held = sum(nbytes for nbytes, _ in weight_values.values())
    held64 = held + sum(f32 for _, f32 in weight_values.values())
    return Activations(peak32, peak64, output_bytes, unknown, held, held64)


def computed_from_weights(model: ir.Model) -> dict[str, int]:
    """The values of ``model``'s main graph that its nodes compute from the weights alone
    (initializers and ``Constant`` nodes, through nodes without subgraphs), by name -> bytes
    (in their own types: where shape inference does not fix a value's shape, its node's
    largest input's). ONNX Runtime computes them when the session runs, not when it opens
    (the verdict's sessions fold no constants), and holds them at once with the weights
    (:class:`Activations`); no tensor is loaded to count them.
    """
    graph = model.graph
    found = _weight_values(graph, _topological(graph), _inferred(model, {}))
    return {name: nbytes for name, (nbytes, _) in found.items()}


def _weight_values(
    graph: ir.Graph, order: list[ir.Node], inferred: Mapping[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    """Value name -> (bytes, bytes if float32 else 0) of the values computed from the weights
    alone (:func:`computed_from_weights`), ``order`` the graph's nodes in topological order."""
    constant: dict[str, tuple[int, int]] = {}  # the weights themselves, by their headers
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            f32 = tensor.nbytes if tensor.dtype == ir.DataType.FLOAT else 0
            constant[value.name] = (tensor.nbytes, f32)
    found: dict[str, tuple[int, int]] = {}
    for node in order:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            constant.update({v.name: (0, 0) for v in node.outputs})  # in the graph itself
            continue
        read = [v for v in node.inputs if v is not None]
        subgraph = any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in node.attributes.values()
        )
        if not read or subgraph or any(v.name not in constant for v in read):
            continue
        largest = max(constant[v.name] for v in read)
        for value in node.outputs:
            found[value.name] = constant[value.name] = inferred.get(value.name, largest)
    return found


def _inferred(model: ir.Model, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    """Value name -> (bytes, bytes if float32 else 0) for every value of the main graph whose
    type and shape ONNX's shape inference fixes on ``feeds``' shapes; empty where it fails."""
    graph = model.graph
    inputs = [
        onnx.helper.make_tensor_value_info(
            v.name,
            onnx.helper.np_dtype_to_tensor_dtype(feeds[v.name].dtype),
            feeds[v.name].shape,
        )
        for v in graph.inputs
        if v.name in feeds
    ]
    initializers = []
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is None or value.name in feeds:
            continue
        if tensor.size <= VALUES_KEPT and tensor.dtype.is_integer():
            initializers.append(ir.serde.serialize_tensor(tensor))
        else:
            shape = [int(d) for d in tensor.shape]
            inputs.append(onnx.helper.make_tensor_value_info(value.name, tensor.dtype, shape))
    nodes, found = [], {}
    for node in graph:
        value = _small_integer_constant(node)
        if value is not None:
            initializers.append(ir.serde.serialize_tensor(value))
            found[value.name] = (value.nbytes, 0)
        else:
            nodes.append(ir.serde.serialize_node(node))
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "estimate", inputs, [], initializers),
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()],
        ir_version=max(model.ir_version or 0, 7),
    )
    try:
        proto = onnx.shape_inference.infer_shapes(proto)  # no data_prop: it computes values
    except Exception:  # onnx raises its own errors on models it cannot follow: count none
        return {}
    for info in proto.graph.value_info:
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if not tensor.HasField("shape") or None in dims or tensor.elem_type == 0:
            continue
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        nbytes = math.prod(dims) * itemsize
        found[info.name] = (nbytes, nbytes if tensor.elem_type == onnx.TensorProto.FLOAT else 0)
    return found


def _small_integer_constant(node: ir.Node) -> ir.Tensor | None:
    """The value of a ``Constant`` node of an integer type with at most :data:`VALUES_KEPT`
    elements, named as its output (exporters write a Reshape's target shape or a reduction's
    axes so when their optimizer is off: shape inference reads an initializer's value, not a
    node's), else None (a malformed ``Constant`` too: the checker's to say)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or not node.outputs:
        return None
    try:
        tensor = ir.convenience.get_const_tensor(node.outputs[0])
    except ValueError:  # onnx-ir on an attribute a Constant does not have
        return None
    if tensor is None or tensor.size > VALUES_KEPT or not tensor.dtype.is_integer():
        return None
    return ir.tensor(tensor.numpy(), dtype=tensor.dtype, name=node.outputs[0].name)


def _im2col_bytes(node: ir.Node, inferred: Mapping[str, tuple[int, int]]) -> int:
    """The unfolded input a float32 ``Conv`` works on (MLAS's im2col: one group of one image,
    ``C / group * prod(kernel) * prod(output spatial)`` float32 elements); 0 for any other node,
    a 1x1 kernel, or shapes not known."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return 0
    weight = node.inputs[1].shape if node.inputs[1] is not None else None
    out = node.outputs[0].name
    if weight is None or not weight.is_static() or out not in inferred:
        return 0
    kernel = math.prod(int(d) for d in weight[2:])
    if kernel == 1:
        return 0
    cout = int(weight[0])
    spatial = inferred[out][0] // 4 // max(cout, 1)  # per image: the batch is looped over
    return int(weight[1]) * kernel * spatial * 4


def _topological(graph: ir.Graph) -> list[ir.Node]:
    """The main graph's nodes in an order that computes each value before it is read (files
    from the field are not always sorted; Kahn's algorithm), without changing the graph.
    Nodes on a cycle or reading a value nothing makes come last, in the file's order."""
    nodes = list(graph)
    index = {id(n): i for i, n in enumerate(nodes)}
    waiting = [0] * len(nodes)
    readers: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        producers = {index.get(id(v.producer())) for v in node.inputs if v is not None}
        producers.discard(None)
        waiting[i] = len(producers)
        for p in producers:
            readers[p].append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for r in readers[i]:
            waiting[r] -= 1
            if waiting[r] == 0:
                ready.append(r)
    placed = set(order)
    order += [i for i in range(len(nodes)) if i not in placed]
    return [nodes[i] for i in order]
