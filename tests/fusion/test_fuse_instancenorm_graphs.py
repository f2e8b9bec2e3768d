"""FuseInstanceNorm on hand-built graphs: the per-channel "CNN LayerNorm" becomes one
InstanceNormalization with the same numbers on ONNX Runtime; look-alikes are left to
FuseLayerNorm."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

import fusion
from fusion.fuse_instancenorm import FuseInstanceNorm
from tests.support.graphs import assert_close, make_model, ops, run
from tests.support.norm_graphs import Graph, layernorm

F = TensorProto.FLOAT
SHAPE = (2, 4, 5, 6)


def cnn_layernorm(rng, *, axes=(2, 3), gamma_shape=(1, 4, 1, 1), bias=True, factor=None):
    """mean and biased variance over ``axes``, eps 1e-5, then ``* gamma (+ beta)``."""
    nodes = [
        ("ReduceMean", ["x", "axes"], ["mu"], {"keepdims": 1}),
        ("Sub", ["x", "mu"], ["d"], {}),
        ("Pow", ["d", "two"], ["d2"], {}),
        ("ReduceMean", ["d2", "axes"], ["var"], {"keepdims": 1}),
    ]
    inits = {
        "axes": np.array(axes, np.int64),
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-5, np.float32),
        "gamma": rng.uniform(0.5, 2.0, gamma_shape).astype(np.float32),
        "beta": rng.standard_normal(gamma_shape).astype(np.float32),
    }
    if factor is not None:  # e.g. torch's var(unbiased) written as a scaled mean
        nodes.append(("Mul", ["var", "factor"], ["var_s"], {}))
        inits["factor"] = np.array(factor, np.float32)
    var = "var" if factor is None else "var_s"
    nodes += [
        ("Add", [var, "eps"], ["ve"], {}),
        ("Sqrt", ["ve"], ["std"], {}),
        ("Div", ["d", "std"], ["n"], {}),
        ("Mul", ["n", "gamma"], ["y" if not bias else "s"], {}),
    ]
    if bias:
        nodes.append(("Add", ["s", "beta"], ["y"], {}))
    return make_model(nodes, {"x": (F, SHAPE)}, {"y": (F, SHAPE)}, inits, opset=18)


def _optimized(model, target="ort"):
    report = fusion.optimize(model, target=target)
    return report, ops(model)


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("bias", [True, False])
def test_cnn_layernorm_becomes_instancenorm(rng, target, bias):
    model = cnn_layernorm(rng, bias=bias)
    feeds = {"x": rng.standard_normal(SHAPE).astype(np.float32) * 3 + 1}
    want = run(model, feeds)
    report, after = _optimized(model, target)
    assert after == ["InstanceNormalization"]
    assert report.counts["instancenorm_fused"] == 1 and report.counts["layernorm_fused"] == 0
    assert not report.refused
    assert_close(run(model, feeds), want)
    # eps matters on a constant feature map: both give beta (up to the rounding of the mean,
    # divided by sqrt(eps)), no NaN
    const = {"x": np.full(SHAPE, 7.0, np.float32)}
    again = cnn_layernorm(np.random.default_rng(0), bias=bias)  # same draws as `rng`
    assert_close(run(model, const), run(again, const), rtol=1e-3)


def test_scaled_variance_moves_into_scale_and_epsilon(rng):
    model = cnn_layernorm(rng, factor=1.5)
    feeds = {"x": rng.standard_normal(SHAPE).astype(np.float32)}
    want = run(model, feeds)
    report, after = _optimized(model)
    assert after == ["InstanceNormalization"]
    assert_close(run(model, feeds), want)


def test_weight_over_spatial_axes_stays_a_layernorm(rng):
    """gamma of shape (1, 1, 5, 6) is a LayerNorm weight: FuseLayerNorm absorbs it."""
    model = cnn_layernorm(rng, gamma_shape=(1, 1, 5, 6), bias=False)
    feeds = {"x": rng.standard_normal(SHAPE).astype(np.float32)}
    want = run(model, feeds)
    report, after = _optimized(model)
    assert after == ["LayerNormalization"] and report.counts["instancenorm_fused"] == 0
    assert_close(run(model, feeds), want)


def test_norm_over_one_spatial_axis_is_not_an_instancenorm(rng):
    """Over the last axis only, with a per-channel gamma: a LayerNorm and a separate Mul."""
    model = cnn_layernorm(rng, axes=(3,), bias=False)
    feeds = {"x": rng.standard_normal(SHAPE).astype(np.float32)}
    want = run(model, feeds)
    report, after = _optimized(model)
    assert report.counts["instancenorm_fused"] == 0
    assert after == ["LayerNormalization", "Mul"]
    assert report.codes("layernorm") == ["axis_not_normalized"]
    assert_close(run(model, feeds), want)


def _after_relu_without_shapes(rng):
    """The CNN LayerNorm of ``Relu(x)``, every intermediate value without shape or type, as the
    TorchScript exporter writes a norm after a layer."""
    model = cnn_layernorm(rng)
    graph = model.graph
    relu = ir.node("Relu", [graph.inputs[0]])
    graph.insert_before(graph[0], relu)
    for node in list(graph)[1:]:
        for i, value in enumerate(node.inputs):
            if value is graph.inputs[0]:
                node.replace_input_with(i, relu.outputs[0])
    for node in graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape, value.type = None, None
    return model


def test_shapes_are_inferred_before_matching(rng):
    """FuseInstanceNorm alone cannot place the channel axis of a value with no shape; optimize()
    runs shape inference first (FillShapes) and fuses it."""
    alone = _after_relu_without_shapes(rng)
    assert not FuseInstanceNorm()(alone).modified
    model = _after_relu_without_shapes(np.random.default_rng(0))
    feeds = {"x": rng.standard_normal(SHAPE).astype(np.float32)}
    want = run(model, feeds)
    report, after = _optimized(model)
    assert after == ["Relu", "InstanceNormalization"] and report.counts["instancenorm_fused"] == 1
    assert_close(run(model, feeds), want)


def test_fill_shapes_keeps_the_shapes_a_model_has(rng):
    model = cnn_layernorm(rng)
    before = {v.name: v.shape for node in model.graph for v in node.outputs}
    assert not fusion.FillShapes()(model).modified
    assert {v.name: v.shape for node in model.graph for v in node.outputs} == before


def test_eps_outside_sqrt_is_refused(rng):
    """A look-alike: ``(x - mu) / (sqrt(var) + eps) * gamma`` is no InstanceNorm, no LayerNorm."""
    g = Graph()
    normed = layernorm(g, "x", axes=(2, 3), eps_outside=True)
    gamma = g.const("gamma", rng.uniform(0.5, 2.0, (1, 4, 1, 1)).astype(np.float32))
    g.node("Mul", [normed, gamma], "y")
    model = g.model({"x": (F, SHAPE)}, {"y": (F, SHAPE)})
    raw = ops(model)
    report, after = _optimized(model)
    assert after == raw and report.codes() == ["eps_outside_sqrt"]
