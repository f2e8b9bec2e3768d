"""What a run of a model holds besides its weights, counted before any session opens: the
values it computes on the example inputs (their shapes inferred by ONNX's shape inference,
nothing run), each alive from the node that makes it to the last node that reads it, and the
largest Conv's unfolded input (im2col). :func:`estimate` gives the :class:`Activations` the
memory plan (:mod:`normexport.runtime.plan`) counts for the raw model's runs and for the float64
oracle's (docs/memory.md#the-memory-plan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

#: Whether shape inference propagates values: not, since that computes the values of the ops
#: it follows, a ``ConstantOfShape`` of 1e8 elements among them (14 GB, onnx 1.23); a shape
#: computed at run time is then unknown, and a Reshape's output counts as its input.
DATA_PROPAGATION = False


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
    -> array; only their shapes and dtypes are read), counted on a clone (tensors shared, none
    loaded): its inputs given the feeds' shapes, its other values' annotations dropped, then
    onnx_ir's ``ShapeInferencePass`` (initializers over 1 KB left out of the protobuf;
    :data:`DATA_PROPAGATION`) and its graph sorted. Subgraphs (``If``, ``Loop``) count
    as their node's outputs.

    Raises nothing: where shape inference fails, every value counts as its producer's
    largest input (at worst the inputs' size).
    """
    clone = model.clone()
    graph = clone.graph
    for value in graph.inputs:
        if value.name in feeds:
            value.shape = ir.Shape(feeds[value.name].shape)
            value.dtype = ir.DataType.from_numpy(feeds[value.name].dtype)
    for value in (v for node in graph for v in node.outputs):
        value.shape = None  # the file's symbolic dimensions would stand over the feeds' sizes
    try:
        inference = common_passes.ShapeInferencePass(
            check_type=False, strict_mode=False, data_prop=DATA_PROPAGATION
        )
        inference(clone)
    except Exception:  # onnx raises its own errors on models it cannot follow: count none
        pass
    with contextlib.suppress(Exception):  # a cycle or an undefined input: the file's order
        graph.sort()
    sizes: dict[str, tuple[int, int]] = {}  # value name -> (bytes, of which float32)
    for name, array in feeds.items():
        sizes[name] = (array.nbytes, array.nbytes if array.dtype == np.float32 else 0)
    users: dict[str, int] = {}
    for step, node in enumerate(graph):
        for value in node.inputs:
            if value is not None:
                users[value.name] = step
    outputs = {v.name for v in graph.outputs}
    unknown = 0
    alive: dict[str, tuple[int, int]] = {n: s for n, s in sizes.items() if n in users}
    live32 = sum(nbytes for nbytes, _ in alive.values())
    live64 = live32 + sum(f32 for _, f32 in alive.values())
    peak32, peak64 = live32, live64
    for step, node in enumerate(graph):
        read = [sizes.get(v.name, (0, 0)) for v in node.inputs if v is not None]
        largest = max(read, default=(0, 0))
        for value in node.outputs:
            found = _bytes(value)
            if found is None:
                unknown += 1
                found = largest
            sizes[value.name] = alive[value.name] = found
            live32, live64 = live32 + found[0], live64 + found[0] + found[1]
        work = _im2col_bytes(node)
        peak32, peak64 = max(peak32, live32 + work), max(peak64, live64 + 2 * work)
        for name in [n for n in alive if users.get(n, -1) <= step and n not in outputs]:
            nbytes, f32 = alive.pop(name)
            live32, live64 = live32 - nbytes, live64 - nbytes - f32
    output_bytes = sum(sizes.get(v.name, (0, 0))[0] for v in graph.outputs)
    return Activations(peak32, peak64, output_bytes, unknown)


def _bytes(value: ir.Value) -> tuple[int, int] | None:
    """``(bytes, bytes if float32 else 0)`` of ``value`` where its type and shape are known."""
    shape, dtype = value.shape, value.dtype
    if shape is None or dtype is None or not shape.is_static():
        return None
    nbytes = int(math.prod(int(d) for d in shape) * dtype.itemsize)
    return nbytes, nbytes if dtype == ir.DataType.FLOAT else 0


def _im2col_bytes(node: ir.Node) -> int:
    """The unfolded input a float32 ``Conv`` works on (MLAS's im2col: one group of one image,
    ``C / group * prod(kernel) * prod(output spatial)`` float32 elements); 0 for any other node,
    a 1x1 kernel, or shapes not known."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return 0
    weight = node.inputs[1].shape if node.inputs[1] is not None else None
    out = node.outputs[0].shape
    if weight is None or not weight.is_static() or out is None or not out.is_static():
        return 0
    kernel = math.prod(int(d) for d in weight[2:])
    if kernel == 1:
        return 0
    spatial = math.prod(int(d) for d in out[2:])  # per image: the batch is looped over
    return int(weight[1]) * kernel * spatial * 4
