"""ONNX shape inference as the passes run it: with data propagation (the values of shape
arithmetic) only where no long 1-D value makes it hold gigabytes."""

from __future__ import annotations

import itertools

import onnx_ir as ir
import onnx_ir.passes.common

#: The longest 1-D tensor ONNX's data propagation is run over (elements). It keeps a 1-D
#: tensor's values as shape dimensions, one message per element, for every op it reaches: a
#: waveform of 10 million samples through one Add took 1.4 GB to infer, two ConstantOfShape of
#: that length added 2 GB. A shape vector has a few elements.
LONGEST_PROPAGATED = 1 << 16


def propagates(model: ir.Model) -> bool:
    """Whether ONNX's data propagation may run on ``model``: no value of its main graph or a
    subgraph carries a 1-D shape longer than :data:`LONGEST_PROPAGATED`."""
    values = (v for node in ir.traversal.RecursiveGraphIterator(model.graph) for v in node.outputs)
    values = itertools.chain(values, *(g.inputs for g in model.graphs()))
    return not any(_long_vector(v.shape) for v in values)


def infer_shapes(model: ir.Model) -> None:
    """ONNX shape inference on ``model``, in place (onnx_ir's ``ShapeInferencePass``), with
    data propagation (the values of shape arithmetic: ``Shape -> Gather -> Concat`` into a
    Reshape) where the shapes it carries allow it (:func:`propagates`)."""
    onnx_ir.passes.common.ShapeInferencePass(data_prop=propagates(model))(model)


def _long_vector(shape: ir.Shape | None) -> bool:
    """Whether ``shape`` is 1-D with a known length over :data:`LONGEST_PROPAGATED`."""
    return (
        shape is not None
        and len(shape) == 1
        and isinstance(shape[0], int)
        and shape[0] > LONGEST_PROPAGATED
    )
