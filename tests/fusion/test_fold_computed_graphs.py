"""FoldBatchNorm into weights and parameters the model computes from constants: a Conv weight
and BatchNorm parameters made by ``ConstantOfShape`` (onnx's light model-zoo files), a weight
computed as PyTorch's ``weight_norm`` writes it (``g * v / ||v||``); the size bound; each run on
ONNX Runtime before and after (:mod:`fusion.fold_batchnorm.computed`)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from onnx import TensorProto, helper

import fusion
from fusion import Code
from fusion.fold_batchnorm import computed
from tests.support.graphs import assert_close, make_model, run

F = TensorProto.FLOAT
PARAMS = ("scale", "B", "mean", "var")


def _bn_params(rng: np.random.Generator, c: int) -> dict[str, np.ndarray]:
    values = (rng.uniform(-2, 2, c), rng.uniform(-1, 1, c), rng.uniform(-1, 1, c))
    values += (rng.uniform(0.5, 2.0, c),)
    return {p: v.astype(np.float32) for p, v in zip(PARAMS, values, strict=True)}


def _light_conv_bn(rng: np.random.Generator, c_out: int = 64, c_in: int = 32, bn: bool = True):
    """Conv(x, ConstantOfShape([c_out, c_in, 3, 3], 0.01)) then a BatchNorm whose scale is a
    ConstantOfShape too, as onnx's light model-zoo files make every weight; ``bn``: False, the
    Conv alone."""
    value = helper.make_tensor("value", F, [1], [0.01])
    nodes = [
        ("ConstantOfShape", ["wshape"], ["w"], {"value": value}),
        ("ConstantOfShape", ["cshape"], ["scale"], {"value": value}),
        ("Conv", ["x", "w"], ["c"], {"pads": [1, 1, 1, 1]}),
        ("BatchNormalization", ["c", "scale", "B", "mean", "var"], ["y"], {"epsilon": 1e-3}),
    ]
    if not bn:
        nodes = [nodes[0], ("Conv", ["x", "w"], ["y"], {"pads": [1, 1, 1, 1]})]
    params = _bn_params(rng, c_out)
    del params["scale"]
    constants = {
        "wshape": np.array([c_out, c_in, 3, 3], np.int64),
        "cshape": np.array([c_out], np.int64),
        **params,
    }
    io = {"x": (F, [1, c_in, 8, 8])}
    return make_model(nodes, io, {"y": (F, [1, c_out, 8, 8])}, constants, opset=17)


def _weight_norm_conv_bn(rng: np.random.Generator, c_out: int = 64, c_in: int = 32):
    """Conv whose weight is ``g * v / ||v||`` (the norm over every axis but the first, as
    torch's ``weight_norm`` with ``dim=0``), 18432 elements (over the folder's 8192), then a
    BatchNorm."""
    nodes = [
        ("ReduceL2", ["v", "axes"], ["norm"], {"keepdims": 1}),
        ("Div", ["v", "norm"], ["unit"], {}),
        ("Mul", ["g", "unit"], ["w"], {}),
        ("Conv", ["x", "w", "b"], ["c"], {"pads": [1, 1, 1, 1]}),
        ("BatchNormalization", ["c", *PARAMS], ["y"], {"epsilon": 1e-5}),
    ]
    constants = {
        "v": rng.standard_normal((c_out, c_in, 3, 3)).astype(np.float32),
        "g": rng.uniform(0.5, 2, (c_out, 1, 1, 1)).astype(np.float32),
        "b": rng.standard_normal(c_out).astype(np.float32),
        "axes": np.array([1, 2, 3], np.int64),
        **_bn_params(rng, c_out),
    }
    io = {"x": (F, [1, c_in, 8, 8])}
    return make_model(nodes, io, {"y": (F, [1, c_out, 8, 8])}, constants, opset=18)


@pytest.mark.parametrize("build", [_light_conv_bn, _weight_norm_conv_bn])
def test_a_batchnorm_folds_into_a_computed_weight(rng, build):
    model = build(rng)
    feeds = {"x": rng.standard_normal((1, 32, 8, 8)).astype(np.float32)}
    before = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert report.counts["batchnorm_folded"] == 1 and not report.refused, report.to_dict()
    assert ops == {"Conv": 1}, ops
    assert_close(run(model, feeds), before, rtol=1e-4, atol=1e-4)


def test_a_computed_weight_over_the_bound_is_left(rng, monkeypatch):
    """Over :data:`computed.LIMIT` elements the ConstantOfShape is not materialized: the
    BatchNorm is refused ``not_constant``, as before, and the graph computes the same."""
    monkeypatch.setattr(computed, "LIMIT", 64 * 32 * 9 - 1)
    model = _light_conv_bn(rng)
    feeds = {"x": rng.standard_normal((1, 32, 8, 8)).astype(np.float32)}
    before = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    ops = collections.Counter(n.op_type for n in model.graph)
    assert [r.code for r in report.refused] == [Code.NOT_CONSTANT], report.to_dict()
    assert ops == {"ConstantOfShape": 1, "Conv": 1, "BatchNormalization": 1}, ops
    assert_close(run(model, feeds), before, rtol=0)


def test_a_computed_weight_with_no_batchnorm_beside_it_is_left(rng):
    """A ConstantOfShape weight with no BatchNorm to fold stays one (the file stays small)."""
    model = _light_conv_bn(rng, bn=False)
    fusion.optimize(model, target="onnx")
    assert collections.Counter(n.op_type for n in model.graph)["ConstantOfShape"] == 1
