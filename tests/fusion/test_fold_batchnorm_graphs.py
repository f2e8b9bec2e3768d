"""FoldBatchNorm on hand-built ONNX graphs (no PyTorch): what folds, what is refused with which
code, and ONNX Runtime numerics before vs after every fold.

Every BatchNorm statistic is random (running mean, variance in [0.5, 2], gamma, beta), and so
is every weight and bias. Nodes are unnamed, so the report names them by their first output.
The exporter-based cases are in test_fold_batchnorm.py (slow).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
import pytest
from graphs import assert_close, make_model, ops, run
from onnx import TensorProto

from fusion.base import Code, FusionReport
from fusion.fold_batchnorm import FoldBatchNorm

F = TensorProto.FLOAT
PARAMS = ("scale", "B", "mean", "var")


def _stats(rng: np.random.Generator, prefix: str, c: int, positive: bool = False) -> dict:
    """Random BatchNorm parameters ``{prefix}_scale`` etc.; ``positive``: every gamma > 0."""
    gamma = rng.uniform(0.2, 2.0, c) if positive else rng.uniform(-2.0, 2.0, c)
    values = (gamma, rng.uniform(-1, 1, c), rng.uniform(-1, 1, c), rng.uniform(0.5, 2.0, c))
    return {f"{prefix}_{p}": v.astype(np.float32) for p, v in zip(PARAMS, values, strict=True)}


def _bn(x: str, y: str, prefix: str = "bn", **attributes) -> tuple:
    """A BatchNormalization node reading the parameters of :func:`_stats`."""
    inputs = [x, *(f"{prefix}_{p}" for p in PARAMS)]
    return ("BatchNormalization", inputs, [y], {"epsilon": 1e-3, **attributes})


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


def _fold(model: ir.Model) -> tuple[FusionReport, bool]:
    fusion_pass = FoldBatchNorm()
    modified = fusion_pass(model).modified
    return fusion_pass.outcomes, modified


def _proto(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


# ---- folds: each builder returns (model, input shape, counts, ops left, anchor) ----


def _conv_bn(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), "b": _normal(rng, 4), **_stats(rng, "bn", 4)}
    nodes = [("Conv", ["x", "w", "b"], ["c"], {"pads": [1, 1, 1, 1]}), _bn("c", "y")]
    return nodes, (2, 3, 6, 6), inits, ["Conv"], "c"


def _grouped_conv_nobias_bn(rng):
    inits = {"w": _normal(rng, 6, 2, 3, 3), **_stats(rng, "bn", 6)}
    nodes = [("Conv", ["x", "w"], ["c"], {"group": 2}), _bn("c", "y")]
    return nodes, (2, 4, 5, 5), inits, ["Conv"], "c"


def _convtranspose_bn(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), "b": _normal(rng, 6), **_stats(rng, "bn", 6)}
    attrs = {"group": 2, "strides": [2, 2]}
    nodes = [("ConvTranspose", ["x", "w", "b"], ["c"], attrs), _bn("c", "y")]
    return nodes, (1, 4, 3, 3), inits, ["ConvTranspose"], "c"


def _gemm_bn(trans_b: int):
    def build(rng):
        w = _normal(rng, 5, 6)
        inits = {"w": w.T.copy() if trans_b else w, "bias": _normal(rng, 6), **_stats(rng, "bn", 6)}
        attrs = {"alpha": 0.7, "beta": 1.3, "transB": trans_b}
        nodes = [("Gemm", ["x", "w", "bias"], ["g"], attrs), _bn("g", "y")]
        return nodes, (3, 5), inits, ["Gemm"], "g"

    return build


def _matmul_bn(rng):
    inits = {"w": _normal(rng, 5, 6), "b": _normal(rng, 6), **_stats(rng, "bn", 6)}
    nodes = [("MatMul", ["x", "w"], ["mm"], {}), ("Add", ["mm", "b"], ["lin"], {}), _bn("lin", "y")]
    return nodes, (3, 5), inits, ["MatMul", "Add"], "mm"


def _matmul_transpose_bn(rng):
    """(N, L, C): ``bn(linear(x).transpose(1, 2)).transpose(1, 2)``."""
    inits = {"w": _normal(rng, 5, 6), "b": _normal(rng, 6), **_stats(rng, "bn", 6)}
    nodes = [
        ("MatMul", ["x", "w"], ["mm"], {}),
        ("Add", ["mm", "b"], ["lin"], {}),
        ("Transpose", ["lin"], ["t"], {"perm": [0, 2, 1]}),
        _bn("t", "n"),
        ("Transpose", ["n"], ["y"], {"perm": [0, 2, 1]}),
    ]
    return nodes, (2, 4, 5), inits, ["MatMul", "Add", "Transpose", "Transpose"], "mm"


def _matmul_reshape_bn(rng):
    """(N, L, C): ``bn(linear(x).reshape(-1, C)).reshape(N, L, C)``."""
    inits = {"w": _normal(rng, 5, 6), "b": _normal(rng, 6), **_stats(rng, "bn", 6)}
    inits |= {"flat": np.array([-1, 6]), "back": np.array([2, 4, 6])}
    nodes = [
        ("MatMul", ["x", "w"], ["mm"], {}),
        ("Add", ["mm", "b"], ["lin"], {}),
        ("Reshape", ["lin", "flat"], ["r"], {}),
        _bn("r", "n"),
        ("Reshape", ["n", "back"], ["y"], {}),
    ]
    return nodes, (2, 4, 5), inits, ["MatMul", "Add", "Reshape", "Reshape"], "mm"


def _conv_maxpool_bn(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), "b": _normal(rng, 4)}
    inits |= _stats(rng, "bn", 4, positive=True)
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [("Conv", ["x", "w", "b"], ["c"], {}), ("MaxPool", ["c"], ["p"], pool), _bn("p", "y")]
    return nodes, (2, 3, 8, 8), inits, ["Conv", "MaxPool"], "c"


def _two_batchnorms(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), **_stats(rng, "bn", 4), **_stats(rng, "bn2", 4)}
    nodes = [("Conv", ["x", "w"], ["c"], {}), _bn("c", "n"), _bn("n", "y", "bn2")]
    return nodes, (2, 3, 6, 6), inits, ["Conv"], "c"


def _hand_written_bn(rng):
    """``(conv(x) - mean) / sqrt(var + eps) * gamma + beta`` with (1, C, 1, 1) constants."""
    c = (1, 4, 1, 1)
    inits = {"w": _normal(rng, 4, 3, 3, 3), "mean": rng.uniform(-1, 1, c).astype(np.float32)}
    inits["std"] = np.sqrt(rng.uniform(0.5, 2.0, c) + 1e-5).astype(np.float32)
    inits |= {"gamma": _normal(rng, *c), "beta": _normal(rng, *c)}
    nodes = [
        ("Conv", ["x", "w"], ["c"], {}),
        ("Sub", ["c", "mean"], ["centered"], {}),
        ("Div", ["centered", "std"], ["normed"], {}),
        ("Mul", ["normed", "gamma"], ["scaled"], {}),
        ("Add", ["scaled", "beta"], ["y"], {}),
    ]
    return nodes, (2, 3, 6, 6), inits, ["Conv"], "c"


def _bn_conv(rng):
    """A BatchNorm before an unpadded grouped Conv folds into the Conv."""
    inits = {"w": _normal(rng, 6, 2, 3, 3), "b": _normal(rng, 6), **_stats(rng, "bn", 4)}
    nodes = [_bn("x", "n"), ("Conv", ["n", "w", "b"], ["y"], {"group": 2})]
    return nodes, (2, 4, 6, 6), inits, ["Conv"], "n"


def _bn_gemm(rng):
    inits = {"w": _normal(rng, 3, 5), "b": _normal(rng, 3), **_stats(rng, "bn", 5)}
    nodes = [_bn("x", "n"), ("Gemm", ["n", "w", "b"], ["y"], {"transB": 1, "alpha": 0.5})]
    return nodes, (4, 5), inits, ["Gemm"], "n"


def _bn_maxpool_transpose_reshape_gemm(rng):
    """CREPE's tail: BN -> MaxPool (2, 1) -> Transpose -> Reshape -> Gemm classifier."""
    inits = {"w": _normal(rng, 5, 32), "b": _normal(rng, 5), **_stats(rng, "bn", 8, True)}
    inits["shape"] = np.array([0, -1])
    nodes = [
        _bn("x", "n"),
        ("MaxPool", ["n"], ["p"], {"kernel_shape": [2, 1], "strides": [2, 1]}),
        ("Transpose", ["p"], ["t"], {"perm": [0, 2, 1, 3]}),
        ("Reshape", ["t", "shape"], ["r"], {}),
        ("Gemm", ["r", "w", "b"], ["y"], {"transB": 1}),
    ]
    return nodes, (2, 8, 8, 1), inits, ["MaxPool", "Transpose", "Reshape", "Gemm"], "n"


def _matmul_scalar_mul(rng):
    """Attention's ``1/sqrt(d)`` after a projection: folded, but no BatchNorm."""
    inits = {"w": _normal(rng, 8, 6), "b": _normal(rng, 6), "k": np.float32(0.125)}
    nodes = [
        ("MatMul", ["x", "w"], ["mm"], {}),
        ("Add", ["mm", "b"], ["lin"], {}),
        ("Mul", ["lin", "k"], ["y"], {}),
    ]
    return nodes, (2, 3, 8), inits, ["MatMul", "Add"], "mm"


# name -> (builder, counts)
FOLDS: dict[str, tuple[Callable, dict]] = {
    "conv_bn": (_conv_bn, {"batchnorm_folded": 1}),
    "grouped_conv_nobias_bn": (_grouped_conv_nobias_bn, {"batchnorm_folded": 1}),
    "convtranspose_bn": (_convtranspose_bn, {"batchnorm_folded": 1}),
    "gemm_transB0_bn": (_gemm_bn(0), {"batchnorm_folded": 1}),
    "gemm_transB1_bn": (_gemm_bn(1), {"batchnorm_folded": 1}),
    "matmul_bn": (_matmul_bn, {"batchnorm_folded": 1}),
    "matmul_transpose_bn_transpose": (_matmul_transpose_bn, {"batchnorm_folded": 1}),
    "matmul_reshape_bn_reshape": (_matmul_reshape_bn, {"batchnorm_folded": 1}),
    "conv_maxpool_bn": (_conv_maxpool_bn, {"batchnorm_folded": 1}),
    "two_batchnorms": (_two_batchnorms, {"batchnorm_folded": 2}),
    "hand_written_bn": (_hand_written_bn, {"batchnorm_folded": 1}),
    "bn_conv": (_bn_conv, {"batchnorm_folded": 1}),
    "bn_gemm": (_bn_gemm, {"batchnorm_folded": 1}),
    "bn_maxpool_transpose_reshape_gemm": (
        _bn_maxpool_transpose_reshape_gemm,
        {"batchnorm_folded": 1},
    ),
    "matmul_scalar_mul": (_matmul_scalar_mul, {"affine_folded": 1}),
}


def _build(nodes, shape, inits) -> ir.Model:
    return make_model(nodes, {"x": (F, shape)}, {"y": (F, None)}, inits, opset=15)


@pytest.mark.parametrize("name", list(FOLDS))
def test_folds(name, rng):
    builder, counts = FOLDS[name]
    nodes, shape, inits, ops_left, anchor = builder(rng)
    model = _build(nodes, shape, inits)
    feeds = {"x": _normal(rng, *shape)}
    before = run(model, feeds)

    report, modified = _fold(model)

    assert modified
    assert dict(report.counts) == counts
    assert report.refused == []
    assert [f.node for f in report.fused] == [anchor]
    assert ops(model) == ops_left
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert_close(run(model, feeds), before)
    proto = _proto(model)
    assert _fold(model)[1] is False and _proto(model) == proto  # a second run changes nothing


def test_fold_across_ops_says_so(rng):
    nodes, shape, inits, _, _ = _matmul_transpose_bn(rng)
    report, _ = _fold(_build(nodes, shape, inits))
    assert report.fused[0].became == "folded into MatMul 'mm' across Transpose"
    nodes, shape, inits, _, _ = _bn_maxpool_transpose_reshape_gemm(rng)
    report, _ = _fold(_build(nodes, shape, inits))
    assert report.fused[0].became == (
        "folded into the following Gemm 'y' across MaxPool, Transpose, Reshape"
    )


# ---- refusals: each builder returns (nodes, input shape, initializers, anchor) ----


def _training_mode(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), **_stats(rng, "bn", 4)}
    bn = _bn("c", "y", training_mode=1)
    bn = (bn[0], bn[1], ["y", "running_mean", "running_var"], bn[3])
    return [("Conv", ["x", "w"], ["c"], {}), bn], (2, 3, 6, 6), inits, "y"


def _bn_padded_conv(rng):
    inits = {"w": _normal(rng, 4, 4, 3, 3), **_stats(rng, "bn", 4)}
    nodes = [_bn("x", "n"), ("Conv", ["n", "w"], ["y"], {"pads": [1, 1, 1, 1]})]
    return nodes, (2, 4, 6, 6), inits, "n"


def _bn_read_twice(rng):
    inits = {"w": _normal(rng, 4, 4, 3, 3), **_stats(rng, "bn", 4)}
    nodes = [
        _bn("x", "n"),
        ("Conv", ["n", "w"], ["c"], {}),
        ("ReduceMean", ["n"], ["m"], {"axes": [2, 3], "keepdims": 1}),
        ("Add", ["c", "m"], ["y"], {}),
    ]
    return nodes, (2, 4, 6, 6), inits, "n"


def _conv_read_twice(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), **_stats(rng, "bn", 4)}
    nodes = [("Conv", ["x", "w"], ["c"], {}), _bn("c", "n"), ("Add", ["n", "c"], ["y"], {})]
    return nodes, (2, 3, 6, 6), inits, "n"


def _channel_mismatch(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), **_stats(rng, "bn", 3)}
    return [("Conv", ["x", "w"], ["c"], {}), _bn("c", "y")], (2, 3, 6, 6), inits, "y"


def _maxpool_negative_scale_after(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), **_stats(rng, "bn", 4, positive=True)}
    inits["bn_scale"][1] = -0.5
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [("Conv", ["x", "w"], ["c"], {}), ("MaxPool", ["c"], ["p"], pool), _bn("p", "y")]
    return nodes, (2, 3, 8, 8), inits, "y"


def _maxpool_negative_scale_before(rng):
    inits = {"w": _normal(rng, 4, 4, 1, 1), **_stats(rng, "bn", 4, positive=True)}
    inits["bn_scale"][2] = -0.5
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [_bn("x", "n"), ("MaxPool", ["n"], ["p"], pool), ("Conv", ["p", "w"], ["y"], {})]
    return nodes, (2, 4, 8, 8), inits, "n"


def _stats_not_constant(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), **_stats(rng, "bn", 4)}
    inits.pop("bn_mean")  # fed at run time instead
    return [("Conv", ["x", "w"], ["c"], {}), _bn("c", "y")], (2, 3, 6, 6), inits, "y"


def _after_relu(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), **_stats(rng, "bn", 4)}
    nodes = [("Conv", ["x", "w"], ["c"], {}), ("Relu", ["c"], ["r"], {}), _bn("r", "y")]
    return nodes, (2, 3, 6, 6), inits, "y"


def _zero_divisor(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), "d": np.array([1, 0, 2, 3], np.float32)[:, None, None]}
    return (
        [("Conv", ["x", "w"], ["c"], {}), ("Div", ["c", "d"], ["y"], {})],
        (2, 3, 6, 6),
        inits,
        "y",
    )


def _constant_over_layer(rng):
    inits = {"w": _normal(rng, 4, 3, 3, 3), "d": rng.uniform(1, 2, (4, 1, 1)).astype(np.float32)}
    return (
        [("Conv", ["x", "w"], ["c"], {}), ("Div", ["d", "c"], ["y"], {})],
        (2, 3, 6, 6),
        inits,
        "y",
    )


def _bn_gemm_trans_a(rng):
    inits = {"w": _normal(rng, 4, 3), **_stats(rng, "bn", 3)}
    nodes = [_bn("x", "n"), ("Gemm", ["n", "w"], ["y"], {"transA": 1})]
    return nodes, (4, 3), inits, "n"


# name -> (builder, code)
REFUSALS: dict[str, tuple[Callable, Code]] = {
    "training_mode": (_training_mode, Code.TRAINING_MODE),
    "bn_then_padded_conv": (_bn_padded_conv, Code.PADDED_CONV),
    "bn_output_read_twice": (_bn_read_twice, Code.SHARED_OUTPUT),
    "conv_output_read_twice": (_conv_read_twice, Code.SHARED_OUTPUT),
    "channel_mismatch": (_channel_mismatch, Code.CHANNEL_MISMATCH),
    "maxpool_negative_scale_after": (_maxpool_negative_scale_after, Code.MAXPOOL_NEGATIVE_SCALE),
    "maxpool_negative_scale_before": (_maxpool_negative_scale_before, Code.MAXPOOL_NEGATIVE_SCALE),
    "stats_not_constant": (_stats_not_constant, Code.NOT_CONSTANT),
    "after_relu": (_after_relu, Code.NO_LINEAR_LAYER),
    "zero_divisor": (_zero_divisor, Code.ZERO_DIVISOR),
    "constant_over_layer": (_constant_over_layer, Code.NOT_AFFINE),
    "bn_then_gemm_trans_a": (_bn_gemm_trans_a, Code.GEMM_TRANS_A),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refuses(name, rng):
    builder, code = REFUSALS[name]
    nodes, shape, inits, anchor = builder(rng)
    inputs = {"x": (F, shape)}
    if name == "stats_not_constant":
        inputs["bn_mean"] = (F, (4,))
    model = make_model(nodes, inputs, {"y": (F, None)}, inits, opset=15)
    proto = _proto(model)

    report, modified = _fold(model)

    assert not modified
    assert report.fused == []
    assert [(r.node, r.code) for r in report.refused] == [(anchor, code)], report.refused
    assert _proto(model) == proto


def test_refusal_names_the_channel_and_both_layers(rng):
    """A detail says what a user needs: here the channel with the negative scale."""
    nodes, shape, inits, _ = _maxpool_negative_scale_after(rng)
    (refusal,) = _fold(_build(nodes, shape, inits))[0].refused
    assert "MaxPool 'p'" in refusal.detail and "channel 1" in refusal.detail
    nodes, shape, inits, _ = _bn_padded_conv(rng)
    (refusal,) = _fold(_build(nodes, shape, inits))[0].refused
    assert refusal.detail.startswith("input 'x' is a graph input")
    assert "; and it cannot fold into the layer after it: the Conv after it pads" in refusal.detail
