"""Merge re-parameterizable blocks into one convolution (structural re-parameterization).

Training-time multi-branch blocks (Ding et al., "RepVGG: Making VGG-style ConvNets Great
Again", CVPR 2021, sec. 3.3; Ding et al., "Diverse Branch Block", CVPR 2021, sec. 3; Vasu et
al., "MobileOne", CVPR 2023, sec. 3.1; FastViT's RepMixer, RepViT's token mixer) compute, at
inference, a linear map of one tensor: exported as they are, every branch stays a Conv and a
BatchNormalization stays on the identity branch. Convolution is linear in its weight, so

**A sum of branches** reading one tensor ``x``::

    y = sum_i c_i * B_i(x) + t

where each branch ``B_i`` is a Conv with a constant weight ``W_i`` (its BatchNorm already
folded by :mod:`fusion.fold_batchnorm`), ``x`` itself, or a BatchNormalization of ``x``
(``s * x + b`` per channel), ``c_i`` a per-output-channel coefficient gathered on the way (Sub,
Neg, Mul by a per-channel constant: FastViT's ``x + gamma * (mixer(x) - norm(x))``) and ``t`` the
per-channel constants added, is one Conv: on a common tap grid (its dilation the gcd of the
branches' dilations and tap offsets), each branch is a kernel placed at its offset (an
identity or BatchNorm is a 1x1 kernel that is ``s_c`` from channel ``c`` to itself, within its
group), and ``W = sum_i c_i W_i``, ``b = sum_i c_i b_i + t``. Exact when

- every Conv has the same stride and group; an identity or BatchNorm branch needs stride 1 and
  as many input as output channels;
- every branch reads the same window of the input around each output: ``pad_begin + pad_end -
  dilation * (k - 1)`` equal (the output sizes then agree for every input size) and the taps on
  the common grid;
- the merged kernel has no more taps than the branches together (else it is slower: refused).

A BatchNorm or per-channel affine map after the sum (RepViT's token mixer) is then folded into
the merged Conv (:func:`fusion.fold_batchnorm.after.fold_chain_after`).

**A 1x1 Conv then a kxk Conv** (DBB, transform II): ``Conv_k(Conv_1(x))`` with the 1x1 of group
1, stride 1 and no padding, the kxk of group 1, is ``W[n, c] = sum_m W_k[n, m] W_1[m, c]``,
``b = b_k + sum_m (sum of W_k[n, m]) b_1[m]``. Exact only where the kxk Conv pads nothing or
``b_1`` is zero (its padded zeros are not ``b_1``); merged only where the 1x1 has at least as
many output as input channels (else the merged Conv does more multiply-adds). A pair that
is neither is left alone with no refusal: it is any CNN's 1x1 then 3x3 (a ResNet's bottleneck,
a VAE's ``post_quant_conv`` then ``conv_in``), no re-parameterized block.

Outcomes: each merge is a ``reparam_merged``; each BatchNormalization it absorbs (an identity
branch's) a ``batchnorm_folded``, as is the fold after it. Refusals are of the ``batchnorm``
family (re-parameterization is BatchNorm folding's second half), with the codes
``branch_not_conv``, ``stride_mismatch``, ``group_mismatch``, ``pads_not_aligned``,
``more_work`` and the shared ones, for sums of branches only.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import KnownShapes, const_array, label, remove_nodes, replace_output, set_input
from fusion.base import CannotFuse, FusionPass, Kind
from fusion.fold_batchnorm.after import fold_chain_after
from fusion.merge_branches.branches import Sum, collect, is_conv, read_once
from fusion.merge_branches.kernel import Plan, merged_conv
from fusion.merge_branches.pair import is_pair, sequential_weights

__all__ = ["MergeBranches"]


class MergeBranches(FusionPass):
    """Merge sums of convolution, identity and BatchNorm branches reading one tensor, and 1x1
    Convs followed by a kxk Conv, into one Conv (see the package docstring for the math and
    the conditions). Runs after :class:`~fusion.fold_batchnorm.FoldBatchNorm`, whose folds
    leave each branch a Conv with a bias. Graph outputs keep their names.
    """

    kinds = (Kind("reparam_merged", "reparam", norm=False),)

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
                plan = merged_conv(found)
            except CannotFuse as refusal:
                self.refused(root, refusal)
                continue
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
