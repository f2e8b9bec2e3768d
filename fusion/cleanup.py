"""Exact graph clean-up run before and after the fusion passes: constant folding, the
simplifications of :mod:`fusion.simplify`, zero Pads into Convs, Constant nodes made
initializers, common-subexpression elimination and dead-node removal (:func:`cleanup`), the
clean-up with inferred shapes (:class:`SimplifyWithShapes`), and the mending of old or malformed
inputs (:func:`normalize_ir_version`, :func:`drop_malformed_zero_conv_bias`).

What each step does and why it is exact: see docs/fusions/cleanup.md.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnx_ir.passes.common
import onnxscript.optimizer
import onnxscript.rewriter
from onnxscript.rewriter.rules import common as rules

from fusion._ir import const_array, opset_version
from fusion.shapes import DropShapes, FillShapes
from fusion.simplify import simplify, with_shapes

#: onnxscript's rules that fold a constant-mode Pad of zeros on the spatial axes into the Conv
#: (or ConvInteger) that reads it, as its ``pads`` (docs/fusions/cleanup.md).
_PAD_INTO_CONV = onnxscript.rewriter.RewriteRuleSet(
    [rules.fuse_pad_into_conv_rule, rules.fuse_pad_into_conv_integer_rule]
)

# The folder logs a warning for each node it tries and cannot evaluate; that node just stays.
_folder_log = logging.getLogger("onnxscript.optimizer._constant_folding")


def cleanup(model: ir.Model, final: bool = False, *, infer: bool = False) -> None:
    """Fold constants (a Concat of constants only it reads whatever its size,
    :func:`_own_concat`; with ``infer``, the folder's own shape inference node by node, which
    makes a dimension a model names but inference proves a number that number, so that the
    ``Shape`` of it folds: docs/fusions/cleanup.md), simplify the index arithmetic
    (:mod:`fusion.simplify`; ``final``: after the fusion passes, also the Slices that tile an
    axis), fold zero Pads into the Convs that read them (:data:`_PAD_INTO_CONV`), make the
    Constant nodes initializers, merge common subexpressions, drop dead nodes, sort (in place)."""
    drop_absent_outputs(model)
    canonical_axes(model)
    level = _folder_log.level
    _folder_log.setLevel(logging.ERROR)
    try:
        onnxscript.optimizer.fold_constants(
            model, should_fold=_own_concat, onnx_shape_inference=infer
        )
    finally:
        _folder_log.setLevel(level)
    if opset_version(model) >= 11:  # Pad's pads an input
        _PAD_INTO_CONV.apply_to_model(model)
    if opset_version(model) >= 13:
        simplify(model.graph, final)
    ir.passes.common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    ir.passes.common.CommonSubexpressionEliminationPass()(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.passes.common.TopologicalSortPass()(model)


def _own_concat(node: ir.Node) -> bool | None:
    """True (fold, whatever the sizes) for a Concat of constants that only it reads
    (docs/fusions/cleanup.md); else None, the folder's own rules."""
    if node.op_type != "Concat" or node.domain != "":
        return None
    inputs = [v for v in node.inputs if v is not None]
    own = all(v.const_value is not None and not v.is_graph_input() for v in inputs)
    return True if own and all(len(v.uses()) == 1 for v in inputs) else None


def cleanup_with_types(model: ir.Model) -> None:
    """:func:`cleanup` as :func:`fusion.optimize` runs it before its passes (in place): once,
    then with the types and shapes :class:`fusion.FillShapes` gives the values
    (:class:`SimplifyWithShapes`), which :class:`fusion.DropShapes` takes off again. For a model
    cleaned up but not optimized (a caller's export), so that the passes find nothing more to
    clean up: a model they leave alone keeps its ops."""
    fill = FillShapes()
    ir.passes.PassManager([Cleanup(), fill, SimplifyWithShapes(), DropShapes(fill)])(model)


class Cleanup(ir.passes.InPlacePass):
    """:func:`cleanup` as a pass (it reports no change: its rewrites cannot change a number).

    Args:
        final: the clean-up after the fusion passes (:func:`cleanup`'s ``final``).
    """

    def __init__(self, final: bool = False):
        super().__init__()
        self.final = final

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        cleanup(model, self.final)
        return ir.passes.PassResult(model, modified=False)


class SimplifyWithShapes(ir.passes.InPlacePass):
    """:func:`cleanup` (with the folder's shape inference, ``infer``) once the values carry the
    types :class:`fusion.FillShapes` gave them, then :func:`fusion.simplify.with_shapes`
    (rewrites that read those shapes; opset 13 and above, as :func:`fusion.simplify.simplify`)
    and :func:`cleanup` again, as long as it rewrites anything (in place; it reports no change).
    Why, and why it ends: docs/fusions/cleanup.md."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        cleanup(model, infer=True)
        while opset_version(model) >= 13 and with_shapes(model.graph):
            cleanup(model, infer=True)
        return ir.passes.PassResult(model, modified=False)


def drop_absent_outputs(model: ir.Model) -> int:
    """Drop the trailing outputs named '' (absent optional outputs) of each main-graph node;
    return how many nodes changed. The same node by the spec; it must run before the folder
    (docs/fusions/cleanup.md).
    """
    changed = 0
    for node in model.graph:
        keep = len(node.outputs)
        while keep > 1 and not node.outputs[keep - 1].name:
            out = node.outputs[keep - 1]
            if out.uses() or out.is_graph_output():
                break
            keep -= 1
        if keep < len(node.outputs):
            node.resize_outputs(keep)
            changed += 1
    return changed


def _input_rank(value: ir.Value | None) -> int | None:
    """The rank of ``value`` from its shape or its constant tensor, or None."""
    if value is None:
        return None
    if value.shape is not None:
        return len(value.shape)
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else len(tensor.shape)


def canonical_axes(model: ir.Model) -> int:
    """Write the ``axes`` attribute of each main-graph Unsqueeze / Squeeze (opset < 13) as
    sorted non-negative axes where the input rank is known; return how many nodes changed.

    The same node by the spec; the attribute form only (docs/fusions/cleanup.md).
    """
    if opset_version(model) >= 13:
        return 0
    changed = 0
    for node in model.graph:
        if node.op_type not in ("Unsqueeze", "Squeeze") or node.domain != "":
            continue
        axes = node.attributes.get_ints("axes", None)
        rank = _input_rank(node.inputs[0] if node.inputs else None)
        if not axes or rank is None:
            continue
        rank = rank + len(axes) if node.op_type == "Unsqueeze" else rank
        if any(not -rank <= a < rank for a in axes):
            continue  # invalid: left for the checker to report
        canonical = sorted(a % rank for a in axes)
        if len(set(canonical)) != len(canonical) or canonical == list(axes):
            continue
        node.attributes["axes"] = ir.AttrInt64s("axes", canonical)
        changed += 1
    return changed


def normalize_ir_version(model: ir.Model) -> str | None:
    """Raise an IR-version-3 model to version 4 with the same meaning, in place: the
    initializers listed among the graph inputs are dropped from them and ``ir_version`` set to 4
    (why that is the same model: docs/fusions/cleanup.md). Models of version 4 and up are
    left alone.

    Returns:
        A sentence for the report, or None when nothing changed.
    """
    if model.ir_version >= 4:
        return None
    old = model.ir_version
    graph = model.graph
    listed = [v for v in graph.inputs if v.name in graph.initializers]
    for value in listed:
        graph.inputs.remove(value)
    model.ir_version = 4
    dropped = f"; {len(listed)} initializers no longer listed as graph inputs" if listed else ""
    return (
        f"IR version {old} raised to 4 (its initializers are constants, as ONNX Runtime reads "
        f"IR < 4){dropped}"
    )


def drop_malformed_zero_conv_bias(model: ir.Model) -> None:
    """Work around a torch 2.13 dynamo-exporter bug (``optimize=False`` path), in place: drop
    each Conv's constant bias that is not 1-D and all zeros (a Conv3d's ``Expand(0, [C_out,
    2])``, which ONNX Runtime rejects); correct biases (1-D, or any non-zero one) are left alone
    (docs/fusions/cleanup.md).
    """
    for node in model.graph:
        if node.op_type == "Conv" and len(node.inputs) == 3:
            bias = const_array(node.inputs[2])
            if bias is not None and bias.ndim != 1 and not bias.any():
                node.resize_inputs(2)
    ir.passes.common.RemoveUnusedNodesPass()(model)
