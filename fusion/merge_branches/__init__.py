"""Merge re-parameterizable blocks into one convolution (structural re-parameterization, the pass
:class:`MergeBranches`): a sum of Conv, identity and BatchNorm branches that read one tensor, and
a widening 1x1 Conv followed by a Conv; and a sum of linear layers of one tensor into one.

The math, the conditions of exactness, the refusals with their codes and the papers: see
docs/fusions/merge_branches.md. The modules: :mod:`~fusion.merge_branches.branches` (the sum
read into its terms), :mod:`~fusion.merge_branches.kernel` (the merged Conv),
:mod:`~fusion.merge_branches.pair` (the 1x1 -> kxk pair), :mod:`~fusion.merge_branches.dense`
(the merged Gemm or MatMul).
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import KnownShapes, const_array, label, remove_nodes, replace_output, set_input
from fusion.base import CannotFuse, FusionPass, Kind
from fusion.fold_batchnorm.after import fold_chain_after
from fusion.merge_branches.branches import Sum, collect, is_conv, read_once
from fusion.merge_branches.codes import ReparamCode
from fusion.merge_branches.dense import DensePlan, merged_dense, rewrite_dense
from fusion.merge_branches.kernel import Plan, merged_conv
from fusion.merge_branches.pair import is_pair, sequential_weights

__all__ = ["MergeBranches"]


class MergeBranches(FusionPass):
    """Merge sums of convolution, identity and BatchNorm branches reading one tensor, and 1x1
    Convs followed by a kxk Conv, into one Conv, and sums of Gemm / MatMul branches reading one
    tensor into one (the math and the conditions: docs/fusions/merge_branches.md). Runs after
    :class:`~fusion.fold_batchnorm.FoldBatchNorm`, whose folds leave each branch a Conv with a
    bias. Graph outputs keep their names.
    """

    kinds = (
        Kind(
            "reparam_merged",
            "reparam",
            norm=False,
            meaning=(
                "re-parameterizable blocks merged into one Conv (`fusion.merge_branches`): a sum of"
                " Conv, identity and BatchNorm branches reading one tensor (RepVGG, MobileOne, "
                "RepViT, FastViT), or a 1x1 Conv followed by a Conv; the BatchNorms a merge absorbs"
                " count in `batchnorm_folded`"
            ),
        ),
    )
    summary = (
        "re-parameterizable blocks (branches of Conv, identity and BatchNorm; 1x1 -> kxk pairs; "
        "sums of linear layers) merged into one layer"
    )
    codes = ReparamCode

    def apply(self, model: ir.Model) -> bool:
        """Merge in place: 1x1 -> kxk pairs first (a pair may be a branch of a sum), then the
        sums, each from its last node; return whether anything was merged."""
        graph = model.graph
        shapes = KnownShapes(model)
        modified = False
        for node in [n for n in graph if is_conv(n)]:
            if node.graph is graph and label(node) not in self.excluded:
                modified |= self._sequential(graph, node)
        for root in reversed([n for n in graph if n.op_type in ("Add", "Sub")]):
            if root.graph is not graph or root.domain or label(root) in self.excluded:
                continue
            try:
                found = collect(root)
                if found is None:
                    continue
                plan = merged_dense(found, shapes) if found.dense else merged_conv(found)
            except CannotFuse as refusal:
                self.refused(root, refusal)
                continue
            if isinstance(plan, DensePlan):
                self._merge_dense(graph, found, plan, shapes)
            else:
                self._merge(graph, found, plan, shapes)
            modified = True
        return modified

    def _sequential(self, graph: ir.Graph, conv: ir.Node) -> bool:
        """Merge the 1x1 Conv before ``conv`` into it, where that is exact and no slower."""
        first = conv.inputs[0].producer()
        if first is None or not read_once(conv.inputs[0]) or not is_pair(first, conv):
            return False
        merged = sequential_weights(first, conv)
        if merged is None:  # not exact, or slower: no candidate, no refusal
            return False
        weight, bias = merged
        name = label(conv)
        set_input(graph, conv, 1, weight, f"{conv.inputs[1].name}_merged")
        set_input(graph, conv, 2, bias, f"{conv.inputs[1].name}_merged_bias")
        conv.replace_input_with(0, first.inputs[0])
        remove_nodes(graph, [first])
        self.fused(name, f"Conv (1x1 Conv '{label(first)}' merged into it)")
        return True

    def _merge_dense(
        self, graph: ir.Graph, found: Sum, plan: DensePlan, shapes: KnownShapes
    ) -> None:
        """Rewrite ``found`` into ``plan.main`` and fold what follows it."""
        root_name = label(found.root)
        self.fused(root_name, rewrite_dense(graph, found, plan))
        folded = fold_chain_after(graph, plan.main, {}, shapes)
        if folded is not None:
            self.fused(folded.node, folded.became, kind=folded.kind, count=folded.count)

    def _merge(self, graph: ir.Graph, found: Sum, plan: Plan, shapes: KnownShapes) -> None:
        """Rewrite ``found`` into ``plan.main`` and fold what follows it."""
        main, root_name = plan.main, label(found.root)
        dtype = const_array(main.inputs[1]).dtype
        hint = main.inputs[1].name
        set_input(graph, main, 1, plan.weight.astype(dtype), f"{hint}_merged")
        set_input(graph, main, 2, plan.bias.astype(dtype), f"{hint}_merged_bias")
        geometry = plan.geometry
        main.attributes.pop("auto_pad", None)
        main.attributes["kernel_shape"] = ir.AttrInt64s("kernel_shape", list(geometry.kernel))
        main.attributes["pads"] = ir.AttrInt64s("pads", [*geometry.begin, *geometry.end])
        main.attributes["dilations"] = ir.AttrInt64s("dilations", list(geometry.dilation))
        main.attributes["strides"] = ir.AttrInt64s("strides", list(geometry.stride))
        replace_output(graph, found.root.outputs[0], main.outputs[0])
        others = [b.node for b in found.branches if b.node is not None and b.node is not main]
        bns = [label(n) for n in others if n.op_type == "BatchNormalization"]
        remove_nodes(graph, [*found.nodes, *others])
        what = ", ".join(f"{n} {k}" for k, n in plan.counts.items())
        self.fused(root_name, f"Conv '{label(main)}' ({what})")
        for bn in bns:
            self.fused(bn, f"merged into Conv '{label(main)}'", kind="batchnorm_folded")
        folded = fold_chain_after(graph, main, {}, shapes)
        if folded is not None:
            self.fused(folded.node, folded.became, kind=folded.kind, count=folded.count)
