"""bfloat16 (``--precision bf16``): a float16 model retyped to bfloat16.

:func:`normexport.precision.to_half` converts to float16 first (ONNX Runtime's converter, the
same block lists and fixes as ``fp16``), then :func:`to_bfloat16` retypes the result: every
float16 type, Cast target and tensor becomes bfloat16, and each initializer and Constant is
rounded to bfloat16 from its float32 original, not from the float16 copy (which clamps 1e5 to
65504 and flushes 1e-8 to zero). bfloat16 has float32's exponent range, so no constant is kept
float32 for its range; decomposed norms are (:func:`normexport.precision.kept.kept_float32`),
since bfloat16 keeps 8 significant bits (a mean over hundreds of values would keep few correct
ones).
Its inputs and outputs stay float32: ONNX Runtime's Python API takes and returns no bfloat16
arrays (numpy has no such type), and parity runs there.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir


def to_bfloat16(model: ir.Model, original: ir.Model) -> None:
    """Retype ``model``, the converter's float16 copy of ``original`` (float32), to bfloat16 in
    place: every float16 value type (graph inputs, outputs, node outputs, in subgraphs too),
    Cast target and ``dtype`` attribute becomes bfloat16, and every float16 initializer and
    tensor attribute (Constant's and ConstantOfShape's ``value``) is rounded to bfloat16 (to
    nearest, ties to even) from its float32 original in ``original``, found by initializer name
    or by the node's first output and the attribute name (the float16 copy's values where it has
    none: tensors float16 in ``original`` too, values the converter added)."""
    sources = _float_tensors(original)
    for graph in (model.graph, *model.graph.subgraphs()):
        values = [*graph.inputs, *graph.initializers.values()]
        values += [out for node in graph for out in node.outputs]
        for value in values:
            value.type = _bfloat16_type(value.type)
        for value in graph.initializers.values():
            if value.const_value is not None and value.const_value.dtype == ir.DataType.FLOAT16:
                value.const_value = _bfloat16(value.const_value, sources.get((value.name, "")))
        for node in graph:
            _bfloat16_attributes(node, sources)


def _bfloat16_attributes(
    node: ir.Node, sources: Mapping[tuple[str, str], ir.TensorProtocol]
) -> None:
    """Retype ``node``'s float16 attributes to bfloat16 (see :func:`to_bfloat16`): an INT ``to``
    (Cast) or ``dtype`` (EyeLike, Random*), a float16 tensor (rounded from its source in
    ``sources``, see :func:`_float_tensors`)."""
    for attr in list(node.attributes.values()):
        if attr.type == ir.AttributeType.INT and attr.name in ("to", "dtype"):
            if attr.value == ir.DataType.FLOAT16:
                node.attributes[attr.name] = ir.AttrInt64(attr.name, ir.DataType.BFLOAT16)
        elif attr.type == ir.AttributeType.TENSOR and attr.value.dtype == ir.DataType.FLOAT16:
            source = sources.get((node.outputs[0].name, attr.name))
            node.attributes[attr.name] = ir.AttrTensor(attr.name, _bfloat16(attr.value, source))


def _float_tensors(model: ir.Model) -> dict[tuple[str, str], ir.TensorProtocol]:
    """The float32 tensors of ``model``: each initializer by ``(name, "")``, each tensor
    attribute by ``(its node's first output, attribute name)`` (in subgraphs too)."""
    found: dict[tuple[str, str], ir.TensorProtocol] = {}
    for graph in (model.graph, *model.graph.subgraphs()):
        for name, value in graph.initializers.items():
            if value.const_value is not None:
                found[(name, "")] = value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and node.outputs:
                    found[(node.outputs[0].name, attr.name)] = attr.value
    return {k: t for k, t in found.items() if t.dtype == ir.DataType.FLOAT}


def _bfloat16_type(kind: ir.TypeProtocol | None) -> ir.TypeProtocol | None:
    """``kind`` with float16 tensor types (also inside sequences and optionals) made
    bfloat16."""
    if isinstance(kind, ir.TensorType) and kind.dtype == ir.DataType.FLOAT16:
        return ir.TensorType(ir.DataType.BFLOAT16)
    if isinstance(kind, (ir.SequenceType, ir.OptionalType)):
        return type(kind)(_bfloat16_type(kind.elem_type))
    return kind


def _bfloat16(tensor: ir.TensorProtocol, source: ir.TensorProtocol | None) -> ir.Tensor:
    """``tensor`` (float16) as bfloat16, rounded from ``source`` (its float32 original) where
    given."""
    values = (source if source is not None else tensor).numpy().astype(np.float32)
    return ir.Tensor(values.astype(ir.DataType.BFLOAT16.numpy()), name=tensor.name)
