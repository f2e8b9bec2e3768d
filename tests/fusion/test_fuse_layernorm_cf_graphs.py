"""FuseChannelsFirstLayerNorm on hand-built graphs: ConvNeXt's channels-first LayerNorm becomes
Transpose -> LayerNormalization -> Transpose (the Transposes cancelled against neighbouring
inverse ones) with the same numbers on ONNX Runtime where that was measured faster, and is kept
with its code elsewhere; look-alikes are left to FuseLayerNorm."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

import fusion
from fusion import Code
from fusion.fuse_layernorm_cf import FuseChannelsFirstLayerNorm
from tests.support.graphs import assert_close, ops, run
from tests.support.norm_graphs import Graph, assert_refused, fuse_and_compare, layernorm

F = TensorProto.FLOAT
C = 6
TO_LAST, TO_FIRST = [0, 2, 3, 1], [0, 3, 1, 2]


def channels_first(
    rng,
    batch=1,
    *,
    spatial=(4, 5),
    weight_shape=None,
    before=False,
    after=False,
    eps_outside=False,
):
    """``w[:, None, None] * (x - u) / sqrt(s + eps) + b[:, None, None]`` over axis 1 of
    (batch, C, *spatial); ``before``: x is a channels-last input moved channels-first,
    ``after``: the result is moved channels-last."""
    g = Graph()
    shape = (batch, C, *spatial)
    rank = len(shape)
    x = "x"
    if before:
        x = g.node("Transpose", ["x"], "x_first", perm=[0, rank - 1, *range(1, rank - 1)])
    normed = layernorm(g, x, axes=(1,), eps=1e-6, eps_outside=eps_outside)
    weight_shape = weight_shape or (C, *(1,) * (rank - 2))
    w = g.const("w", (1 + 0.5 * rng.standard_normal(weight_shape)).astype(np.float32))
    b = g.const("b", rng.standard_normal((C, *(1,) * (rank - 2))).astype(np.float32))
    y = g.node("Add", [g.node("Mul", [w, normed], "scaled"), b], "y_first")
    out_shape = shape
    if after:
        y = g.node("Transpose", [y], "y_last", perm=[0, *range(2, rank), 1])
        out_shape = (batch, *spatial, C)
    in_shape = (batch, *spatial, C) if before else shape
    return g.model({"x": (F, in_shape)}, {y: (F, out_shape)})


@pytest.mark.parametrize("spatial", [(4, 5), (7,)], ids=["nchw", "ncl"])
def test_batch_one_becomes_transposed_layernorm(rng, spatial):
    model = channels_first(rng, spatial=spatial)
    report = fuse_and_compare(model, FuseChannelsFirstLayerNorm(), rng)
    assert report.counts["layernorm_cf_fused"] == 1 and not report.refused
    assert ops(model) == ["Transpose", "LayerNormalization", "Transpose"]
    (norm,) = (n for n in model.graph if n.op_type == "LayerNormalization")
    assert norm.attributes.get_int("axis") == -1
    assert norm.attributes.get_float("epsilon") == pytest.approx(1e-6)
    const = {"x": np.full((1, C, *spatial), 2.0, np.float32)}
    again = channels_first(np.random.default_rng(0), spatial=spatial)  # same draws as `rng`
    assert_close(run(model, const), run(again, const), rtol=1e-3)


def test_larger_batch_is_kept_as_measured_slower(rng):
    model = channels_first(rng, batch=2)
    report = assert_refused(model, FuseChannelsFirstLayerNorm(), Code.SLOWER_MEASURED)
    assert "(2, 6, 4, 5)" in report.refused[0].detail


@pytest.mark.parametrize(
    ("before", "after", "want"),
    [
        (True, False, ["LayerNormalization", "Transpose"]),
        (False, True, ["Transpose", "LayerNormalization"]),
        (True, True, ["LayerNormalization"]),
    ],
)
def test_transposes_cancel_against_neighbours(rng, before, after, want):
    """At batch 2 the rewrite is made only where a Transpose cancels."""
    model = channels_first(rng, batch=2, before=before, after=after)
    report = fuse_and_compare(model, FuseChannelsFirstLayerNorm(), rng)
    assert ops(model) == want
    assert report.fused[0].became == " -> ".join(want)


def test_weight_over_spatial_axes_stays_a_mul(rng):
    """A weight of shape (1, H, W) is not per channel: it stays after the fused norm."""
    model = channels_first(rng, weight_shape=(1, 4, 5))
    fuse_and_compare(model, FuseChannelsFirstLayerNorm(), rng)
    assert ops(model) == ["Transpose", "LayerNormalization", "Transpose", "Mul", "Add"]


def test_eps_outside_sqrt_is_left_to_layernorm(rng):
    model = channels_first(rng, eps_outside=True)
    raw = ops(model)
    report = fusion.optimize(model)
    assert ops(model) == raw and not any(report.counts.values())
    assert report.codes() == ["eps_outside_sqrt"]


@pytest.mark.parametrize(("target", "fused"), [("ort", True), ("onnx", False)])
def test_opset_below_17(rng, target, fused):
    """ONNX Runtime has LayerNormalization at every opset; standard ONNX from 17."""
    g = Graph(opset=15)
    normed = layernorm(g, "x", axes=(1,), eps=1e-6)
    model = g.model({"x": (F, (1, C, 4, 5))}, {normed: (F, (1, C, 4, 5))})
    fusion_pass = FuseChannelsFirstLayerNorm(target)
    if fused:
        fuse_and_compare(model, fusion_pass, rng)
        assert ops(model) == ["Transpose", "LayerNormalization", "Transpose"]
    else:
        assert_refused(model, fusion_pass, Code.OPSET_TOO_LOW)
