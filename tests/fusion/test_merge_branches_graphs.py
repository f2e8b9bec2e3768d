"""MergeBranches on hand-built ONNX graphs (no PyTorch): re-parameterizable blocks become one
Conv, exactly (ONNX Runtime before vs after), and look-alikes are refused with their code.

Every weight, bias and BatchNorm statistic is random. The blocks are written as the exporters
leave them once BatchNorm is folded: each branch a Conv with a bias, the identity branch a
BatchNormalization or the input itself, summed by Adds (Sub and Mul by a layer scale for
FastViT's RepMixer). The PyTorch blocks are in the gallery (``models/norms.py``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

import fusion
from fusion import Code
from fusion.base import FusionReport
from fusion.merge_branches import MergeBranches
from tests.support.graphs import assert_close, make_model, ops, run
from tests.support.reparam_graphs import MERGED, Block, C, F, repvgg


def _merge(model: ir.Model) -> tuple[FusionReport, list[str]]:
    fusion_pass = MergeBranches()
    fusion_pass(model)
    return fusion_pass.outcomes, ops(model)


@pytest.mark.parametrize("name", list(MERGED))
def test_block_becomes_one_conv_exactly(name, rng):
    build, left, counts = MERGED[name]
    b = Block(rng)
    model = b.model(build(b))
    feeds = {"x": rng.normal(size=(2, C, 7, 7)).astype(np.float32)}
    expected = run(model, feeds)
    report, after = _merge(model)
    assert after == left, after
    assert {k: v for k, v in report.counts.items() if v} == counts, report.to_dict()
    assert not report.refused
    assert_close(run(model, feeds), expected, rtol=1e-4, atol=1e-5)
    fusion.check(model)


def test_graph_output_keeps_its_name_and_a_shared_input_stays(rng):
    b = Block(rng)
    y = repvgg(b)
    model = make_model(
        b.nodes, {"x": (F, (1, C, 5, 5))}, {y: (F, None), "x_again": (F, None)}, b.inits
    )
    model.graph.outputs.append(model.graph.inputs[0])  # x is read elsewhere too
    report, _ = _merge(model)
    assert report.counts["reparam_merged"] == 1
    assert [v.name for v in model.graph.outputs][0] == y


def test_one_by_one_then_kxk_merges_where_exact(rng):
    """DBB's 1x1 -> kxk: merged where the 1x1 widens the channels and its bias is zero or the
    kxk pads nothing; a bias under padding and a narrowing 1x1 are left alone with no refusal:
    any CNN's 1x1 then 3x3 (a ResNet's bottleneck, a VAE's post_quant_conv then conv_in), no
    candidate of re-parameterization."""
    for pads, zero_bias, c_mid, merged in [
        ([0, 0, 0, 0], False, 8, True),
        ([1, 1, 1, 1], True, 8, True),
        ([1, 1, 1, 1], False, 8, False),
        ([0, 0, 0, 0], False, 4, False),
    ]:
        b = Block(rng)
        first = b.conv("x", 1, c_out=c_mid)
        if zero_bias:
            b.inits[f"{first}_b"][:] = 0
        y = b.conv(first, 3, c_in=c_mid, pads=pads)
        model = b.model(y)
        feeds = {"x": rng.normal(size=(2, C, 7, 7)).astype(np.float32)}
        expected = run(model, feeds)
        report, after = _merge(model)
        assert (after == ["Conv"]) is merged, (pads, zero_bias, c_mid, after)
        assert not report.refused
        assert_close(run(model, feeds), expected, rtol=1e-4, atol=1e-5)


def _relu_in_branch(b: Block) -> str:
    return b.add(b.conv("x", 3), b.op("Relu", b.conv("x", 1)), "x")


def _strided_identity(b: Block) -> str:
    return b.add(b.conv("x", 3, strides=[2, 2]), "x")


def _misaligned(b: Block) -> str:
    # 3x3 padded 1 and 2x2 unpadded, stride 2: the same output size at 7x7 and 8x8 inputs
    # (not at every size), windows that start one row apart
    return b.add(b.conv("x", 3, strides=[2, 2]), b.conv("x", 2, strides=[2, 2], pads=[0] * 4))


def _group_mismatch(b: Block) -> str:
    return b.add(b.conv("x", 3, group=C), b.conv("x", 1))


def _more_work(b: Block) -> str:
    # 3x3 of dilation 2 beside a 3x3: one 5x5 kernel of 25 taps for 18
    return b.add(b.conv("x", 3, dilations=[2, 2], pads=[2, 2, 2, 2]), b.conv("x", 3))


REFUSED = {
    "relu_in_branch": (_relu_in_branch, (2, C, 7, 7), Code.BRANCH_NOT_CONV),
    "strided_identity": (_strided_identity, (2, C, 1, 1), Code.STRIDE_MISMATCH),
    "pads_not_aligned": (_misaligned, (2, C, 8, 8), Code.PADS_NOT_ALIGNED),
    "group_mismatch": (_group_mismatch, (2, C, 7, 7), Code.GROUP_MISMATCH),
    "more_work": (_more_work, (2, C, 7, 7), Code.MORE_WORK),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_look_alike_is_refused_and_left_as_it_was(name, rng):
    build, shape, code = REFUSED[name]
    b = Block(rng)
    model = b.model(build(b), shape)
    before = ir.to_proto(model).SerializeToString()
    report, _ = _merge(model)
    assert report.codes() == [code], report.refused
    assert not report.fused
    assert ir.to_proto(model).SerializeToString() == before


def test_residual_of_two_tensors_is_no_candidate(rng):
    """``x + f(relu(x))`` with nothing else reading x directly: a residual block, nothing to
    merge and nothing to say (no refusal)."""
    b = Block(rng)
    h = b.op("Relu", b.conv("x", 3))
    y = b.op("Add", b.conv(h, 3), "x")
    report, after = _merge(b.model(y))
    assert not report.fused and not report.refused and after.count("Conv") == 2


def test_optimize_folds_branch_batchnorms_then_merges(rng):
    """The form the exporter leaves without its optimizer: Conv -> BatchNormalization per
    branch; FoldBatchNorm folds them, MergeBranches merges, no BatchNorm is left and none is
    listed as left alone."""
    b = Block(rng)
    y = b.op("Relu", b.add(b.bn(b.conv("x", 3)), b.bn(b.conv("x", 1)), b.bn("x")))
    model = b.model(y)
    feeds = {"x": rng.normal(size=(2, C, 7, 7)).astype(np.float32)}
    expected = run(model, feeds)
    report = fusion.optimize(model)
    assert report.counts["batchnorm_folded"] == 3 and report.counts["reparam_merged"] == 1
    assert not report.refused, report.refused
    assert ops(model) == ["Conv", "Relu"]
    assert_close(run(model, feeds), expected, rtol=1e-4, atol=1e-5)
