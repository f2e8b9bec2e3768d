"""FuseLayerNorm on hand-written LayerNorms exported by both exporters.

Each fused model is checked against PyTorch eager on random inputs and on probes that hit eps
(constant rows, zeros, 1e-4 and 1e3 scales), with the full ONNX checker, with the epsilon
attribute compared bit for bit, and by a second run of the pass that must change nothing.
Look-alikes and unfusable candidates must be refused with a reason code and left
byte-identical. Exports PyTorch modules (slow); the graph-level cases without PyTorch are in
``test_fuse_layernorm_graphs.py``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import fusion
from fusion import Code
from fusion.base import FusionReport
from fusion.fuse_layernorm import FuseLayerNorm
from tests.support.norm_testing import (
    SHAPE,
    assert_within_float16_ulp,
    check_against_torch,
    export,
    op_types,
)

pytestmark = pytest.mark.slow

torch.set_num_threads(1)


def fuse(model: ir.Model, target: str = "ort") -> tuple[FusionReport, bool]:
    fusion_pass = FuseLayerNorm(target=target)
    modified = fusion_pass(model).modified
    return fusion_pass.outcomes, modified


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


def assert_fused(
    module: torch.nn.Module, exporter: str, opset: int, eps: float, **kwargs
) -> ir.Model:
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
    check_against_torch(module, model, **kwargs)
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
    module: torch.nn.Module, exporter: str, opset: int, code: Code, target: str = "ort"
) -> tuple[ir.Model, FusionReport]:
    """The pass records one refusal of ``code`` and leaves the model byte for byte as it was."""
    model = export(module, exporter, opset)
    before = ir.to_proto(model).SerializeToString()
    report, modified = fuse(model, target)
    assert not modified and not report.counts
    assert report.codes() == [code], report.refused
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
        Code.EPS_OUTSIDE_SQRT,
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
        Code.AXES_NOT_TRAILING,
    )


def test_opset_16_is_refused_for_onnx():
    model, report = assert_refused(
        randomized(DivLayerNorm(1e-5)), "torchscript", 16, Code.OPSET_TOO_LOW, target="onnx"
    )
    # The detail tells the user what to do.
    assert report.refused[0].detail == (
        "opset 16 has no LayerNormalization (needs 17): export with --opset 17 or target "
        "ONNX Runtime"
    )
    assert "LayerNormalization" not in op_types(model)


def test_opset_16_is_fused_for_ort():
    """ONNX Runtime registers LayerNormalization in the default domain at every opset."""
    module = randomized(DivLayerNorm(1e-5))
    model = export(module, "torchscript", 16)
    report, modified = fuse(model, "ort")
    assert modified and op_types(model) == ["LayerNormalization"]
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    fusion.check(model)
    check_against_torch(module, model)


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
    assert report.codes() == [Code.SHARED_OUTPUT]
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
    assert refusal.code == Code.AXIS_NOT_NORMALIZED
    assert refusal.detail == (
        "weight of shape [3, 1] varies along an axis that is not normalized: kept as a separate "
        "Mul after the LayerNormalization"
    )
    assert op_types(model) == ["LayerNormalization", "Mul", "Add"]
    norm = model.graph.node(0)
    np.testing.assert_array_equal(ir.convenience.get_const_tensor(norm.inputs[1]).numpy(), 1.0)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    check_against_torch(module, model)


class BiasedVarLayerNorm(DivLayerNorm):
    """``x.var(unbiased=False)``: the dynamo export centers x a second time (axes [2] where the
    mean has [-1]) and reshapes a keepdims=0 variance back to (2, 3, 1)."""

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = x.var(-1, unbiased=False, keepdim=True)
        return (x - m) / torch.sqrt(v + self.eps) * self.w + self.b


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 18)])
def test_biased_var_is_fused(exporter, opset):
    assert_fused(randomized(BiasedVarLayerNorm(1e-8)), exporter, opset, 1e-8)


class UnbiasedVarLayerNorm(DivLayerNorm):
    """``x.var()``: unbiased, the mean square times N / (N - 1) = 16 / 15."""

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(x.var(-1, keepdim=True) + self.eps) * self.w + self.b


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 18)])
def test_unbiased_var_rescales_eps_and_weight(exporter, opset):
    """(x - m) / sqrt(var_u + eps) = sqrt((N-1)/N) (x - m) / sqrt(var_b + eps (N-1)/N)."""
    module = randomized(UnbiasedVarLayerNorm(1e-5))
    factor = 16 / 15
    model = assert_fused(module, exporter, opset, float(np.float32(1e-5)) / factor)
    (node,) = model.graph
    scale = ir.convenience.get_const_tensor(node.inputs[1]).numpy()
    np.testing.assert_allclose(scale, module.w.detach().numpy() / np.sqrt(factor), rtol=1e-6)
    assert node.inputs[2].name == "b"


class UpcastLayerNorm(DivLayerNorm):
    """A float16 model in the HF habit: normalize ``x.float()``, cast back, then w and b."""

    def forward(self, x):
        h = x.float()
        d = h - h.mean(-1, keepdim=True)
        h = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.w + self.b


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 17), ("dynamo", 18)])
def test_float16_round_trip_is_fused_on_float16(exporter, opset):
    module = randomized(UpcastLayerNorm(1e-5)).half()
    unfused = export(module, exporter, opset)
    model = assert_fused(module, exporter, opset, 1e-5, rtol=4e-3)
    (node,) = model.graph
    assert node.inputs[0].dtype == node.outputs[0].dtype == ir.DataType.FLOAT16
    assert [v.name for v in node.inputs[1:]] == ["w", "b"]
    assert_within_float16_ulp(model, unfused)


def _hand_built(variance_tail: list[onnx.NodeProto], shape=(2, 2, 2)) -> ir.Model:
    """A LayerNorm over the last axis whose variance ``v`` goes through ``variance_tail``
    (ending in ``vt``) before ``Sqrt(vt + 1)``."""
    helper = onnx.helper
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1),
        helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["v"], keepdims=0),
        *variance_tail,
        helper.make_node("Add", ["vt", "eps"], ["a"]),
        helper.make_node("Sqrt", ["a"], ["s"]),
        helper.make_node("Div", ["d", "s"], ["y"], name="div"),
    ]
    f32 = onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f32, shape)],
        [helper.make_tensor_value_info("y", f32, shape)],
        [
            onnx.numpy_helper.from_array(np.array([-1]), "axes"),
            onnx.numpy_helper.from_array(np.array(1.0, np.float32), "eps"),
            onnx.numpy_helper.from_array(np.array([2, 2, 1]), "keep_shape"),
            onnx.numpy_helper.from_array(np.array([2, 1, 2]), "wrong_shape"),
            onnx.numpy_helper.from_array(np.array(-1.0, np.float32), "minus_one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return ir.from_proto(model)


@pytest.mark.parametrize(
    ("tail", "code"),
    [
        (
            [onnx.helper.make_node("Reshape", ["v", "wrong_shape"], ["vt"])],
            Code.VARIANCE_RESHAPED,
        ),
        (
            [
                onnx.helper.make_node("Reshape", ["v", "keep_shape"], ["r"]),
                onnx.helper.make_node("Mul", ["r", "minus_one"], ["vt"]),
            ],
            Code.FACTOR_NOT_POSITIVE,
        ),
    ],
    ids=["reshaped_across_axes", "negative_factor"],
)
def test_variance_that_is_not_a_scaled_keepdims_mean_is_refused(tail, code):
    model = _hand_built(tail)
    before = ir.to_proto(model).SerializeToString()
    report, modified = fuse(model)
    assert not modified and not report.counts
    assert report.codes() == [code], report.refused
    assert ir.to_proto(model).SerializeToString() == before


class RMSNorm(torch.nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_rmsnorm_is_not_a_layernorm_candidate():
    model = export(RMSNorm(), "dynamo", 18)
    before = ir.to_proto(model).SerializeToString()
    report, modified = fuse(model)
    assert not modified and not report.counts and not report.refused
    assert ir.to_proto(model).SerializeToString() == before
