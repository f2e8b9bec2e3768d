"""FoldBatchNorm on hand-built ONNX graphs (no PyTorch export): what folds, what is refused
with which code, and ONNX Runtime numerics before vs after every fold; the graphs written with
``onnx.helper`` (opsets 9 to 15, Gemm's attributes, layers with no bias input) are also held to
a float64 reference (numpy; PyTorch's convolutions for the layers with no bias input).

Every BatchNorm statistic is random (running mean, variance in [0.5, 2], gamma, beta), and so
is every weight and bias. The nodes of :func:`graphs.make_model` are unnamed, so the report
names them by their first output. The exporter-based cases are in test_fold_batchnorm.py (slow).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusion import Code
from fusion.base import FusionReport
from tests.support.folding import assert_close_folded, assert_second_run_is_noop, fold
from tests.support.graphs import assert_close, cpu_session, make_model, ops, run
from tests.support.norm_graphs import Graph

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


def _gemm_bn(trans_b: int, c_shape: tuple[int, ...] | None = (6,)):
    """``Gemm(alpha=0.5, beta=2)`` then BatchNorm: the fold must scale ``alpha * A @ B`` and
    ``beta * C`` alike (``c_shape`` None: no C at all, where beta multiplies nothing)."""

    def build(rng):
        w = _normal(rng, 5, 6)
        inits = {"w": w.T.copy() if trans_b else w, **_stats(rng, "bn", 6)}
        inputs = ["x", "w"]
        if c_shape is not None:
            inits["bias"] = _normal(rng, *c_shape)
            inputs.append("bias")
        attrs = {"alpha": 0.5, "beta": 2.0, "transB": trans_b}
        nodes = [("Gemm", inputs, ["g"], attrs), _bn("g", "y")]
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


def _conv_pool_bn(pool: str):
    """Conv -> global mean pooling -> BatchNorm1d: the map moves back across the mean."""

    def build(rng):
        inits = {"w": _normal(rng, 4, 3, 3, 3), "b": _normal(rng, 4), **_stats(rng, "bn", 4)}
        if pool == "GlobalAveragePool":
            nodes = [("GlobalAveragePool", ["c"], ["p"], {}), ("Flatten", ["p"], ["f"], {})]
        else:
            nodes = [("ReduceMean", ["c"], ["f"], {"axes": [2, 3], "keepdims": 0})]
        nodes = [("Conv", ["x", "w", "b"], ["c"], {}), *nodes, _bn("f", "y")]
        return nodes, (2, 3, 6, 6), inits, [n[0] for n in nodes[:-1]], "c"

    return build


def _scaled_chain(*steps: tuple[str, tuple[int, ...]]):
    """Conv (bias input) then constant ops ``(op, constant shape)``: a layer scale
    (``("Mul", (1, 4, 1, 1))``), a FrozenBatchNorm (Mul then Add), a BatchNorm by hand..."""

    def build(rng):
        inits = {"w": _normal(rng, 4, 3, 3, 3), "b": _normal(rng, 4)}
        nodes, value = [("Conv", ["x", "w", "b"], ["c"], {})], "c"
        for i, (op, shape) in enumerate(steps):
            inits[f"k{i}"] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            if op == "BatchNormalization":
                inits |= _stats(rng, "bn", 4)
                nodes.append(_bn(value, f"v{i}"))
            else:
                nodes.append((op, [value, f"k{i}"], [f"v{i}"], {}))
            value = f"v{i}"
        nodes.append(("Identity", [value], ["y"], {}))
        return nodes, (2, 3, 6, 6), inits, ["Conv", "Identity"], "c"

    return build


def _matmul_layer_scale(rng):
    """ConvNeXt's block end: ``gamma * pwconv2(x)``, a Linear (MatMul + bias Add) then a
    per-channel Mul."""
    inits = {"w": _normal(rng, 5, 6), "b": _normal(rng, 6)}
    inits["gamma"] = rng.uniform(-1, 1, 6).astype(np.float32)
    nodes = [
        ("MatMul", ["x", "w"], ["mm"], {}),
        ("Add", ["mm", "b"], ["lin"], {}),
        ("Mul", ["gamma", "lin"], ["y"], {}),
    ]
    return nodes, (2, 3, 5), inits, ["MatMul", "Add"], "mm"


C1 = (1, 4, 1, 1)  # a per-channel constant on a Conv output

# name -> (builder, counts)
FOLDS: dict[str, tuple[Callable, dict]] = {
    "conv_bn": (_conv_bn, {"batchnorm_folded": 1}),
    "grouped_conv_nobias_bn": (_grouped_conv_nobias_bn, {"batchnorm_folded": 1}),
    "convtranspose_bn": (_convtranspose_bn, {"batchnorm_folded": 1}),
    "gemm_transB0_bn": (_gemm_bn(0), {"batchnorm_folded": 1}),
    "gemm_transB1_bn": (_gemm_bn(1), {"batchnorm_folded": 1}),
    "gemm_transB0_noC_bn": (_gemm_bn(0, None), {"batchnorm_folded": 1}),
    "gemm_transB1_noC_bn": (_gemm_bn(1, None), {"batchnorm_folded": 1}),
    "gemm_transB1_rowC_bn": (_gemm_bn(1, (1, 6)), {"batchnorm_folded": 1}),
    "gemm_transB0_scalarC_bn": (_gemm_bn(0, ()), {"batchnorm_folded": 1}),
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
    "conv_gap_flatten_bn": (_conv_pool_bn("GlobalAveragePool"), {"batchnorm_folded": 1}),
    "conv_reducemean_bn": (_conv_pool_bn("ReduceMean"), {"batchnorm_folded": 1}),
    # Counting: a per-channel scale alone is a layer scale, not a BatchNorm.
    "conv_layer_scale": (_scaled_chain(("Mul", C1)), {"affine_folded": 1}),
    "conv_bias_add_layer_scale": (_scaled_chain(("Add", C1), ("Mul", C1)), {"affine_folded": 1}),
    "matmul_layer_scale": (_matmul_layer_scale, {"affine_folded": 1}),
    "conv_frozen_bn": (_scaled_chain(("Mul", C1), ("Add", C1)), {"batchnorm_folded": 1}),
    "conv_centered_scaled": (_scaled_chain(("Sub", C1), ("Div", C1)), {"batchnorm_folded": 1}),
    "conv_layer_scale_bn": (
        _scaled_chain(("Mul", C1), ("BatchNormalization", ())),
        {"batchnorm_folded": 1},
    ),
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

    report, modified = fold(model)

    assert modified
    assert dict(report.counts) == counts
    assert report.refused == []
    assert [f.node for f in report.fused] == [anchor]
    assert ops(model) == ops_left
    assert [v.name for v in model.graph.outputs] == ["y"]
    assert_close(run(model, feeds), before)
    proto = _proto(model)
    assert fold(model)[1] is False and _proto(model) == proto  # a second run changes nothing


def test_fold_across_ops_says_so(rng):
    nodes, shape, inits, _, _ = _matmul_transpose_bn(rng)
    report, _ = fold(_build(nodes, shape, inits))
    assert report.fused[0].became == "folded into MatMul 'mm' across Transpose"
    nodes, shape, inits, _, _ = _bn_maxpool_transpose_reshape_gemm(rng)
    report, _ = fold(_build(nodes, shape, inits))
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


def _mean_over_channels_then_per_channel_mul(rng):
    """``conv(x).mean(1, keepdim=True) * c`` with ``c`` (1, C, 1, 1): the Mul broadcasts the
    mean back up to C channels, which is no per-channel map of the conv output."""
    inits = {"w": _normal(rng, 4, 3, 3, 3), "k": rng.uniform(0.5, 1.5, (1, 4, 1, 1))}
    nodes = [
        ("Conv", ["x", "w"], ["c"], {}),
        ("ReduceMean", ["c"], ["m"], {"axes": [1], "keepdims": 1}),
        ("Mul", ["m", "k"], ["y"], {}),
    ]
    inits["k"] = inits["k"].astype(np.float32)
    return nodes, (2, 3, 6, 6), inits, "y"


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
    "mean_over_channels_then_per_channel_mul": (
        _mean_over_channels_then_per_channel_mul,
        Code.BROADCAST_CHANGES_SHAPE,
    ),
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

    report, modified = fold(model)

    assert not modified
    assert report.fused == []
    assert [(r.node, r.code) for r in report.refused] == [(anchor, code)], report.refused
    assert _proto(model) == proto


def test_refusal_names_the_channel_and_both_layers(rng):
    """A detail says what a user needs: here the channel with the negative scale."""
    nodes, shape, inits, _ = _maxpool_negative_scale_after(rng)
    (refusal,) = fold(_build(nodes, shape, inits))[0].refused
    assert "MaxPool 'p'" in refusal.detail and "channel 1" in refusal.detail
    nodes, shape, inits, _ = _bn_padded_conv(rng)
    (refusal,) = fold(_build(nodes, shape, inits))[0].refused
    assert refusal.detail.startswith("input 'x' is a graph input")
    assert "; and it cannot fold into the layer after it: the Conv after it pads" in refusal.detail


def _patch_embedding(rng, scaled: bool):
    """A ViT's (SAM's) patch embedding: ``conv(x).permute(0, 2, 3, 1) + pos``, ``pos`` of shape
    (1, H, W, C): no per-channel shift; ``scaled``: after a per-channel scale of the Conv output
    (``gamma * conv(x)``), where it may be the shift of a BatchNorm written by hand."""
    inits = {"w": _normal(rng, 4, 3, 2, 2), "b": _normal(rng, 4), "pos": _normal(rng, 1, 3, 3, 4)}
    nodes = [("Conv", ["x", "w", "b"], ["c"], {"strides": [2, 2]})]
    if scaled:
        inits["gamma"] = rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32)
        nodes.append(("Mul", ["c", "gamma"], ["s"], {}))
    nodes += [
        ("Transpose", ["s" if scaled else "c"], ["t"], {"perm": [0, 2, 3, 1]}),
        ("Add", ["t", "pos"], ["y"], {}),
    ]
    return _build(nodes, (2, 3, 6, 6), inits)


@pytest.mark.parametrize("scaled", [False, True], ids=["shift_alone", "after_a_scale"])
def test_a_shift_alone_is_no_candidate(scaled, rng):
    """A constant Add that does not fold is refused only after a scale: alone it is a bias or
    an embedding (a shift alone is no fold either), no BatchNorm, and nothing is said of it."""
    model = _patch_embedding(rng, scaled)
    feeds = {"x": _normal(rng, 2, 3, 6, 6)}
    before = run(model, feeds)
    report, modified = fold(model)
    assert modified is scaled
    assert dict(report.counts) == ({"affine_folded": 1} if scaled else {})
    codes = [(r.node, r.code) for r in report.refused]
    assert codes == ([("y", Code.NOT_PER_CHANNEL)] if scaled else [])
    assert_close(run(model, feeds), before)


# ---- BatchNorm into the head: residual Add -> BN -> global pooling -> classifier(s) ----

HEAD_INPUT = (2, 4, 5, 5)


def _tail(rng, opset: int, positive: bool = False) -> Graph:
    """A ResNet's last block output: ``conv(x) + x``, then a BatchNorm (randomized)."""
    g = Graph(opset)
    g.const("wc", _normal(rng, 4, 4, 1, 1))
    g.const("bc", _normal(rng, 4))
    g.node("Conv", ["x", "wc", "bc"], "c")
    g.node("Add", ["c", "x"], "r")
    g.nodes.append(_bn("r", "n"))
    g.constants |= _stats(rng, "bn", 4, positive)
    return g


def _pool(g: Graph, how: str) -> str:
    """Global pooling of the BatchNorm output ``n`` to ``(N, C)`` (or what ``how`` says)."""
    if how == "reducemean_keepdims0":
        return g.reduce("ReduceMean", "n", "p", [2, 3], keepdims=0)
    if how == "reducemean_keepdims1_flatten":
        return g.node("Flatten", [g.reduce("ReduceMean", "n", "m", [2, 3])], "p")
    if how == "reducemean_negative_axes_squeeze":
        g.reduce("ReduceMean", "n", "m", [-1, -2])
        return g.node("Squeeze", ["m", g.const("sq", np.array([2, 3]))], "p")
    if how == "globalaveragepool_flatten":
        return g.node("Flatten", [g.node("GlobalAveragePool", ["n"], "m")], "p")
    if how == "globalaveragepool_reshape":
        shape = g.const("shape", np.array([0, -1]))
        return g.node("Reshape", [g.node("GlobalAveragePool", ["n"], "m"), shape], "p")
    if how == "globalmaxpool_flatten":
        return g.node("Flatten", [g.node("GlobalMaxPool", ["n"], "m")], "p")
    assert how == "reducemax_keepdims0"
    return g.reduce("ReduceMax", "n", "p", [2, 3], keepdims=0)


def _head(g: Graph, rng, how: str, x: str, out: str) -> list[str]:
    """A classifier from 4 features to 3 reading ``x``; returns its op types."""
    if how == "gemm_transB1":  # nn.Linear, with alpha and beta not 1
        g.const(f"{out}_w", _normal(rng, 3, 4))
        g.const(f"{out}_b", _normal(rng, 3))
        attrs = {"transB": 1, "alpha": 0.5, "beta": 2.0}
        g.node("Gemm", [x, f"{out}_w", f"{out}_b"], out, **attrs)
        return ["Gemm"]
    if how == "gemm_transB0_noC":
        g.node("Gemm", [x, g.const(f"{out}_w", _normal(rng, 4, 3))], out, alpha=0.5)
        return ["Gemm"]
    assert how == "matmul_add"
    g.node("MatMul", [x, g.const(f"{out}_w", _normal(rng, 4, 3))], f"{out}_mm")
    g.node("Add", [f"{out}_mm", g.const(f"{out}_b", _normal(rng, 3))], out)
    return ["MatMul", "Add"]


POOL_OPS = {
    "reducemean_keepdims0": ["ReduceMean"],
    "reducemean_keepdims1_flatten": ["ReduceMean", "Flatten"],
    "reducemean_negative_axes_squeeze": ["ReduceMean", "Squeeze"],
    "globalaveragepool_flatten": ["GlobalAveragePool", "Flatten"],
    "globalaveragepool_reshape": ["GlobalAveragePool", "Reshape"],
    "globalmaxpool_flatten": ["GlobalMaxPool", "Flatten"],
    "reducemax_keepdims0": ["ReduceMax"],
}
HEAD_CASES = [
    (pool, head)
    for pool in POOL_OPS
    for head in ("gemm_transB1", "gemm_transB0_noC", "matmul_add")
    if head == "gemm_transB1" or pool in ("reducemean_keepdims0", "globalaveragepool_flatten")
]


def _fold_and_compare(rng, model: ir.Model) -> FusionReport:
    """Fold ``model``; its outputs must be those of the unfolded model; a second run is a no-op."""
    feeds = {"x": _normal(rng, *HEAD_INPUT)}
    before = run(model, feeds)
    report, modified = fold(model)
    assert modified, report.refused
    assert_close(run(model, feeds), before)
    proto = _proto(model)
    assert fold(model)[1] is False and _proto(model) == proto
    return report


@pytest.mark.parametrize("opset", [13, 18])  # ReduceMean axes: an attribute, an input
@pytest.mark.parametrize(("pool", "head"), HEAD_CASES)
def test_folds_into_head_across_global_pooling(pool, head, opset, rng):
    g = _tail(rng, opset, positive=pool in ("globalmaxpool_flatten", "reducemax_keepdims0"))
    head_ops = _head(g, rng, head, _pool(g, pool), "y")
    model = g.model({"x": (F, HEAD_INPUT)}, {"y": (F, None)})

    report = _fold_and_compare(rng, model)

    assert dict(report.counts) == {"batchnorm_folded": 1} and report.refused == []
    (fold,) = report.fused
    layer = f"{head_ops[0]} '{'y_mm' if head == 'matmul_add' else 'y'}'"
    assert (fold.node, fold.became) == (
        "n",
        f"folded into the following {layer} across {', '.join(POOL_OPS[pool])}",
    )
    assert ops(model) == ["Conv", "Add", *POOL_OPS[pool], *head_ops]


@pytest.mark.parametrize("pool", ["reducemean_keepdims0", "globalaveragepool_flatten"])
def test_folds_into_two_heads(pool, rng):
    """Two classifiers read the pooled features: the BatchNorm folds into both."""
    g = _tail(rng, 18)
    pooled = _pool(g, pool)
    ops_left = _head(g, rng, "gemm_transB1", pooled, "y") + _head(g, rng, "matmul_add", pooled, "z")
    model = g.model({"x": (F, HEAD_INPUT)}, {"y": (F, None), "z": (F, None)})

    report = _fold_and_compare(rng, model)

    assert dict(report.counts) == {"batchnorm_folded": 1} and report.refused == []
    across = ", ".join(POOL_OPS[pool])
    assert report.fused[0].became == (
        f"folded into the following Gemm 'y' across {across}; MatMul 'z_mm' across {across}"
    )
    assert ops(model) == ["Conv", "Add", *POOL_OPS[pool], *ops_left]


def _pooled_also_output(rng, g: Graph) -> dict:
    _head(g, rng, "gemm_transB1", _pool(g, "reducemean_keepdims0"), "y")
    return {"y": (F, None), "p": (F, None)}


def _pooled_also_relu(rng, g: Graph) -> dict:
    _head(g, rng, "gemm_transB1", _pool(g, "globalaveragepool_flatten"), "y")
    g.node("Relu", ["p"], "z")
    return {"y": (F, None), "z": (F, None)}


def _mean_over_channels(rng, g: Graph) -> dict:
    """``x.mean(1)``: (N, H, W), then a MatMul over W."""
    g.reduce("ReduceMean", "n", "p", [1], keepdims=0)
    g.node("MatMul", ["p", g.const("w", _normal(rng, 5, 3))], "y")
    return {"y": (F, None)}


def _mean_over_one_spatial_axis(rng, g: Graph) -> dict:
    """``x.mean(2)``: (N, C, W), then a MatMul over W: the channels are not its features."""
    g.reduce("ReduceMean", "n", "p", [2], keepdims=0)
    g.node("MatMul", ["p", g.const("w", _normal(rng, 5, 3))], "y")
    return {"y": (F, None)}


def _max_negative_scale(rng, g: Graph) -> dict:
    g.constants["bn_scale"][2] = -0.5
    _head(g, rng, "gemm_transB1", _pool(g, "globalmaxpool_flatten"), "y")
    return {"y": (F, None)}


def _second_head_padded(rng, g: Graph) -> dict:
    """Two heads on the pooled (N, C, 1, 1): a 1x1 Conv, and a padded 3x3 Conv."""
    g.node("GlobalAveragePool", ["n"], "p")
    g.node("Conv", ["p", g.const("w1", _normal(rng, 3, 4, 1, 1))], "y")
    g.node("Conv", ["p", g.const("w3", _normal(rng, 3, 4, 3, 3))], "z", pads=[1, 1, 1, 1])
    return {"y": (F, None), "z": (F, None)}


# name -> (builder, code, a fragment of the detail)
HEAD_REFUSALS = {
    "pooled_also_graph_output": (_pooled_also_output, Code.SHARED_OUTPUT, "also a graph output"),
    "pooled_also_read_by_relu": (_pooled_also_relu, Code.SHARED_OUTPUT, "Relu 'z' cannot absorb"),
    "mean_over_channels": (_mean_over_channels, Code.POOLS_OVER_CHANNELS, "reduces axis 1"),
    "mean_over_one_spatial_axis": (
        _mean_over_one_spatial_axis,
        Code.WRONG_CHANNEL_AXIS,
        "along axis 1",
    ),
    "globalmaxpool_negative_scale": (
        _max_negative_scale,
        Code.MAXPOOL_NEGATIVE_SCALE,
        "channel 2 has scale",
    ),
    "second_head_padded": (_second_head_padded, Code.PADDED_CONV, "2 layers it reaches, Conv 'z'"),
}


@pytest.mark.parametrize("name", list(HEAD_REFUSALS))
def test_refuses_head_fold(name, rng):
    builder, code, fragment = HEAD_REFUSALS[name]
    g = _tail(rng, 18, positive=True)
    outputs = builder(rng, g)
    model = g.model({"x": (F, HEAD_INPUT)}, outputs)
    proto = _proto(model)

    report, modified = fold(model)

    assert not modified and report.fused == []
    assert [(r.node, r.code) for r in report.refused] == [("n", code)], report.refused
    assert fragment in report.refused[0].detail, report.refused[0].detail
    assert _proto(model) == proto


# ---- ONNX protos by onnx.helper: opsets, Gemm attributes, layers with no bias input ----


def _bn_params(rng: np.random.Generator, c: int) -> list[np.ndarray]:
    return [
        rng.uniform(-2, 2, c).astype(np.float32),  # scale
        rng.uniform(-1, 1, c).astype(np.float32),  # B
        rng.uniform(-1, 1, c).astype(np.float32),  # input_mean
        rng.uniform(0.3, 3.0, c).astype(np.float32),  # input_var
    ]


def _bn_ref(x: np.ndarray, params: list[np.ndarray], eps: float, axis: int = 1) -> np.ndarray:
    scale, bias, mean, var = (p.astype(np.float64) for p in params)
    shape = [1] * x.ndim
    shape[axis] = -1
    s, t = scale / np.sqrt(var + eps), bias - mean * scale / np.sqrt(var + eps)
    return x * s.reshape(shape) + t.reshape(shape)


def _bn_node(inp: str, out: str, opset: int, eps: float, **attrs) -> onnx.NodeProto:
    names = [f"{out}_{p}" for p in ("scale", "B", "mean", "var")]
    return helper.make_node(
        "BatchNormalization", [inp, *names], [out], name=f"bn_{out}", epsilon=eps, **attrs
    )


def _bn_inits(out: str, params: list[np.ndarray]) -> list[onnx.TensorProto]:
    names = [f"{out}_{p}" for p in ("scale", "B", "mean", "var")]
    return [numpy_helper.from_array(a, n) for a, n in zip(params, names, strict=True)]


def _model(nodes, inits, x_shape, y_shape, opset: int) -> ir.Model:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape or [None] * len(x_shape))],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(proto, full_check=True)
    return ir.from_proto(proto)


def _check_fold(model, x, reference, folded: int, gone: str) -> None:
    feeds = {"x": x}
    unfolded = cpu_session(model).run(None, feeds)[0]
    assert_close_folded(unfolded, reference.astype(np.float32))
    report, modified = fold(model)
    assert modified
    assert report.counts["batchnorm_folded"] == folded
    assert report.refused == []
    assert gone not in ops(model), ops(model)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    result = cpu_session(model).run(None, feeds)[0]
    assert_close_folded(result, reference)
    assert_close_folded(result, unfolded)
    assert_second_run_is_noop(model)


@pytest.mark.parametrize("opset", [9, 14, 15])
def test_folds_matmul_add_batchnorm_across_opsets(opset):
    rng = np.random.default_rng(opset)
    w = rng.normal(size=(5, 6)).astype(np.float32)
    b = rng.normal(size=6).astype(np.float32)
    params = _bn_params(rng, 6)
    attrs = {"training_mode": 0} if opset >= 14 else {}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "b"], ["lin"], name="add"),
        _bn_node("lin", "y", opset, 1e-3, **attrs),
    ]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    model = _model(nodes, inits + _bn_inits("y", params), [3, 5], [3, 6], opset)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    reference = _bn_ref(x.astype(np.float64) @ w + b, params, 1e-3)
    _check_fold(model, x, reference, folded=1, gone="BatchNormalization")
    assert ops(model) == ["MatMul", "Add"]


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (6,), (3, 6)])
def test_folds_gemm_with_alpha_beta_and_trans_b(trans_b, c_shape):
    rng = np.random.default_rng(7)
    w = rng.normal(size=(5, 6)).astype(np.float32)  # (K, N)
    params = _bn_params(rng, 6)
    inputs = ["x", "w"] + (["c"] if c_shape else [])
    nodes = [
        helper.make_node("Gemm", inputs, ["g"], alpha=0.7, beta=1.3, transB=trans_b, name="g"),
        _bn_node("g", "y", 15, 1e-5),
    ]
    inits = [numpy_helper.from_array(w.T.copy() if trans_b else w, "w")]
    c = rng.normal(size=c_shape).astype(np.float32) if c_shape else np.float32(0)
    if c_shape:
        inits.append(numpy_helper.from_array(c, "c"))
    model = _model(nodes, inits + _bn_inits("y", params), [3, 5], [3, 6], 15)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    linear = 0.7 * x.astype(np.float64) @ w + 1.3 * c.astype(np.float64)
    _check_fold(model, x, _bn_ref(linear, params, 1e-5), folded=1, gone="BatchNormalization")


def test_folds_batchnorm_before_matmul():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(5, 4)).astype(np.float32)
    params = _bn_params(rng, 5)
    nodes = [
        _bn_node("x", "n", 15, 1e-5),
        helper.make_node("MatMul", ["n", "w"], ["y"], name="mm"),
    ]
    inits = [numpy_helper.from_array(w, "w"), *_bn_inits("n", params)]
    model = _model(nodes, inits, [3, 5], [3, 4], 15)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    reference = _bn_ref(x.astype(np.float64), params, 1e-5) @ w
    _check_fold(model, x, reference, folded=1, gone="BatchNormalization")


def _conv_then(op_nodes, inits, opset: int = 15) -> ir.Model:
    rng = np.random.default_rng(5)
    w = rng.normal(size=(4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), *op_nodes]
    return _model(nodes, [numpy_helper.from_array(w, "w"), *inits], [1, 3, 5, 5], None, opset)


@pytest.mark.parametrize(
    ("op", "w_shape", "group", "x_shape"),
    [
        ("Conv", (4, 2, 3), 1, (2, 2, 7)),
        ("Conv", (4, 1, 2, 2, 2), 2, (1, 2, 4, 4, 4)),
        ("ConvTranspose", (4, 3, 3, 3), 2, (1, 4, 4, 4)),
    ],
)
def test_folds_into_layer_without_bias_input(op, w_shape, group, x_shape):
    """No bias input at all (the dynamo exporter always writes one): the fold must create it."""
    rng = np.random.default_rng(11)
    w = rng.normal(size=w_shape).astype(np.float32)
    channels = w_shape[0] if op == "Conv" else w_shape[1] * group
    params = _bn_params(rng, channels)
    nodes = [
        helper.make_node(op, ["x", "w"], ["lin"], group=group, name="lin"),
        _bn_node("lin", "y", 15, 1e-4),
    ]
    model = _model(
        nodes, [numpy_helper.from_array(w, "w"), *_bn_inits("y", params)], x_shape, None, 15
    )
    x = rng.normal(size=x_shape).astype(np.float32)
    import torch  # the float64 reference of the convolutions (nothing is exported)

    conv = getattr(
        torch.nn.functional, f"conv{'_transpose' if op != 'Conv' else ''}{len(w_shape) - 2}d"
    )
    linear = conv(torch.from_numpy(x).double(), torch.from_numpy(w).double(), groups=group).numpy()
    _check_fold(model, x, _bn_ref(linear, params, 1e-4), folded=1, gone="BatchNormalization")
    assert len(list(model.graph)[0].inputs) == 3


def test_refuses_division_by_constant_with_zero():
    d = np.array([1.0, 0.0, 2.0, 3.0], np.float32).reshape(1, 4, 1, 1)
    node = helper.make_node("Div", ["c", "d"], ["y"], name="div")
    model = _conv_then([node], [numpy_helper.from_array(d, "d")])
    report, modified = fold(model)
    assert not modified
    assert [(r.node, r.code) for r in report.refused] == [("div", Code.ZERO_DIVISOR)]
    assert ops(model) == ["Conv", "Div"]


def test_refuses_training_mode_batchnorm():
    params = _bn_params(np.random.default_rng(0), 4)
    node = _bn_node("c", "y", 15, 1e-5, training_mode=1)
    node.output.extend(["running_mean", "running_var"])  # unused, as the spec requires
    model = _conv_then([node], _bn_inits("y", params))
    report, modified = fold(model)
    assert not modified
    assert [(r.node, r.code) for r in report.refused] == [("bn_y", Code.TRAINING_MODE)]
    assert report.refused[0].detail.startswith("training_mode=1")
    assert "BatchNormalization" in ops(model)


def test_refuses_batchnorm_on_axis_1_of_rank_3_matmul():
    rng = np.random.default_rng(1)
    params = _bn_params(rng, 2)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        _bn_node("mm", "y", 15, 1e-5),
    ]
    w = numpy_helper.from_array(rng.normal(size=(5, 6)).astype(np.float32), "w")
    model = _model(nodes, [w, *_bn_inits("y", params)], [3, 2, 5], [3, 2, 6], 15)
    report, modified = fold(model)
    assert not modified
    assert [(r.node, r.code) for r in report.refused] == [("bn_y", Code.WRONG_CHANNEL_AXIS)]
    assert "has its channels on axis 2" in report.refused[0].detail


def test_refuses_reshape_with_unknown_shape():
    """A reshape to a shape fed at run time: where the channels go cannot be told."""
    rng = np.random.default_rng(4)
    params = _bn_params(rng, 6)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Reshape", ["mm", "shape"], ["flat"], name="flatten"),
        _bn_node("flat", "y", 15, 1e-5),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.normal(size=(5, 6)).astype(np.float32), "w")]
        + _bn_inits("y", params),
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    model = ir.from_proto(proto)
    x = rng.normal(size=(2, 3, 5)).astype(np.float32)
    feeds = {"x": x, "shape": np.array([-1, 6])}
    expected = cpu_session(model).run(None, feeds)[0]
    before = ir.to_proto(model).SerializeToString()
    report, modified = fold(model)
    assert not modified
    assert ir.to_proto(model).SerializeToString() == before
    (refusal,) = report.refused
    assert (refusal.node, refusal.code) == ("bn_y", Code.CHANNELS_REGROUPED)
    assert "Reshape 'flatten' from (2, 3, 6) to (" in refusal.detail
    assert_close_folded(cpu_session(model).run(None, feeds)[0], expected)
