"""Example tensors for an in-memory module (``normexport.optimize(module, args, kwargs)``), as
torch's exporters take them: names, fixed values, the call exported, and the mistakes refused."""

from __future__ import annotations

import onnx_ir as ir
import pytest
import torch
from torch import nn

import normexport
from models.norms import VarLayerNorm
from normexport.errors import UsageError
from normexport.io.examples import Called, from_tensors


class Masked(nn.Module):
    """A hand-written LayerNorm (randomized weight and bias) of ``x`` masked by ``mask``, times
    ``scale``: positional, keyword and non-tensor arguments in one call."""

    def __init__(self):
        super().__init__()
        self.norm = VarLayerNorm((16,), seed=3)

    def forward(self, x, mask=None, scale: float = 1.0):
        y = self.norm(x) * scale
        return y if mask is None else y * mask


def test_names_and_fixed_values_follow_forward():
    x, mask = torch.randn(2, 4, 16), torch.rand(2, 4, 1)
    module, example = from_tensors(Masked(), (x,), {"mask": mask, "scale": 2.0})
    assert isinstance(module, Called) and list(example) == ["x", "mask"]
    expected = Masked()(x, mask=mask, scale=2.0)
    torch.testing.assert_close(module(x, mask), expected)


def test_positional_tensors_alone_keep_the_module():
    net = Masked()
    module, example = from_tensors(net, (torch.randn(2, 4, 16), torch.rand(2, 4, 1)), {})
    assert module is net and list(example) == ["x", "mask"]


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        ((torch.randn(2, 16),), {"nope": torch.randn(2)}, "do not fit"),
        (([torch.randn(2, 16)],), {}, "one by one"),
        ((torch.randn(2, 16, dtype=torch.bfloat16),), {}, "numpy has no type"),
    ],
)
def test_bad_example_arguments_are_refused(args, kwargs, words):
    with pytest.raises(UsageError, match=words):
        from_tensors(Masked(), args, kwargs)


@pytest.mark.slow
def test_module_with_args_and_kwargs_is_exported_as_called(tmp_path):
    torch.manual_seed(0)
    net = Masked().train()
    x, mask = torch.randn(2, 4, 16), (torch.rand(2, 4, 1) > 0.5).float()
    out = tmp_path / "masked.onnx"
    report = normexport.optimize(
        net, (x,), {"mask": mask, "scale": 3.0}, output=out, benchmark=False
    )
    assert report.passed and report.parity.oracle == "pytorch_float64"
    assert report.fusions.counts["layernorm_fused"] == 1
    assert list(report.inputs) == ["x", "mask"]
    assert [v.name for v in ir.load(out).graph.inputs] == ["x", "mask"]
    assert net.training  # given back as it came


@pytest.mark.parametrize(
    "given",
    [
        {"model": "model.onnx", "args": (torch.randn(1),)},
        {"output": "m.onnx", "args": (torch.randn(1),), "input_shape": ["1"]},
    ],
)
def test_example_arguments_only_for_a_module_and_only_once(tmp_path, given):
    given = {"model": Masked()} | given
    with pytest.raises(UsageError, match="args"):
        normexport.optimize(**given)
