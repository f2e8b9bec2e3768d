"""fusion.optimize on ONNX Runtime's own graph-transformer test models (``tests/data/ort/``,
:mod:`tests.support.peer`).

The models and what ONNX Runtime's C++ tests expect of each are in
``tests/data/ort/expectations.json``.
For every model: optimize (``target="ort"``; ``skip=True`` for the SkipLayerNormFusion group),
run the full checker (:func:`fusion.check`), compare the targeted op counts with ORT's
expectation, and run the original file and the optimized model on ONNX Runtime's CPU provider
with its own graph optimizations disabled, on seeded random inputs.

Where these passes and ORT's fusion disagree, the case is named below with the reason, and the
reason is found in the report: a pattern ORT fuses that is not exactly one op (exactness is the
rule here), or one ORT refuses for reasons of its own that the passes fuse exactly (the parity
run proves it). The graph-level tests at the end build small models with onnx.helper.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion.cleanup import cleanup
from fusion.graph import const_array
from tests.support.graphs import cpu_session
from tests.support.peer import ORT as PEER
from tests.support.peer import UNRUNNABLE

EXPECTATIONS = PEER / "expectations.json"

#: The op whose count tells fused from unfused, per expectations.json group.
TARGET_OP = {
    "LayerNormFusion": "LayerNormalization",
    "SimplifiedLayerNormFusion (RMSNorm)": "SimplifiedLayerNormalization",
    "SkipLayerNormFusion": "SkipLayerNormalization",
    "ConvBNFusion": "BatchNormalization",
    "MatmulBNFusion": "BatchNormalization",
}

#: Positive cases (ORT fuses) that the passes leave unfused or fuse differently: case ->
#: a piece of the report (a refusal reason or what a fusion became) that says why.
ACCEPTED_UNFUSED = {
    # x - mean(x) is computed in float16 and only then cast to float32; the float32 part is an
    # RMSNorm of that rounded difference. SimplifiedLayerNormalization on it is exact; a
    # LayerNormalization would center in float32, a different function (ORT's choice).
    "layer_norm_fusion_scale_bias.onnx": "SimplifiedLayerNormalization",
    # BatchNormalization with 5 channels on an input whose axis 1 has size 1: not a valid node,
    # and ORT stops with "Invalid input scale" when it runs the original. Nothing to be exact to.
    "fuse-matmul-bn-only-reshape.onnx": "not a valid BatchNormalization",
    "fuse-matmul-bn-only-transpose.onnx": "not a valid BatchNormalization",
    # The residual Add is in float16 and a Cast to float32 comes before the norm: ORT moves the
    # Casts before the Add, which then adds in float32 and rounds differently. The norm itself is
    # fused (LayerNormalization); only the Skip fusion is refused.
    **dict.fromkeys(
        [
            "skip_layer_norm_format1_with_cast.onnx",
            "skip_layer_norm_format2_with_cast.onnx",
            "skip_layer_norm_format3_with_cast.onnx",
            "skip_layer_norm_format1_partial_with_cast.onnx",
            "skip_layer_norm_format2_partial_with_cast.onnx",
            "skip_layer_norm_format1_graph_output_with_cast.onnx",
            "skip_layer_norm_format2_graph_output_with_cast.onnx",
            "skip_layer_norm_input_output_with_cast_check.onnx",
        ],
        "lies between the residual Add and the norm: the Add rounds its sum to FLOAT16",
    ),
    # Add in float16, LayerNormalization with a float32 scale and float32 output (ORT's mixed-type
    # form): the Skip op takes one type for all of them, so it needs Casts that round differently.
    "skip_layer_norm_no_beta_with_cast.onnx": "not the data type FLOAT16",
}

#: Negative cases (ORT does not fuse) that the passes fuse exactly: case -> why ORT refuses,
#: and a piece of the report that shows the fusion. The parity run is the proof.
ACCEPTED_FUSED = {
    # An Identity between MatMul and BatchNormalization: ORT's pattern does not look through it;
    # the affine map moves across an Identity unchanged.
    "fuse-matmul-bn-non-ignorable-node.onnx": "folded into MatMul",
    # ReduceMean with no axes reduces all axes: ORT's pattern wants the last axis; a
    # LayerNormalization with axis=-3 normalizes all three axes, the same function.
    "layer_norm_sub_dup.onnx": "LayerNormalization",
    # x - mean(x) goes through a Cast to float32 of a float32 value (a no-op) before the square.
    # ORT's inference build leaves the pattern alone (its training build fuses it); the fused
    # node computes the same function.
    "layer_norm_with_cast.onnx": "LayerNormalization",
    # ORT leaves the float16 round trip alone on its CPU provider, for its kernels' sake (the
    # CUDA variant of its test fuses). Cast to float32, RMS-normalize, Cast back, then the
    # float16 weight: SimplifiedLayerNormalization on the float16 input computes just that.
    "simplified_layer_norm_with_casts.onnx": "SimplifiedLayerNormalization",
    # The sum is also read by a Neg whose output nothing reads: dead code, which the clean-up
    # removes first; the sum then has one reader, the norm.
    "skip_layer_norm_format3_no_fusion.onnx": "SkipLayerNormalization",
    # The sum is also a graph output: ORT's fusion does not use the Skip op's output 3
    # (input_skip_bias_sum); the passes give that output to the graph output.
    "skip_layer_norm_format3_graph_output.onnx": "with the sum as output 3",
}

#: Input files that fail onnx.checker's full check themselves (their declared output shapes
#: contradict shape inference): fusion.check fails on the optimized model for the same reason,
#: and nothing the fusion passes did. Case -> the op type the checker names.
INVALID_FILES = {
    "fuse-conv-bn-mul-add-unsqueeze.onnx": "Flatten",  # output declared rank 4, Flatten gives 2
    "fuse-conv-bn-mul-add-unsqueeze.negative_axes.onnx": "Flatten",
    "fuse-matmul-bn-directly-dont-fuse.onnx": "BatchNormalization",  # declared (1, 5), is 3-D
}

CASES = {case["model"]: case for case in json.loads(EXPECTATIONS.read_text())["models"]}
SYMBOLIC_DIM = 4  # every symbolic dimension (layer_norm.onnx: X (?, ?), Scale (?), B (?))
_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def model_path(name: str) -> Path:
    """``stem.onnx#variant`` lives at ``variants/stem.variant.onnx``."""
    if "#" not in name:
        return PEER / name
    stem, variant = name.split("#")
    return PEER / "variants" / f"{stem.removesuffix('.onnx')}.{variant}.onnx"


def optimized(name: str) -> tuple[ir.Model, fusion.FusionReport]:
    model = ir.load(model_path(name))
    skip = CASES[name]["group"] == "SkipLayerNormFusion"
    return model, fusion.optimize(model, target="ort", skip=skip)


def report_text(report: fusion.FusionReport) -> str:
    return " | ".join([r.detail for r in report.refused] + [f.became for f in report.fused])


def feeds(proto: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs of the graph inputs' shapes and types (not initializers)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in proto.graph.initializer}
    out = {}
    for value in proto.graph.input:
        if value.name in inits:
            continue
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else SYMBOLIC_DIM for d in tensor.shape.dim]
        out[value.name] = rng.standard_normal(shape).astype(_DTYPES[tensor.elem_type])
    return out


def run_ort(model: ir.Model | bytes, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's CPU provider with its own graph optimizations off."""
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = cpu_session(model, level)
    return session.run(None, inputs)


def max_error(expected: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """``(max abs err, tolerance)`` for one output.

    float32: 1e-5 + 1e-4 * max |expected|. The fused kernels reassociate (one-pass statistics,
    a reciprocal for a division; a folded weight rounded once from float64) and differ by a few
    float32 ulps, times the conditioning of 1 / std; a wrong rewrite (the training-mode folds
    were 13 and 80 off, the misfolded Unsqueeze changed the output shape) fails by orders of
    magnitude. float16: 2 ulps of float16 at max |expected| (2^-9 relative): the fused kernel
    normalizes in float32 and rounds once where the unfused graph rounds at each float16 op.
    """
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert np.isfinite(got).all() == np.isfinite(expected).all()
    exp64, got64 = expected.astype(np.float64), got.astype(np.float64)
    err = float(np.abs(exp64 - got64).max()) if exp64.size else 0.0
    scale = float(np.abs(exp64).max()) if exp64.size else 0.0
    if expected.dtype == np.float16:
        return err, 2.0**-9 * max(scale, 2.0**-14)
    return err, 1e-5 + 1e-4 * scale


@pytest.mark.parametrize("name", list(CASES))
def test_fusion_matches_expectation(name):
    case = CASES[name]
    model, report = optimized(name)
    counts = Counter(node.op_type for node in model.graph)
    if name in INVALID_FILES:
        with pytest.raises(onnx.shape_inference.InferenceError, match=INVALID_FILES[name]):
            onnx.checker.check_model(model_path(name), full_check=True)
        with pytest.raises(onnx.shape_inference.InferenceError, match=INVALID_FILES[name]):
            fusion.check(model)
    else:
        fusion.check(model)
    text = report_text(report)
    if case["kind"] not in ("positive", "negative"):  # no ORT test reads it: parity only
        return
    op = TARGET_OP[case["group"]]
    expected = case["expect"]
    if case["kind"] == "negative":
        if name in ACCEPTED_FUSED:
            assert counts[op] != expected[op], f"{name}: accepted as fused, but left alone"
            assert ACCEPTED_FUSED[name] in text
        else:
            assert counts[op] == expected[op], f"{name}: {op} {counts[op]} != {expected[op]}"
        return
    got = {key: counts[key] for key in expected}
    if name in ACCEPTED_UNFUSED:
        assert got != expected, f"{name}: fused now, take it off ACCEPTED_UNFUSED"
        assert ACCEPTED_UNFUSED[name] in text, text
    else:
        assert got == expected, f"{name}: {got} != {expected}; report: {text}"


@pytest.mark.parametrize("name", list(CASES))
def test_parity_on_onnxruntime(name):
    original = model_path(name).read_bytes()
    inputs = feeds(onnx.load_from_string(original))
    if model_path(name).name in UNRUNNABLE:
        _, theirs = UNRUNNABLE[model_path(name).name]
        with pytest.raises(Exception, match=theirs):
            run_ort(original, inputs)
        return  # ONNX Runtime cannot run the original: no parity to check
    expected = run_ort(original, inputs)
    model, _ = optimized(name)
    got = run_ort(model, inputs)
    assert len(got) == len(expected)
    for exp, out in zip(expected, got, strict=True):
        err, tol = max_error(exp, out)
        assert err <= tol, f"{name}: max abs err {err:.3g} > {tol:.3g}"


# Graph-level tests (onnx.helper, no PyTorch). Every BN statistic and norm weight is random.

RNG = np.random.default_rng(7)


def _const(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name)


def _bn_params(channels: int, prefix: str = "bn") -> list[TensorProto]:
    return [
        _const(f"{prefix}_scale", RNG.uniform(0.5, 1.5, channels).astype(np.float32)),
        _const(f"{prefix}_bias", RNG.uniform(-1, 1, channels).astype(np.float32)),
        _const(f"{prefix}_mean", RNG.uniform(-1, 1, channels).astype(np.float32)),
        _const(f"{prefix}_var", RNG.uniform(0.5, 2.0, channels).astype(np.float32)),
    ]


def conv_bn_model(
    opset: int, bn_outputs: int = 1, ir_version: int = 8, list_initializers: bool = False, **attrs
) -> onnx.ModelProto:
    """x (2, 3, 5, 5) -> Conv 1x1 (4 channels) -> BatchNormalization -> y."""
    inits = [
        _const("w", RNG.standard_normal((4, 3, 1, 1)).astype(np.float32)),
        _const("b", RNG.standard_normal(4).astype(np.float32)),
        *_bn_params(4),
    ]
    extra = ["running_mean", "running_var", "saved_mean", "saved_var"][: bn_outputs - 1]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
        helper.make_node(
            "BatchNormalization",
            ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
            ["y", *extra],
            name="bn",
            **attrs,
        ),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 5])]
    if list_initializers:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in inits]
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 5, 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def _optimize(proto: onnx.ModelProto, **kwargs) -> tuple[ir.Model, fusion.FusionReport]:
    model = ir.from_proto(proto)
    return model, fusion.optimize(model, **kwargs)


def _assert_parity(original: onnx.ModelProto, model: ir.Model) -> None:
    inputs = feeds(original, seed=3)
    for exp, out in zip(
        run_ort(original.SerializeToString(), inputs), run_ort(model, inputs), strict=True
    ):
        err, tol = max_error(exp, out)
        assert err <= tol, f"max abs err {err:.3g} > {tol:.3g}"


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def test_inference_mode_batchnorm_is_folded():
    """The control for the two training-mode tests below: the same graph, one output."""
    proto = conv_bn_model(9)
    model, report = _optimize(proto)
    assert _ops(model) == ["Conv"] and report.counts["batchnorm_folded"] == 1
    fusion.check(model)
    _assert_parity(proto, model)


def test_opset_9_batchnorm_with_5_outputs_is_training_mode():
    """Before opset 14, 5 outputs (unused) is the training-mode form: ORT uses batch stats."""
    proto = conv_bn_model(9, bn_outputs=5)
    model, report = _optimize(proto)
    assert "BatchNormalization" in _ops(model)
    (refusal,) = report.refused
    assert "5 outputs at opset 9: before opset 14 that is the training-mode form" in (
        refusal.detail
    )
    fusion.check(model)
    _assert_parity(proto, model)


def test_opset_15_training_mode_1_is_refused():
    proto = conv_bn_model(15, bn_outputs=3, training_mode=1)  # the checker wants 3 outputs
    model, report = _optimize(proto)
    assert "BatchNormalization" in _ops(model)
    (refusal,) = report.refused
    assert refusal.detail.startswith("training_mode=1: statistics come from the batch")
    fusion.check(model)


def test_opset_15_inference_mode_is_folded():
    proto = conv_bn_model(15, training_mode=0)
    model, _ = _optimize(proto)
    assert _ops(model) == ["Conv"]
    _assert_parity(proto, model)


def test_statistics_output_read_is_refused():
    """A statistics output that a node reads (a graph output here) blocks folding at any opset."""
    proto = conv_bn_model(15, bn_outputs=3, training_mode=0)
    proto.graph.output.append(helper.make_tensor_value_info("running_mean", TensorProto.FLOAT, [4]))
    _, report = _optimize(proto)
    (refusal,) = report.refused
    assert "statistics output 'running_mean' is read" in refusal.detail


def test_empty_optional_output_does_not_block_folding():
    proto = conv_bn_model(9)
    proto.graph.node[1].output.append("")
    model, _ = _optimize(proto)
    assert _ops(model) == ["Conv"]
    fusion.check(model)


@pytest.mark.parametrize("listed", [True, False])
def test_ir_version_3_is_raised_to_4(listed):
    """IR 3 with the initializers listed as inputs (valid then) or not (ORT's test files): the
    result is IR 4 with no initializer-backed input, checked, folded and equal on ORT."""
    proto = conv_bn_model(7, ir_version=3, list_initializers=listed)
    model = ir.from_proto(proto)
    if listed:  # as written, an IR-3 initializer listed as input reads as overridable here
        assert const_array(model.graph.initializers["w"]) is None
    report = fusion.optimize(model)
    assert model.ir_version == 4
    assert [v.name for v in model.graph.inputs] == ["x"]
    assert _ops(model) == ["Conv"]
    conv_weight = model.graph.node(0).inputs[1]
    assert not conv_weight.is_graph_input() and const_array(conv_weight) is not None
    (note,) = report.to_dict()["notes"]
    assert note.startswith("IR version 3 raised to 4")
    assert ("initializers no longer listed as graph inputs" in note) == listed
    fusion.check(model)
    _assert_parity(proto, model)


def test_ir_version_4_is_left_alone():
    proto = conv_bn_model(9, ir_version=4, list_initializers=True)  # overridable defaults
    model, report = _optimize(proto)
    assert model.ir_version == 4 and not report.notes
    assert len(model.graph.inputs) == 1 + len(proto.graph.initializer)
    assert "BatchNormalization" in _ops(model)  # an overridable statistic is no constant


@pytest.mark.parametrize(
    ("axes", "shape"),
    [([-2, -1], (4, 1, 1)), ([2, 1], (4, 1, 1)), ([-1, 0], (1, 4, 1)), ([0, -1], (1, 4, 1))],
)
def test_unsqueeze_axes_fold_as_the_spec_says(axes, shape):
    """Opset 11: Unsqueeze(c, axes) of a (4,) constant folds to the spec's shape."""
    c = RNG.standard_normal(4).astype(np.float32)
    nodes = [
        helper.make_node("Unsqueeze", ["c"], ["u"], axes=axes),
        helper.make_node("Mul", ["x", "u"], ["y"]),
    ]
    x_shape = [3 if d == 1 else d for d in shape]
    graph = helper.make_graph(
        nodes,
        "unsqueeze",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)],
        [_const("c", c)],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=8)
    model = ir.from_proto(proto)
    cleanup(model)
    (mul,) = model.graph
    folded = const_array(mul.inputs[1])
    assert folded.shape == shape
    np.testing.assert_array_equal(folded.reshape(-1), c)
    fusion.check(model)
    _assert_parity(proto, model)


def layernorm_model(opset: int, shared: bool = False) -> onnx.ModelProto:
    """A hand-written LayerNorm over the last axis of x (2, 3, 8); ``shared``: two of them on x
    with their own weights (CSE makes their x - mean(x) one value)."""
    outputs, nodes, inits = [], [], []
    for k in range(2 if shared else 1):
        p = f"ln{k}_"
        nodes += [
            helper.make_node("ReduceMean", ["x"], [p + "m"], axes=[-1]),
            helper.make_node("Sub", ["x", p + "m"], [p + "d"]),
            helper.make_node("Pow", [p + "d", p + "two"], [p + "d2"]),
            helper.make_node("ReduceMean", [p + "d2"], [p + "v"], axes=[-1]),
            helper.make_node("Add", [p + "v", p + "eps"], [p + "ve"]),
            helper.make_node("Sqrt", [p + "ve"], [p + "s"]),
            helper.make_node("Div", [p + "d", p + "s"], [p + "n"]),
            helper.make_node("Mul", [p + "n", p + "w"], [p + "nw"]),
            helper.make_node("Add", [p + "nw", p + "b"], [p + "y"]),
        ]
        inits += [
            _const(p + "two", np.array(2.0, np.float32)),
            _const(p + "eps", np.array(1e-5, np.float32)),
            _const(p + "w", RNG.uniform(0.5, 1.5, 8).astype(np.float32)),
            _const(p + "b", RNG.uniform(-1, 1, 8).astype(np.float32)),
        ]
        outputs.append(helper.make_tensor_value_info(p + "y", TensorProto.FLOAT, [2, 3, 8]))
    graph = helper.make_graph(
        nodes,
        "layernorm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
        outputs,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_layernorm_at_opset_12_for_ort():
    """ORT registers LayerNormalization in the default domain at every opset."""
    proto = layernorm_model(12)
    model, report = _optimize(proto, target="ort")
    (node,) = model.graph
    assert (node.op_type, node.domain) == ("LayerNormalization", "")
    assert model.opset_imports[""] == 12  # not raised
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    fusion.check(model)
    _assert_parity(proto, model)


def test_layernorm_at_opset_12_refused_for_onnx():
    proto = layernorm_model(12)
    model, report = _optimize(proto, target="onnx")
    assert "LayerNormalization" not in _ops(model)
    (refusal,) = report.refused
    assert refusal.detail.startswith("opset 12 has no LayerNormalization (needs 17)")
    fusion.check(model)


def test_two_layernorms_sharing_their_centering_are_both_fused():
    proto = layernorm_model(17, shared=True)
    model, report = _optimize(proto)
    assert _ops(model) == ["LayerNormalization", "LayerNormalization"]
    assert report.counts["layernorm_fused"] == 2 and not report.refused
    fusion.check(model)
    _assert_parity(proto, model)
