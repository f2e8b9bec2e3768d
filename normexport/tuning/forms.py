"""The exact forms of a fused norm: an optimized model with its fused norms rewritten into the
other forms ONNX Runtime can run with the same function (RMSNormalization <->
SimplifiedLayerNormalization, SkipLayerNormalization -> Add + LayerNormalization), for
:mod:`normexport.tuning.autotune` to time.

Op definitions: ONNX operators (onnx.ai/onnx/operators: LayerNormalization since opset 17,
RMSNormalization since opset 23) and ONNX Runtime's contrib operators
(onnxruntime/docs/ContribOperators.md: SkipLayerNormalization,
SkipSimplifiedLayerNormalization in com.microsoft; SimplifiedLayerNormalization, which ORT
registers in the default domain).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from fusion.base import Op
from fusion.graph import opset_version, remove_nodes, replace_output
from fusion.registry import SKIP_NORM_OPS


def _rms_to_simplified(model: ir.Model, node: ir.Node) -> bool:
    if node.op_type != "RMSNormalization" or node.domain != "":
        return False
    _swap_op(model, node, "SimplifiedLayerNormalization")
    return True


def _simplified_to_rms(model: ir.Model, node: ir.Node) -> bool:
    if node.op_type != "SimplifiedLayerNormalization" or opset_version(model) < 23:
        return False
    if len(node.outputs) > 1 and node.outputs[1].uses():  # RMSNormalization has no inv_std out
        return False
    _swap_op(model, node, "RMSNormalization")
    return True


def _swap_op(model: ir.Model, node: ir.Node, op_type: str) -> None:
    """Replace ``node`` by ``op_type`` with the same inputs and attributes (axis, epsilon,
    stash_type: the same math for RMSNormalization and SimplifiedLayerNormalization)."""
    new = ir.node(
        op_type, list(node.inputs), dict(node.attributes), name=f"{node.name}_as_{op_type}"
    )
    model.graph.insert_before(node, new)
    replace_output(model.graph, node.outputs[0], new.outputs[0])
    remove_nodes(model.graph, [node])


def _split_skip(model: ir.Model, node: ir.Node) -> bool:
    """SkipLayerNormalization(x, skip, gamma[, beta[, bias]]) -> Add(Add(x, skip), bias) then
    LayerNormalization(axis -1); the Simplified one -> Add then SimplifiedLayerNormalization (or
    RMSNormalization at opset 23). Output 3 (input + skip + bias) is the sum."""
    if Op(node.op_type, node.domain) not in SKIP_NORM_OPS:
        return False
    if any(v.uses() or v.is_graph_output() for v in node.outputs[1:3]):
        return False  # mean / inv_std outputs have no counterpart in the split form
    simplified = node.op_type == "SkipSimplifiedLayerNormalization"
    x, skip, gamma, *rest = list(node.inputs) + [None] * 3
    beta, bias = (None, rest[0]) if simplified else (rest[0], rest[1])
    graph = model.graph
    new = [ir.node("Add", [x, skip])]
    if bias is not None:
        new.append(ir.node("Add", [new[-1].outputs[0], bias]))
    total = new[-1].outputs[0]
    eps = node.attributes.get_float("epsilon", 1e-5 if not simplified else 1e-6)
    if simplified:
        op = "RMSNormalization" if opset_version(model) >= 23 else "SimplifiedLayerNormalization"
        new.append(ir.node(op, [total, gamma], {"axis": -1, "epsilon": eps}))
    else:
        inputs = [total, gamma] + ([beta] if beta is not None else [])
        new.append(ir.node("LayerNormalization", inputs, {"axis": -1, "epsilon": eps}))
    for n in new:
        graph.insert_before(node, n)
    replace_output(graph, node.outputs[0], new[-1].outputs[0])
    if len(node.outputs) > 3 and (node.outputs[3].uses() or node.outputs[3].is_graph_output()):
        replace_output(graph, node.outputs[3], total)
    remove_nodes(graph, [node])
    return True


#: Exact form name -> node rewrite (returns True when it changed the node). Each rewrite keeps
#: the function; only the op that computes it changes.
FORMS: dict[str, Callable[[ir.Model, ir.Node], bool]] = {
    "rms_as_SimplifiedLayerNormalization": _rms_to_simplified,
    "rms_as_RMSNormalization": _simplified_to_rms,
    "skip_split": _split_skip,
}


def exact_forms(model: Path, *, target: str = "ort") -> dict[str, Path]:
    """``model`` and the exact alternative forms of its fused norms, as files.

    Each form is written beside ``model`` as ``STEM.FORM.onnx`` and shares its external data
    file (the rewrites only swap ops; no tensor is copied).

    Args:
        model: an optimized model's .onnx file (not changed).
        target: ``"onnx"`` leaves out forms that use ONNX Runtime's own ops.

    Returns:
        ``{"as_built": model, form: rewritten model's file, ...}``, only the forms that
        changed at least one node (see :data:`FORMS`).
    """
    model = Path(model)
    out = {"as_built": model}
    for name, rewrite in FORMS.items():
        if target == "onnx" and name == "rms_as_SimplifiedLayerNormalization":
            continue
        copy = ir.load(model)
        changed = [rewrite(copy, node) for node in list(copy.graph)]
        if any(changed):
            out[name] = model.with_name(f"{model.stem}.{name}.onnx")
            ir.save(copy, out[name])  # external tensors keep pointing at model's data file
    return out
