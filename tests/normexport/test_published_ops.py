"""The published model holds no node that the raw export would not have unless a rewrite made
it (issue 52): per op, no more nodes than ``torch.onnx.export``'s output with its defaults
(its own optimizer run), but the ops the rewrites that were made declare
(:func:`graphs.excess_ops`), on small modules here and on every model of the demo zoo as ``make
demo`` saves it in ``tests/models/test_end_to_end.py`` (one pipeline run per model, checked for
both). normexport exports with that optimizer off (docs/model-files.md) and cleans up itself:
torchaudio's ConvTasNet came out with 34 ``CastLike`` of constants, 3 ``Constant`` nodes and an
``x + 0`` that the default export folds."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch

import normexport
from tests.support.graphs import excess_ops

pytestmark = pytest.mark.slow  # exports PyTorch models


class ConvBlock(torch.nn.Module):
    """torchaudio.models.conv_tasnet.ConvBlock: 1x1 Conv, PReLU, GroupNorm(1), depthwise
    dilated Conv, PReLU, GroupNorm(1), then the residual and skip 1x1 Convs."""

    def __init__(self, io: int, hidden: int, dilation: int):
        super().__init__()
        self.conv_layers = torch.nn.Sequential(
            torch.nn.Conv1d(io, hidden, 1),
            torch.nn.PReLU(),
            torch.nn.GroupNorm(1, hidden, eps=1e-8),
            torch.nn.Conv1d(hidden, hidden, 3, padding=dilation, dilation=dilation, groups=hidden),
            torch.nn.PReLU(),
            torch.nn.GroupNorm(1, hidden, eps=1e-8),
        )
        self.res_conv = torch.nn.Conv1d(hidden, io, 1)
        self.skip_conv = torch.nn.Conv1d(hidden, io, 1)

    def forward(self, x):
        feature = self.conv_layers(x)
        return self.res_conv(feature), self.skip_conv(feature)


class ConvTasNetLike(torch.nn.Module):
    """torchaudio.models.ConvTasNet, small: the encoder Conv, the mask generator (its input
    GroupNorm(1), the ConvBlocks, the skips summed from a Python ``0.0``, PReLU, 1x1 Conv,
    sigmoid masks) and the ConvTranspose decoder."""

    def __init__(self, feats: int = 16, io: int = 8, hidden: int = 16, sources: int = 2):
        super().__init__()
        self.sources, self.feats = sources, feats
        self.encoder = torch.nn.Conv1d(1, feats, 16, stride=8, padding=8, bias=False)
        self.input_norm = torch.nn.GroupNorm(1, feats, eps=1e-8)
        self.input_conv = torch.nn.Conv1d(feats, io, 1)
        self.blocks = torch.nn.ModuleList(ConvBlock(io, hidden, 2**i) for i in range(3))
        self.output_prelu = torch.nn.PReLU()
        self.output_conv = torch.nn.Conv1d(io, feats * sources, 1)
        self.decoder = torch.nn.ConvTranspose1d(feats, 1, 16, stride=8, padding=8, bias=False)

    def forward(self, x):
        batch = x.shape[0]
        encoded = self.encoder(x)
        feats = self.input_conv(self.input_norm(encoded))
        output = 0.0
        for block in self.blocks:
            residual, skip = block(feats)
            feats = feats + residual
            output = output + skip
        masks = torch.sigmoid(self.output_conv(self.output_prelu(output)))
        masked = masks.view(batch, self.sources, self.feats, -1) * encoded.unsqueeze(1)
        decoded = self.decoder(masked.view(batch * self.sources, self.feats, -1))
        return decoded.view(batch, self.sources, -1)


def _cnn() -> torch.nn.Module:
    """Conv, BatchNorm, ReLU, a zero pad (CREPE's), Conv, BatchNorm, pooled, Linear."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.ZeroPad2d((1, 1, 2, 2)),
        torch.nn.Conv2d(8, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )


def _mlp() -> torch.nn.Module:
    """Linear, LayerNorm, GELU, Linear: a transformer's feed-forward."""
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 16)
    )


MODULES = {
    "convtasnet": (lambda: ConvTasNetLike(), (1, 1, 800)),
    "cnn": (_cnn, (2, 3, 12, 12)),
    "mlp": (_mlp, (2, 5, 16)),
}


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in eval mode with every parameter and BatchNorm statistic drawn at random (the
    GroupNorm and PReLU weights too, so no affine is the identity)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.5)
        for norm in (m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2)
    return module.eval()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_op_beyond_the_default_export_on_small_modules(name, tmp_path):
    build, shape = MODULES[name]
    module = _randomized(build())
    x = torch.randn(*shape)
    torch.onnx.export(module, (x,), tmp_path / "raw.onnx")
    report = normexport.optimize(module, (x,), output=tmp_path / "m.onnx", benchmark=False)
    assert report.parity.passed
    raw, published = ir.load(tmp_path / "raw.onnx"), ir.load(tmp_path / "m.onnx")
    assert excess_ops(raw, published, report.fusions.counts) == {}
