"""Shapes of a model's values computed symbolically by ONNX Runtime's
``onnxruntime.tools.symbolic_shape_infer`` (the shape inference ONNX Runtime's transformer
optimizer runs), for :class:`fusion._ir.KnownShapes` where ONNX's own inference leaves a
dimension unknown.

ONNX's inference cannot follow a shape computed at run time from other shapes: the TorchScript
exporter writes ``x.view(B, S, -1, H)`` as ``Reshape(x, Concat(Shape(x)[0], Shape(x)[1], [-1],
[H]))``, and ONNX gives its head count as unknown; the symbolic inference evaluates the target
with sympy (``-1 = hidden / H``) and gives the number. It runs with ``auto_merge=False``: it
never assumes two different symbols equal; where it cannot go on it stops, and the shapes found
up to there are used.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

#: Initializers larger than this (bytes) travel as graph inputs of their shape and type, not
#: as data: the symbolic inference needs their shapes only (a Reshape target is smaller).
_DATA_LIMIT = 1024

_log = logging.getLogger(__name__)


def _proto_without_weights(model: ir.Model):
    """``model`` as a ModelProto whose initializers over :data:`_DATA_LIMIT` bytes are graph
    inputs of the same shape and type (so no 2 GiB protobuf and no weights copied), the others
    held in it (a tensor in external data would be a reference to a file the inference reads
    from its working directory, and fails); the model is a clone, left unchanged."""
    clone = model.clone()
    graph = clone.graph
    for value in list(graph.initializers.values()):
        tensor = value.const_value
        if tensor is None:
            continue
        if tensor.nbytes <= _DATA_LIMIT:  # in the proto itself, not a reference to a file
            value.const_value = ir.tensor(np.array(tensor.numpy()), name=value.name)  # a copy
            continue
        value.shape, value.dtype = ir.Shape(tensor.shape), tensor.dtype
        graph.initializers.pop(value.name)
        value.const_value = None
        if value not in graph.inputs:
            graph.inputs.append(value)
    return ir.serde.serialize_model(clone)


def symbolic_shapes(model: ir.Model) -> dict[str, ir.Shape]:
    """The shape ONNX Runtime's symbolic shape inference gives each named value of ``model``'s
    main graph that it reaches (see the module docstring), or ``{}`` where it cannot run (an op
    it does not know at the start, an opset below 7, sympy missing): the shapes are a help to
    the matchers, never a requirement. Dimensions are numbers or named symbols (sympy
    expressions of the inputs' symbols, such as ``past_sequence_length + sequence_length``)."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError as error:  # sympy missing
        _log.debug("no symbolic shape inference: %s", error)
        return {}
    ort_log = logging.getLogger(SymbolicShapeInference.__module__)
    level = ort_log.level
    ort_log.setLevel(logging.CRITICAL)
    try:
        inference = SymbolicShapeInference(2**31 - 1, False, False, 0)
        # The steps of its ``infer_shapes`` without the file that one writes into the
        # working directory when the inference stops early: the partial result is used.
        inference._preprocess(_proto_without_weights(model))
        while inference.run_:
            inference._infer_impl()
        inference._update_output_from_vi()
        inferred = ir.serde.deserialize_model(inference.out_mp_).graph
    except Exception as error:  # noqa: BLE001 - any failure only means fewer shapes
        _log.debug("symbolic shape inference failed: %s", error)
        return {}
    finally:
        ort_log.setLevel(level)
    values = [v for node in inferred for v in node.outputs]
    return {v.name: v.shape for v in values if v.name and v.shape is not None}
