"""Fold eval-mode BatchNorm and other constant per-channel affine chains into the neighbouring
Conv / ConvTranspose / Gemm / MatMul (the pass :class:`FoldBatchNorm`).

The math, the ops a map moves across, what counts as a BatchNorm, and each refusal with its
code: see docs/fusions/fold_batchnorm.md.

The modules: :mod:`~fusion.fold_batchnorm.algebra` (BatchNorm and constant ops as ``(s, t)``,
the layers, the per-channel checks), :mod:`~fusion.fold_batchnorm.across` (moving a map across
Transpose / Reshape / MaxPool ...), :mod:`~fusion.fold_batchnorm.after` (fold into the layer
before the BatchNorm: the walk down its readers), :mod:`~fusion.fold_batchnorm.before` (fold
into the layer after it), :mod:`~fusion.fold_batchnorm.computed` (the parameters and weights the
model computes from constants, made tensors first).
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import KnownShapes, label
from fusion.base import CannotFuse, FusionPass, Kind, Op
from fusion.fold_batchnorm.across import ACROSS
from fusion.fold_batchnorm.after import chain_after, explain, fold_chain_after
from fusion.fold_batchnorm.algebra import LINEAR, batchnorm_affine
from fusion.fold_batchnorm.before import fold_into_next
from fusion.fold_batchnorm.codes import BatchNormCode
from fusion.fold_batchnorm.computed import fold_computed

__all__ = ["FoldBatchNorm"]


class FoldBatchNorm(FusionPass):
    """Fold inference-mode BatchNormalization and per-channel affine chains into linear layers.

    The math, the cases and what is counted as a BatchNorm: docs/fusions/fold_batchnorm.md.
    Weights may be float16, float32 or float64; folding is computed in float64 and cast back.
    Graph outputs keep their names.

    Outcomes: each fold is a ``batchnorm_folded`` (one per BatchNormalization folded, or one
    for a BatchNorm written by hand) or an ``affine_folded`` (any other chain of constants).
    Each candidate left alone is a ``batchnorm`` refusal with a code of the "BatchNorm and
    affine folding" section of :class:`~fusion.base.Code` or a shared one.

    Running the pass a second time changes nothing. It raises no errors of its own: a graph it
    cannot read as foldable is left as it is and explained in the report.
    """

    kinds = (
        Kind(
            "batchnorm_folded",
            "batchnorm",
            (Op("BatchNormalization"),),
            meaning=(
                "BatchNorms folded into a neighbouring Conv / ConvTranspose / Gemm / MatMul (also "
                "into the classifiers after a global mean pooling): BatchNormalization nodes, and "
                "BatchNorms written by hand (a per-channel scale with the mean subtracted or a "
                "shift added after it)"
            ),
        ),
        Kind(
            "affine_folded",
            "affine",
            norm=False,
            meaning=(
                "constant scalings that are no BatchNorm folded into a linear layer: scalars (e.g. "
                "attention's 1/sqrt(d)) and per-channel layer scales (e.g. ConvNeXt's `gamma * x`)"
            ),
        ),
    )
    summary = (
        "eval-mode BatchNorms and constant per-channel affine maps folded into the neighbouring "
        "Conv / ConvTranspose / Gemm / MatMul"
    )
    codes = BatchNormCode

    def apply(self, model: ir.Model) -> bool:
        """Fold in place (the constants computed from constants that a fold needs first:
        :func:`~fusion.fold_batchnorm.computed.fold_computed`); return whether anything was
        folded."""
        graph = model.graph
        shapes = KnownShapes(model)
        fold_computed(model, shapes)
        # candidate (or op on the way) -> why it was not folded
        stops: dict[ir.Node, CannotFuse] = {}
        left: set[ir.Node] = set()  # the chains of the layers excluded: left as they are
        modified = False
        for node in [n for n in graph if n.op_type in LINEAR]:
            if label(node) in self.excluded:
                left.update(chain_after(node, stops, shapes))
                continue
            folded = fold_chain_after(graph, node, stops, shapes)
            if folded is not None:
                self.fused(folded.node, folded.became, kind=folded.kind, count=folded.count)
                modified = True
        for bn in [n for n in graph if n.op_type == "BatchNormalization" and n not in left]:
            if label(bn) not in self.excluded:
                modified |= self._fold_into_next(graph, bn, stops, shapes)
        for node in graph:
            if node in stops and node.op_type not in ACROSS and node not in left:
                self.refused(node, stops[node])
        return modified

    def _fold_into_next(
        self,
        graph: ir.Graph,
        bn: ir.Node,
        stops: dict[ir.Node, CannotFuse],
        shapes: KnownShapes,
    ) -> bool:
        """Fold ``bn`` into the layer after it, or record in ``stops`` why not; True if folded."""
        try:
            batchnorm_affine(bn)
        except CannotFuse as refusal:
            stops[bn] = refusal
            return False
        name = label(bn)
        try:
            became = fold_into_next(graph, bn, shapes)
        except CannotFuse as after:
            before = stops.get(bn) or explain(bn.inputs[0], stops, shapes)
            stops[bn] = _both(before, after)
            return False
        stops.pop(bn, None)
        self.fused(name, became)
        return True


def _both(before: CannotFuse, after: CannotFuse) -> CannotFuse:
    """One refusal for a BatchNorm that folds neither into the layer before it (``before``)
    nor into the layer after it (``after``): both details, and one code."""
    # The code is the more informative of the two: the reason from the layer before, unless
    # there is none before (no_linear_layer) and there is one after that refused (any code but
    # no_linear_layer): then that layer's reason, e.g. padded_conv or maxpool_negative_scale.
    no_layer = BatchNormCode.NO_LINEAR_LAYER
    code = after.code if before.code == no_layer and after.code != no_layer else before.code
    detail = f"{before.detail}; and it cannot fold into the layer after it: {after.detail}"
    return CannotFuse(code, detail)
