"""The export step: both exporters, the eps that dynamo's own optimizer would drop, repairs."""

import numpy as np
import pytest
import torch

from normexport.io.export import export_module
from normexport.runtime import make_session, run

pytestmark = pytest.mark.slow  # exports PyTorch models


class TinyEpsLayerNorm(torch.nn.Module):
    """A tutorial LayerNorm with eps 1e-8: dynamo's built-in optimizer deletes the Add."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-8)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_eps_1e_8_survives_export(exporter):
    exported = export_module(TinyEpsLayerNorm(), [torch.randn(2, 8)], input_names=["x"],
                             exporter=exporter)  # fmt: skip
    assert exported.exporter == exporter
    constant_rows = np.full((2, 8), 3.0, dtype=np.float32)
    (y,) = run(make_session(exported.model), {"x": constant_rows})
    assert np.all(np.isfinite(y)) and np.all(y == 0)


def test_conv3d_without_bias_runs_on_ort():
    """torch 2.13 exports Conv3d(bias=False) with a zero bias of shape (C_out, 2) that ORT
    rejects; export_module drops that all-zero bias."""
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(2, 4, 3, bias=False).eval()
    x = torch.randn(1, 2, 5, 5, 5)
    exported = export_module(conv, [x], input_names=["x"], exporter="dynamo")
    (y,) = run(make_session(exported.model), {"x": x.numpy()})
    np.testing.assert_allclose(y, conv(x).detach().numpy(), rtol=1e-5, atol=1e-5)
