"""FuseGroupNorm on hand-built graphs: the exported GroupNorm (Reshape -> InstanceNormalization
-> Reshape -> Mul -> Add) is recognized and kept with its code; a hand-written one becomes that
form with the same numbers on ONNX Runtime; look-alikes are left to FuseLayerNorm."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

import fusion
from fusion import Code
from fusion.fuse_groupnorm import FuseGroupNorm
from tests.support.graphs import assert_close, ops, run
from tests.support.norm_graphs import Graph, assert_refused, fuse_and_compare, layernorm

F = TensorProto.FLOAT
SHAPE = (2, 6, 4, 5)  # (N, C, H, W)
GROUPS = 3


def _affine(g: Graph, rng, y: str, shape=(SHAPE[1], 1, 1)) -> str:
    """``y * w + b`` with random per-channel ``w`` (1 + 0.5 N(0, 1)) and ``b``."""
    w = g.const("w", (1 + 0.5 * rng.standard_normal(shape)).astype(np.float32))
    b = g.const("b", rng.standard_normal(shape).astype(np.float32))
    return g.node("Add", [g.node("Mul", [y, w], "scaled"), b], "y")


def exported_groupnorm(rng, *, opset=18):
    """nn.GroupNorm as the exporters write it: InstanceNormalization of the (N, G, -1) view."""
    g = Graph(opset)
    view = g.node("Reshape", ["x", g.const("groups", np.array([0, GROUPS, -1]))], "view")
    ones, zeros = np.ones(GROUPS, np.float32), np.zeros(GROUPS, np.float32)
    normed = g.node(
        "InstanceNormalization", [view, g.const("one", ones), g.const("zero", zeros)], "n"
    )
    back = g.node("Reshape", [normed, g.const("shape", np.array(SHAPE))], "back")
    _affine(g, rng, back)
    return g.model({"x": (F, SHAPE)}, {"y": (F, SHAPE)})


def hand_groupnorm(rng, *, view=(0, GROUPS, -1), back=SHAPE, factor=None, eps=1e-5):
    """``x.reshape(view)``, mean and biased variance (``Mul(d, d)``, times ``factor``) over the
    axes after the group axis, ``reshape(back)``, per-channel weight and bias."""
    g = Graph()
    v = g.node("Reshape", ["x", g.const("groups", np.array(view))], "view")
    axes = tuple(range(2, len(view)))
    d = g.node("Sub", [v, g.reduce("ReduceMean", v, "mean", axes)], "d")
    var = g.reduce("ReduceMean", g.node("Mul", [d, d], "sq"), "var", axes)
    if factor is not None:  # torch's unbiased var is such a scaled mean
        var = g.node("Mul", [var, g.const("factor", np.float32(factor))], "var_f")
    den = g.node("Sqrt", [g.node("Add", [var, g.const("eps", np.float32(eps))], "ve")], "den")
    out = g.node("Reshape", [g.node("Div", [d, den], "n"), g.const("shape", np.array(back))], "r")
    _affine(g, rng, out, (1, back[1], 1, 1) if len(back) == 4 else (1,))
    return g.model({"x": (F, SHAPE)}, {"y": (F, SHAPE)})


def test_exported_groupnorm_is_recognized_and_kept(rng):
    model = exported_groupnorm(rng)
    report = assert_refused(model, FuseGroupNorm(), Code.NO_ORT_KERNEL)
    assert f"{GROUPS} groups of {SHAPE[1]} channels" in report.refused[0].detail


def test_optimize_lists_the_kept_groupnorm(rng):
    model = exported_groupnorm(rng, opset=21)
    raw = ops(model)
    report = fusion.optimize(model)
    assert ops(model) == raw and not any(report.counts.values())
    assert report.codes() == ["no_ort_kernel"] and report.refused[0].family == "groupnorm"


@pytest.mark.parametrize(
    "view", [(0, GROUPS, -1), (SHAPE[0], GROUPS, 40), (0, GROUPS, 2, 4, 5)], ids=str
)
def test_hand_written_groupnorm_becomes_instancenorm(rng, view):
    model = hand_groupnorm(rng, view=view)
    report = fuse_and_compare(model, FuseGroupNorm(), rng)
    assert report.counts["groupnorm_fused"] == 1 and not report.refused
    assert ops(model) == ["Reshape", "InstanceNormalization", "Reshape", "Mul", "Add"]
    (norm,) = (n for n in model.graph if n.op_type == "InstanceNormalization")
    assert norm.attributes.get_float("epsilon") == pytest.approx(1e-5)
    # a constant feature map: eps keeps it finite, as in the original
    const = {"x": np.full(SHAPE, 3.0, np.float32)}
    assert_close(run(model, const), run(hand_groupnorm(np.random.default_rng(0), view=view), const))


def test_scaled_variance_moves_into_scale_and_epsilon(rng):
    model = hand_groupnorm(rng, factor=1.25, eps=1e-3)
    fuse_and_compare(model, FuseGroupNorm(), rng)
    (norm,) = (n for n in model.graph if n.op_type == "InstanceNormalization")
    assert norm.attributes.get_float("epsilon") == pytest.approx(1e-3 / 1.25)
    scale = norm.inputs[1].const_value.numpy()
    np.testing.assert_allclose(scale, np.full(GROUPS, 1 / np.sqrt(1.25)), rtol=1e-6)


def test_groups_across_the_batch_are_no_groupnorm(rng):
    """(N, C, H, W) -> (C, N, -1)-sized view: the first axis is not the batch. FuseLayerNorm
    fuses the norm over the last axis; it is no GroupNorm."""
    model = hand_groupnorm(rng, view=(SHAPE[1], SHAPE[0], -1))
    feeds = {"x": rng.standard_normal(SHAPE).astype(np.float32)}
    want = run(model, feeds)
    report = fusion.optimize(model)
    assert report.counts["groupnorm_fused"] == 0 and report.counts["layernorm_fused"] == 1
    assert_close(run(model, feeds), want)


def test_reshape_back_to_another_shape_is_no_groupnorm(rng):
    model = hand_groupnorm(rng, back=(SHAPE[0], SHAPE[1] * SHAPE[2], SHAPE[3]))
    report = fusion.optimize(model)
    assert report.counts["groupnorm_fused"] == 0 and report.counts["layernorm_fused"] == 1


def test_statistics_over_the_groups_are_refused(rng):
    """A look-alike: the mean over the group axis of the view, not within each group (a
    channels-first LayerNorm of the view, kept at batch 2 for speed)."""
    g = Graph()
    v = g.node("Reshape", ["x", g.const("groups", np.array([0, GROUPS, -1]))], "view")
    out = g.node("Reshape", [layernorm(g, v, axes=(1,)), g.const("shape", np.array(SHAPE))], "y")
    model = g.model({"x": (F, SHAPE)}, {out: (F, SHAPE)})
    raw = ops(model)
    report = fusion.optimize(model)
    assert ops(model) == raw and not any(report.counts.values())
    assert report.codes() == ["slower_measured", "axes_not_trailing"]
    assert report.codes("groupnorm") == []


def standard_groupnorm(rng, *, opset=21, constant=True):
    """GroupNormalization-21 (per-channel scale and bias), as the dynamo exporter writes
    nn.GroupNorm from opset 21."""
    g = Graph(opset)
    scale = (1 + 0.5 * rng.standard_normal(SHAPE[1])).astype(np.float32)
    bias = rng.standard_normal(SHAPE[1]).astype(np.float32)
    names = [g.const("scale", scale), g.const("bias", bias)]
    inputs = {"x": (F, SHAPE)}
    if not constant:
        names[1] = "bias_in"
        inputs["bias_in"] = (F, (SHAPE[1],))
    g.node("GroupNormalization", ["x", *names], "y", num_groups=GROUPS, epsilon=1e-3)
    return g.model(inputs, {"y": (F, SHAPE)})


def test_groupnormalization_21_becomes_the_exported_form(rng):
    model = standard_groupnorm(rng)
    report = fuse_and_compare(model, FuseGroupNorm(), rng)
    assert report.counts["groupnorm_fused"] == 1
    assert ops(model) == ["Reshape", "InstanceNormalization", "Shape", "Reshape", "Mul", "Add"]
    (norm,) = (n for n in model.graph if n.op_type == "InstanceNormalization")
    assert norm.attributes.get_float("epsilon") == pytest.approx(1e-3)
    # run again within optimize: the exported form is then recognized and kept
    again = fusion.optimize(model)
    assert not any(again.counts.values()) and again.codes() == ["no_ort_kernel"]


def test_groupnormalization_21_stays_for_the_onnx_target(rng):
    model = standard_groupnorm(rng)
    assert not FuseGroupNorm("onnx")(model).modified
    assert ops(model) == ["GroupNormalization"]


def test_groupnormalization_with_a_bias_input_is_kept(rng):
    model = standard_groupnorm(rng, constant=False)
    assert_refused(model, FuseGroupNorm(), Code.NOT_CONSTANT)
