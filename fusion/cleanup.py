"""Exact graph clean-up run before and after the fusion passes.

Only rewrites that cannot change a number: constant folding (onnxscript's folder, which
evaluates constant subgraphs with the ONNX reference semantics), common-subexpression
elimination (the exporters write ``x - mean`` twice in a hand-written LayerNorm; CSE makes it
one value, so the matchers see one shape), and removal of unused nodes. onnxscript's full
``optimize`` is deliberately not used: its pattern rules match constants with ``abs_tol=1e-8``
and delete an ``Add`` of an eps of 1e-8 (DESIGN.md, "Measured facts").

:func:`normalize_ir_version` makes an IR-version-3 model an IR-version-4 one with the same
meaning (see there); :func:`fusion.optimize` runs it first.
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


def normalize_ir_version(model: ir.Model) -> str | None:
    """Raise an IR-version-3 model to version 4 with the same meaning; say what changed.

    Below IR version 4 every initializer had to be listed among the graph inputs (onnx.checker
    requires it), and ONNX Runtime treats those initializers as constants that a caller cannot
    override (``Graph::CanOverrideInitializer()`` is ``ir_version >= 4``). From version 4 an
    initializer listed as a graph input is an overridable default, and one not listed is a
    constant. So the exact version-4 form drops the initializer-backed inputs and sets
    ``ir_version = 4``; a pass that adds an initializer (a folded weight) then leaves a valid
    model. Models of version 4 and up are left alone.

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
