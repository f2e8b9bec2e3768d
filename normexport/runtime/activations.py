"""What a run of a model holds besides its weights, counted before any session opens: the
values it computes on the example inputs (their shapes inferred by ONNX's shape inference,
nothing run), each alive from the node that makes it to the last node that reads it, and the
largest Conv's unfolded input (im2col). :func:`estimate` gives the :class:`Activations` the
memory plan (:mod:`normexport.runtime.plan`) counts for the raw model's runs and for the float64
oracle's (docs/memory.md#the-memory-plan).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

#: Initializers with at most this many elements are given to shape inference with their
#: values (a Reshape's target shape, a Slice's bounds); larger ones by type and shape only.
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
            else those of its node's largest input), with the largest Conv's unfolded input
            (``C / group * prod(kernel) * prod(output spatial)`` elements) on top.
        float64_peak_bytes: the same with every float32 value in float64 (twice its bytes):
            the float64 oracle's run.
        output_bytes: the graph outputs' bytes in float32 (what each reference keeps per
            input set).
        unknown: values whose shape inference could not fix (counted by their node's
            largest input).
    """

    peak_bytes: int
    float64_peak_bytes: int
    output_bytes: int
    unknown: int


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
    return Activations(peak32, peak64, output_bytes, unknown)


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
    nodes = [ir.serde.serialize_node(node) for node in graph]
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "estimate", inputs, [], initializers),
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()],
        ir_version=max(model.ir_version or 0, 7),
    )
    try:
        proto = onnx.shape_inference.infer_shapes(proto)  # no data_prop: it computes values
    except Exception:  # onnx raises its own errors on models it cannot follow: count none
        return {}
    found = {}
    for info in proto.graph.value_info:
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if not tensor.HasField("shape") or None in dims or tensor.elem_type == 0:
            continue
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        nbytes = math.prod(dims) * itemsize
        found[info.name] = (nbytes, nbytes if tensor.elem_type == onnx.TensorProto.FLOAT else 0)
    return found


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
