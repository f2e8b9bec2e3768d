"""The constants a fold needs that the model computes from constants (a ``ConstantOfShape``,
PyTorch's ``weight_norm`` ``g * v / ||v||``) made tensors first, by onnxscript's folder, where
they are small enough: a BatchNorm's parameters, then the weight and bias of the layer beside a
BatchNorm that can fold. Why, and the bound: docs/fusions/fold_batchnorm.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import onnx_ir as ir
import onnxscript.optimizer

from fusion._ir import KnownShapes, sole_consumer
from fusion.base import CannotFuse
from fusion.fold_batchnorm.across import ACROSS
from fusion.fold_batchnorm.algebra import LINEAR, batchnorm_affine

#: The most elements a computed tensor is made with (64 MiB of float32): more is materialized
#: only by the layer's own fold, never as a step towards it.
LIMIT = 1 << 24

#: The most nodes a constant's computation may have: a weight computed by more is no constant
#: a fold reads (it reads the model's input, or it is a model of its own).
_MAX_NODES = 64


def fold_computed(model: ir.Model, shapes: KnownShapes) -> None:
    """Fold the computations of the BatchNorms' parameters, then of the weights and biases of
    the layers beside a BatchNorm whose parameters are constants, to tensors (in place), where
    each node's output is known (``shapes``) to have at most :data:`LIMIT` elements; the rest
    of the graph is left alone."""
    bns = [n for n in model.graph if n.op_type == "BatchNormalization" and not n.domain]
    _fold(model, (v for bn in bns for v in bn.inputs[1:5]), shapes)
    weights = (v for bn in bns if _constant_parameters(bn) for v in _beside(bn))
    _fold(model, weights, shapes)


def _constant_parameters(bn: ir.Node) -> bool:
    """Whether ``bn`` reads as an inference-mode BatchNorm of constant parameters."""
    try:
        batchnorm_affine(bn)
    except CannotFuse:
        return False
    return True


def _beside(bn: ir.Node) -> Iterator[ir.Value]:
    """The weight and bias of the layer whose output ``bn`` reads, and of the layer that reads
    ``bn``'s output, each across the ops a fold moves across (:data:`ACROSS`)."""
    node = bn.inputs[0].producer()
    while node is not None and node.op_type in ACROSS and node.inputs:
        node = node.inputs[0].producer()
    if node is not None and node.op_type in LINEAR:
        yield from node.inputs[1:3]
    node = sole_consumer(bn.outputs[0])
    while node is not None and node.op_type in ACROSS:
        node = sole_consumer(node.outputs[0])
    if node is not None and node.op_type in LINEAR:
        yield from node.inputs[1:3]


def _fold(model: ir.Model, values: Iterable[ir.Value | None], shapes: KnownShapes) -> None:
    """Fold the computations of ``values`` from constants, nothing else."""
    cone: set[ir.Node] = set()
    for value in values:
        cone |= _computation(value, model.graph)
    if not cone:
        return

    def should_fold(node: ir.Node) -> bool:
        return node in cone and all(_small(shapes(v)) for v in node.outputs)

    onnxscript.optimizer.fold_constants(model, output_size_limit=LIMIT, should_fold=should_fold)


def _computation(value: ir.Value | None, graph: ir.Graph) -> set[ir.Node]:
    """The nodes of ``graph`` that compute ``value`` from constants only; empty where it is a
    constant, no such computation, or one of more than :data:`_MAX_NODES` nodes."""
    nodes: set[ir.Node] = set()
    todo = [value]
    while todo:
        value = todo.pop()
        if value is None or value.const_value is not None:
            continue
        node = value.producer()
        if node is None or node.graph is not graph or len(nodes) >= _MAX_NODES:
            return set()  # a graph input, a subgraph's value, or too much
        if node not in nodes:
            nodes.add(node)
            todo.extend(node.inputs)
    return nodes


def _small(shape: ir.Shape | None) -> bool:
    """Whether ``shape`` is known, numbers only, of at most :data:`LIMIT` elements."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return False
    return math.prod(shape) <= LIMIT
