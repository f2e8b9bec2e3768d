"""Exact graph clean-up run before and after the fusion passes.

Only rewrites that cannot change a number: constant folding (onnxscript's folder, which
evaluates constant subgraphs with the ONNX reference semantics), common-subexpression
elimination (the exporters write ``x - mean`` twice in a hand-written LayerNorm; CSE makes it
one value, so the matchers see one shape), and removal of unused nodes. onnxscript's full
``optimize`` is deliberately not used: its pattern rules match constants with ``abs_tol=1e-8``
and delete an ``Add`` of an eps of 1e-8 (DESIGN.md, "Measured facts").
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnx_ir.passes.common
import onnxscript.optimizer

# The folder logs a warning for each node it tries and cannot evaluate; that node just stays.
_folder_log = logging.getLogger("onnxscript.optimizer._constant_folding")


def cleanup(model: ir.Model) -> None:
    """Fold constants, merge common subexpressions, drop dead nodes, sort (in place)."""
    level = _folder_log.level
    _folder_log.setLevel(logging.ERROR)
    try:
        onnxscript.optimizer.fold_constants(model)
    finally:
        _folder_log.setLevel(level)
    ir.passes.common.CommonSubexpressionEliminationPass()(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    ir.passes.common.TopologicalSortPass()(model)
