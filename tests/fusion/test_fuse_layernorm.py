"""FuseLayerNorm on hand-written LayerNorms exported by both exporters.

Each fused model is checked against PyTorch eager on random inputs and on probes that hit eps
(constant rows, zeros, 1e-4 and 1e3 scales), with the full ONNX checker, with the epsilon
attribute compared bit for bit, and by a second run of the pass that must change nothing.
Look-alikes and unfusable candidates must be refused with a reason and left byte-identical.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from fusion.fuse_layernorm import FuseLayerNorm
from fusion.report import FusionReport
from normexport.export import export_module
from normexport.runtime import make_session, run

torch.set_num_threads(1)

SHAPE = (2, 3, 16)


def probes(shape=SHAPE) -> dict[str, torch.Tensor]:
    """Random rows and the inputs that make eps matter."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return {
        "random": x,
        "constant rows": torch.full(shape, 3.0) + torch.arange(shape[-2]).view(-1, 1),
        "zeros": torch.zeros(shape),
        "1e-4 scale": x * 1e-4,
        "1e3 scale": x * 1e3,
    }


def assert_matches(out: np.ndarray, ref: np.ndarray, what: str) -> None:
    """No NaN/Inf where torch has none; max abs err <= 1e-4 + 1e-3 * max |ref|."""
    assert out.shape == ref.shape, what
    bad = ~np.isfinite(out) & np.isfinite(ref)
    assert not bad.any(), f"{what}: {bad.sum()} non-finite values where torch has none"
    finite = np.isfinite(ref)
    err = np.abs(out[finite].astype(np.float64) - ref[finite]).max()
    tol = 1e-4 + 1e-3 * np.abs(ref[finite]).max()
    assert err <= tol, f"{what}: max abs err {err:.3g} > {tol:.3g}"


def check_against_torch(module: torch.nn.Module, model: ir.Model) -> None:
    """ORT on ``model`` matches ``module`` in eager mode on every probe."""
    session = make_session(model, "cpu")
    for name, x in probes().items():
        with torch.no_grad():
            ref = module(x).numpy()
        assert_matches(run(session, {"x": x.numpy()})[0], ref, name)


def export(module: torch.nn.Module, exporter: str, opset: int) -> ir.Model:
    model = export_module(
        module, (probes()["random"],), opset=opset, input_names=["x"], exporter=exporter
    ).model
    assert model.opset_imports[""] == opset
    return model


def fuse(model: ir.Model) -> tuple[FusionReport, bool]:
    report = FusionReport()
    return report, FuseLayerNorm(report)(model).modified


def op_types(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def randomized(module: torch.nn.Module) -> torch.nn.Module:
    """Weights and biases away from their 1 / 0 defaults, so a dropped one shows."""
    with torch.no_grad():
        for seed, p in enumerate(module.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return module.eval()


class DivLayerNorm(torch.nn.Module):
    """The tutorial form: ``(x - m) / torch.sqrt(v + eps) * w + b``."""

    def __init__(self, eps: float, d: int = SHAPE[-1]):
        super().__init__()
        self.eps = eps
        self.w = torch.nn.Parameter(torch.ones(d))
        self.b = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = (x - m).pow(2).mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(v + self.eps) * self.w + self.b


class RsqrtLayerNorm2D(torch.nn.Module):
    """Over the last two axes, ``d * d`` and rsqrt, weight first: ``w * (d * rsqrt) + b``."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps
        self.w = torch.nn.Parameter(torch.ones(SHAPE[-2:]))
        self.b = torch.nn.Parameter(torch.zeros(1, SHAPE[-1]))

    def forward(self, x):
        d = x - x.mean((-2, -1), keepdim=True)
        return self.w * (d * torch.rsqrt((d * d).mean((-2, -1), keepdim=True) + self.eps)) + self.b


class BareLayerNorm(torch.nn.Module):
    """No affine part at all: ``d * (1 / sqrt(v + eps))`` over the last axis."""

    def forward(self, x):
        d = x - x.mean(-1, keepdim=True)
        return d * (1.0 / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-6))


def assert_fused(module: torch.nn.Module, exporter: str, opset: int, eps: float) -> ir.Model:
    """Export, fuse, and check everything a correct fusion guarantees."""
    model = export(module, exporter, opset)
    report, modified = fuse(model)
    assert modified
    assert op_types(model) == ["LayerNormalization"]
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    (node,) = model.graph
    assert node.attributes["epsilon"].value == np.float32(eps)  # bit for bit, never lost
    assert node.attributes.get_int("stash_type") == 1
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    check_against_torch(module, model)
    before = ir.to_proto(model).SerializeToString()
    again, modified = fuse(model)
    assert not modified and not again.counts and not again.refused
    assert ir.to_proto(model).SerializeToString() == before
    return model


EXPORTS = [("torchscript", 17), ("torchscript", 18), ("dynamo", 18), ("dynamo", 23)]


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 1e-8])
@pytest.mark.parametrize(("exporter", "opset"), EXPORTS)
def test_div_form_is_fused(exporter, opset, eps):
    model = assert_fused(randomized(DivLayerNorm(eps)), exporter, opset, eps)
    (node,) = model.graph
    assert node.attributes.get_int("axis") == -1
    assert [v.name for v in node.inputs[1:]] == ["w", "b"]  # the model's own weights, reused


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 18)])
def test_two_axes_rsqrt_weight_first_is_fused(exporter, opset):
    model = assert_fused(randomized(RsqrtLayerNorm2D(1e-5)), exporter, opset, 1e-5)
    (node,) = model.graph
    assert node.attributes.get_int("axis") == -2
    bias = ir.convenience.get_const_tensor(node.inputs[2]).numpy()
    assert bias.shape == SHAPE[-2:]  # the (1, 16) bias, broadcast to the normalized shape


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 23)])
def test_no_affine_gets_unit_scale(exporter, opset):
    model = assert_fused(BareLayerNorm(), exporter, opset, 1e-6)
    (node,) = model.graph
    assert len(node.inputs) == 2
    np.testing.assert_array_equal(ir.convenience.get_const_tensor(node.inputs[1]).numpy(), 1.0)


def assert_refused(
    module: torch.nn.Module, exporter: str, opset: int, reason: str
) -> tuple[ir.Model, FusionReport]:
    """The pass records ``reason`` and leaves the model byte for byte as it was."""
    model = export(module, exporter, opset)
    before = ir.to_proto(model).SerializeToString()
    report, modified = fuse(model)
    assert not modified and not report.counts
    assert [r.reason for r in report.refused] == [reason]
    assert ir.to_proto(model).SerializeToString() == before
    check_against_torch(module, model)
    return model, report


class EpsOutsideLayerNorm(DivLayerNorm):
    """``(x - m) / (sqrt(v) + eps)``: not a LayerNormalization."""

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        return (x - m) / (torch.sqrt((x - m).pow(2).mean(-1, keepdim=True)) + self.eps) * self.w


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 18)])
def test_eps_outside_sqrt_is_refused(exporter, opset):
    assert_refused(
        randomized(EpsOutsideLayerNorm(1e-5)),
        exporter,
        opset,
        "eps outside the square root: (x - mean) / (sqrt(var) + eps) is not a "
        "LayerNormalization, which adds eps to the variance",
    )


class MiddleAxisNorm(torch.nn.Module):
    """Normalizes over axis 1 of a rank-3 input: not the trailing axis."""

    def forward(self, x):
        d = x - x.mean(1, keepdim=True)
        return d / torch.sqrt(d.pow(2).mean(1, keepdim=True) + 1e-5)


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 18)])
def test_non_trailing_axis_is_refused(exporter, opset):
    assert_refused(
        MiddleAxisNorm(),
        exporter,
        opset,
        "mean over axes [1] of a rank-3 input: the fused op normalizes the trailing axes only",
    )


def test_opset_16_is_refused():
    model, _ = assert_refused(
        randomized(DivLayerNorm(1e-5)),
        "torchscript",
        16,
        "opset 16 has no LayerNormalization (needs 17)",
    )
    assert "LayerNormalization" not in op_types(model)


class LeakyLayerNorm(DivLayerNorm):
    """Also returns the variance: the subgraph cannot disappear into one node."""

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = (x - m).pow(2).mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(v + self.eps), v


def test_intermediate_read_elsewhere_is_refused():
    module = LeakyLayerNorm(1e-5).eval()
    model = export(module, "dynamo", 18)
    before = ir.to_proto(model).SerializeToString()
    report, modified = fuse(model)
    assert not modified
    (refusal,) = report.refused
    assert refusal.reason.endswith("is also read outside the LayerNorm subgraph")
    assert ir.to_proto(model).SerializeToString() == before


class ChannelWeightLayerNorm(DivLayerNorm):
    """Weight of shape (3, 1): it scales along axis 1, which is not normalized."""

    def __init__(self):
        super().__init__(1e-5)
        self.w = torch.nn.Parameter(torch.ones(SHAPE[1], 1))


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 18)])
def test_weight_over_other_axis_is_not_absorbed(exporter, opset):
    module = randomized(ChannelWeightLayerNorm())
    model = export(module, exporter, opset)
    report, modified = fuse(model)
    assert modified and report.counts["layernorm_fused"] == 1
    (refusal,) = report.refused
    assert refusal.reason == (
        "weight of shape [3, 1] varies along an axis that is not normalized: kept as a separate "
        "Mul after the LayerNormalization"
    )
    assert op_types(model) == ["LayerNormalization", "Mul", "Add"]
    norm = model.graph.node(0)
    np.testing.assert_array_equal(ir.convenience.get_const_tensor(norm.inputs[1]).numpy(), 1.0)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    check_against_torch(module, model)


class RMSNorm(torch.nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_rmsnorm_is_not_a_layernorm_candidate():
    model = export(RMSNorm(), "dynamo", 18)
    before = ir.to_proto(model).SerializeToString()
    report, modified = fuse(model)
    assert not modified and not report.counts and not report.refused
    assert ir.to_proto(model).SerializeToString() == before
