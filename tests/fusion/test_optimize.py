"""fusion.optimize end to end on small graphs: checker, contrib ops, idempotence."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import fusion
from normexport.export import export_module
from normexport.runtime import make_session, run


class RMSBlock(torch.nn.Module):
    """Conv -> BN, then a LLaMA-style RMSNorm over the last axis."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.weight = torch.nn.Parameter(1 + 0.5 * torch.randn(6))
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        h = self.bn(self.conv(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h


def _export(opset):
    torch.manual_seed(0)
    module = RMSBlock().eval()
    x = torch.randn(2, 3, 5, 6)
    exported = export_module(module, [x], opset=opset, input_names=["x"], exporter="dynamo")
    return exported.model, x, module(x).detach().numpy()


@pytest.mark.parametrize(("opset", "op"), [(18, "SimplifiedLayerNormalization"),
                                           (23, "RMSNormalization")])  # fmt: skip
def test_optimize_passes_the_checker_and_matches_torch(opset, op):
    model, x, expected = _export(opset)
    report = fusion.optimize(model, target="ort")
    assert report.counts["batchnorm_folded"] == 1 and report.counts["rmsnorm_fused"] == 1
    assert fusion.norm_ops(model) == {op: 1}
    assert model.opset_imports[""] == opset  # never raised
    fusion.check(model)
    (y,) = run(make_session(model), {"x": x.numpy()})
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_second_optimize_changes_nothing():
    model, _, _ = _export(18)
    fusion.optimize(model)
    before = ir.to_proto(model).SerializeToString()
    report = fusion.optimize(model)
    assert not any(report.counts.values())
    assert ir.to_proto(model).SerializeToString() == before


def test_check_rejects_an_invalid_model():
    model, _, _ = _export(18)
    fusion.optimize(model)
    node = next(n for n in model.graph if n.op_type == "Conv")
    node.attributes["group"] = ir.AttrString("group", "one")  # wrong attribute type
    with pytest.raises(onnx.checker.ValidationError):
        fusion.check(model)


class ResidualNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.linear(x))


def test_skip_is_opt_in_and_exact():
    torch.manual_seed(0)
    module = ResidualNorm().eval()
    x = torch.randn(2, 5, 16)
    expected = module(x).detach().numpy()
    plain = export_module(module, [x], input_names=["x"], exporter="dynamo").model
    fusion.optimize(plain)
    assert fusion.norm_ops(plain) == {"LayerNormalization": 1}
    skipped = export_module(module, [x], input_names=["x"], exporter="dynamo").model
    report = fusion.optimize(skipped, skip=True)
    assert report.counts["skip_fused"] == 1
    assert fusion.norm_ops(skipped) == {"SkipLayerNormalization": 1}
    fusion.check(skipped)
    (y,) = run(make_session(skipped), {"x": x.numpy()})
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="target='ort'"):
        fusion.optimize(skipped, target="onnx", skip=True)
