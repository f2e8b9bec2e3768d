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
from graphs import assert_close, make_model, ops, run
from onnx import TensorProto

import fusion
from fusion.base import Code, FusionReport
from fusion.merge_branches import MergeBranches

F = TensorProto.FLOAT
C = 6


class Block:
    """Nodes and constants of a block under construction, reading ``x`` (N, C, H, W)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list = []
        self.inits: dict[str, np.ndarray] = {}

    def conv(self, x: str, k: int, *, c_out: int = C, c_in: int = C, group: int = 1, **attrs):
        """A Conv of kernel ``k`` with a random weight and bias; pads ``k // 2`` unless given."""
        name = f"conv{len(self.nodes)}"
        shape = (c_out, c_in // group, k, k)
        self.inits[f"{name}_w"] = self.rng.normal(size=shape).astype(np.float32) / k
        self.inits[f"{name}_b"] = self.rng.normal(size=c_out).astype(np.float32)
        attrs = {"pads": [k // 2] * 4, "group": group, **attrs}
        self.nodes.append(("Conv", [x, f"{name}_w", f"{name}_b"], [name], attrs))
        return name

    def bn(self, x: str, c: int = C) -> str:
        """A BatchNormalization with random statistics."""
        name = f"bn{len(self.nodes)}"
        rng = self.rng
        params = (rng.uniform(0.2, 2, c), rng.uniform(-1, 1, c), rng.uniform(-1, 1, c))
        params += (rng.uniform(0.5, 2, c),)
        for p, v in zip(("scale", "B", "mean", "var"), params, strict=True):
            self.inits[f"{name}_{p}"] = v.astype(np.float32)
        inputs = [x, *(f"{name}_{p}" for p in ("scale", "B", "mean", "var"))]
        self.nodes.append(("BatchNormalization", inputs, [name], {"epsilon": 1e-3}))
        return name

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        name = f"{op_type.lower()}{len(self.nodes)}"
        self.nodes.append((op_type, list(inputs), [name], attrs))
        return name

    def const(self, array: np.ndarray) -> str:
        name = f"k{len(self.inits)}"
        self.inits[name] = array.astype(np.float32)
        return name

    def add(self, *values: str) -> str:
        total = values[0]
        for v in values[1:]:
            total = self.op("Add", total, v)
        return total

    def model(self, y: str, shape=(2, C, 7, 7), out=None) -> ir.Model:
        return make_model(self.nodes, {"x": (F, shape)}, {y: (F, out)}, self.inits)


def _merge(model: ir.Model) -> tuple[FusionReport, list[str]]:
    fusion_pass = MergeBranches()
    fusion_pass(model)
    return fusion_pass.outcomes, ops(model)


def _repvgg(b: Block) -> str:
    return b.op("Relu", b.add(b.conv("x", 3), b.conv("x", 1), b.bn("x")))


def _mobileone(k: int):
    def block(b: Block) -> str:
        convs = [b.conv("x", 3, group=C) for _ in range(k)]
        return b.op("Relu", b.add(b.conv("x", 1, group=C), b.bn("x"), *convs))

    return block


def _repmixer(b: Block) -> str:
    """FastViT: ``x + gamma * (mixer(x) - norm(x))``, the mixer a depthwise RepVGG block."""
    mixer = b.add(b.conv("x", 3, group=C), b.conv("x", 1, group=C), b.bn("x"))
    gamma = b.const(b.rng.uniform(0.1, 1, (C, 1, 1)))
    return b.op("Add", "x", b.op("Mul", b.op("Sub", mixer, b.bn("x")), gamma))


def _repvit(b: Block) -> str:
    """RepViT's token mixer: ``bn(conv3x3(x) + conv1x1(x) + x)``, depthwise."""
    return b.bn(b.add(b.conv("x", 3, group=C), b.conv("x", 1, group=C), "x"))


def _large_kernel(b: Block) -> str:
    """FastViT's large-kernel stem: 7x7 and 3x3 at stride 2."""
    return b.add(b.conv("x", 7, group=C, strides=[2, 2]), b.conv("x", 3, group=C, strides=[2, 2]))


def _dilated(b: Block) -> str:
    """A 3x3 of dilation 3 beside a 1x1 (one 3x3 of dilation 3), and a 3x3 of dilation 2 inside
    a 5x5 (one dense 5x5)."""
    a = b.add(b.conv("x", 3, dilations=[3, 3], pads=[3] * 4), b.conv("x", 1))
    return b.add(b.conv(a, 3, dilations=[2, 2], pads=[2] * 4), b.conv(a, 5))


MERGED = {
    "repvgg": (_repvgg, ["Conv", "Relu"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "mobileone_k2": (_mobileone(2), ["Conv", "Relu"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "mobileone_k4": (_mobileone(4), ["Conv", "Relu"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "fastvit_repmixer": (_repmixer, ["Conv"], {"reparam_merged": 1, "batchnorm_folded": 2}),
    "repvit_token_mixer": (_repvit, ["Conv"], {"reparam_merged": 1, "batchnorm_folded": 1}),
    "large_kernel_strided": (_large_kernel, ["Conv"], {"reparam_merged": 1}),
    "dilated": (_dilated, ["Conv", "Conv"], {"reparam_merged": 2}),
}  # fmt: skip


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
    y = _repvgg(b)
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
