"""Half precision (normexport.precision): graphs built node by node, converted, run on ONNX
Runtime's CPU provider with its graph optimizations off; one CLI run on a PyTorch model."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnxruntime.transformers import float16
from torch import nn

import fusion
from normexport import cli, precision
from normexport.arguments import check_options, make_options
from normexport.errors import UsageError
from normexport.io import files
from normexport.precision import convert, kernels
from normexport.precision.kept import FP16_MAX, decomposed_norm_nodes
from normexport.verdict import parity
from tests.support.graphs import make_model

F, H = TensorProto.FLOAT, TensorProto.FLOAT16
D = 16


def _session(path_or_proto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    source = path_or_proto
    if isinstance(path_or_proto, onnx.ModelProto):
        source = path_or_proto.SerializeToString()
    return ort.InferenceSession(
        str(source) if not isinstance(source, bytes) else source,
        options,
        providers=["CPUExecutionProvider"],
    )


def _layernorm64(x, w, b, eps, outside=False):
    x = x.astype(np.float64)
    d = x - x.mean(-1, keepdims=True)
    var = (d * d).mean(-1, keepdims=True)
    den = np.sqrt(var) + eps if outside else np.sqrt(var + eps)
    return d / den * w + b


def _rel_l2(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _eps_outside_layernorm(rng) -> tuple[ir.Model, dict]:
    """x * 3 -> (x - mean) / (sqrt(var) + eps) * w + b: a look-alike the fusion refuses."""
    params = {
        "k": np.array(3.0, np.float32),
        "eps": np.array(1e-5, np.float32),
        "w": rng.standard_normal(D).astype(np.float32),
        "b": rng.standard_normal(D).astype(np.float32),
        "axes": np.array([-1], np.int64),
    }
    nodes = [
        ("Mul", ["x", "k"], ["xs"], {"name": "scale"}),
        ("ReduceMean", ["xs", "axes"], ["m"], {"name": "mean"}),
        ("Sub", ["xs", "m"], ["d"], {"name": "centre"}),
        ("Mul", ["d", "d"], ["d2"], {"name": "square"}),
        ("ReduceMean", ["d2", "axes"], ["v"], {"name": "var"}),
        ("Sqrt", ["v"], ["sd"], {"name": "root"}),
        ("Add", ["sd", "eps"], ["den"], {"name": "plus_eps"}),
        ("Div", ["d", "den"], ["n"], {"name": "divide"}),
        ("Mul", ["n", "w"], ["nw"], {"name": "times_w"}),
        ("Add", ["nw", "b"], ["y"], {"name": "plus_b"}),
    ]
    model = make_model(nodes, {"x": (F, [2, 3, D])}, {"y": (F, [2, 3, D])}, params)
    return model, params


def _eps_outside_rmsnorm(rng) -> tuple[ir.Model, dict]:
    """x / (sqrt(mean(x**2)) + eps) * w: an RMSNorm look-alike the fusion refuses, whose square
    comes before its reduction."""
    params = {
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-6, np.float32),
        "w": rng.standard_normal(D).astype(np.float32),
        "axes": np.array([-1], np.int64),
    }
    nodes = [
        ("Pow", ["x", "two"], ["x2"], {"name": "square"}),
        ("ReduceMean", ["x2", "axes"], ["ms"], {"name": "mean_square"}),
        ("Sqrt", ["ms"], ["rms"], {"name": "root"}),
        ("Add", ["rms", "eps"], ["den"], {"name": "plus_eps"}),
        ("Div", ["x", "den"], ["n"], {"name": "divide"}),
        ("Mul", ["n", "w"], ["y"], {"name": "times_w"}),
    ]
    model = make_model(nodes, {"x": (F, [2, 3, D])}, {"y": (F, [2, 3, D])}, params)
    return model, params


def _convert(model: ir.Model, tmp_path, refused=(), keep_io_types=True, target="fp16"):
    src, dst = tmp_path / "f32.onnx", tmp_path / "f16.onnx"
    files.save_model(model, src, external_data=False)
    found = precision.to_half(
        src,
        dst,
        precision=target,
        provider="cpu",
        keep_io_types=keep_io_types,
        refused=refused,
        external_data=False,
    )
    return found, dst


def _outlier_input(rng, shape=(2, 3, D)) -> np.ndarray:
    return precision.overflow_set({"x": np.zeros(shape, np.float32)}, seed=3)[
        precision.OVERFLOW_PROBE
    ]["x"]


def test_refused_norm_stays_float32_and_finite(tmp_path):
    rng = np.random.default_rng(0)
    model, p = _eps_outside_layernorm(rng)
    report = fusion.optimize(model)
    assert [(r.family, r.code) for r in report.refused] == [("layernorm", "eps_outside_sqrt")]
    found, dst = _convert(model, tmp_path, report.refused)
    kept = {k.node for k in found.kept_float32}
    assert kept == {"mean", "centre", "square", "var", "root", "plus_eps", "divide"}
    assert {k.reason for k in found.kept_float32} == {"decomposed_norm"}
    graph = onnx.load(dst).graph
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:  # no float16 round trip between two kept nodes
        if node.name in kept - {"mean", "centre"}:
            for name in node.input:
                src = producer.get(name)
                assert src is None or src.op_type != "Cast" or src.name in kept, node.name
    x = _outlier_input(rng) * 3  # the model multiplies by 3: |x| up to ~1e4
    got = _session(dst).run(None, {"x": x})[0]
    want = _layernorm64(x * 3.0, p["w"], p["b"], 1e-5, outside=True)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_block_list_alone_rounds_through_float16(tmp_path):
    """Why the round trips are skipped: the converter's own casts between kept nodes send x**2
    through float16, which overflows. ONNX Runtime's CPU provider drops such Cast pairs itself,
    so the graphs run on onnx.reference, which casts as written (as a float16 device would)."""
    rng = np.random.default_rng(0)
    model, p = _eps_outside_layernorm(rng)
    report = fusion.optimize(model)
    proto = ir.serde.serialize_model(model)
    nodes = decomposed_norm_nodes(proto.graph, report.refused[0].node)
    generic = float16.convert_float_to_float16(proto, keep_io_types=True, node_block_list=nodes)
    convert._drop_repeated_casts(generic.graph)
    generic = ir.serde.deserialize_model(generic)
    generic.graph.sort()  # the converter appends its casts at the end
    generic = ir.serde.serialize_model(generic)
    _, ours = _convert(model, tmp_path, report.refused)
    x = _outlier_input(rng) * 3
    want = _layernorm64(x * 3.0, p["w"], p["b"], 1e-5, outside=True)
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ReferenceEvaluator(generic).run(None, {"x": x})[0]
        good = ReferenceEvaluator(onnx.load(ours)).run(None, {"x": x})[0]
    # var = mean(inf) = inf: the rows with an outlier become the bias alone
    assert _rel_l2(bad, want) > 0.1 and _rel_l2(good, want) < 1e-2


def test_refused_rmsnorm_keeps_its_square_float32(tmp_path):
    """The square of an RMSNorm look-alike comes before its reduction: it stays float32 too.
    Run on onnx.reference, which computes float16 in float16 (ONNX Runtime's CPU provider
    computes Pow in float32 whatever the graph says)."""
    rng = np.random.default_rng(4)
    model, p = _eps_outside_rmsnorm(rng)
    report = fusion.optimize(model)
    assert [(r.family, r.code) for r in report.refused] == [("rmsnorm", "eps_outside_sqrt")]
    found, dst = _convert(model, tmp_path, report.refused)
    kept = {k.node for k in found.kept_float32}
    assert kept == {"square", "mean_square", "root", "plus_eps", "divide"}
    x = _outlier_input(rng)
    x64 = x.astype(np.float64)
    want = x64 / (np.sqrt((x64 * x64).mean(-1, keepdims=True)) + 1e-6) * p["w"]
    with np.errstate(over="ignore", invalid="ignore"):
        got = ReferenceEvaluator(onnx.load(dst)).run(None, {"x": x})[0]
    assert np.isfinite(got).all() and _rel_l2(got, want) < 1e-2


@pytest.mark.parametrize("opset", [17, 23])
def test_fused_norm_computes_statistics_in_float32(tmp_path, opset):
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    op, args = (
        ("LayerNormalization", ["x", "w", "b"]) if opset == 17 else ("RMSNormalization", ["x", "w"])
    )
    inits = {"w": w, "b": b} if len(args) == 3 else {"w": w}
    model = make_model(
        [(op, args, ["y"], {"name": "norm", "epsilon": 1e-5, "stash_type": 0})],
        {"x": (F, [2, 3, D])},
        {"y": (F, [2, 3, D])},
        inits,
        opset=opset,
    )
    found, dst = _convert(model, tmp_path, keep_io_types=False)
    assert found.stash_float32 == ["norm"] and found.kept_float32 == []
    node = onnx.load(dst).graph.node[0]
    assert node.op_type == op and {a.name: a.i for a in node.attribute}["stash_type"] == 1
    assert onnx.load(dst).graph.input[0].type.tensor_type.elem_type == H
    x = _outlier_input(rng)
    got = _session(dst).run(None, {"x": x.astype(np.float16)})[0]
    x16 = x.astype(np.float16).astype(np.float64)
    if opset == 17:
        want = _layernorm64(x16, w, b, 1e-5)
    else:
        want = x16 / np.sqrt((x16 * x16).mean(-1, keepdims=True) + 1e-5) * w
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize("op", ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"])
def test_ort_cpu_skip_norms_keep_float16_inputs_finite(op):
    """Asked of ONNX Runtime: its CPU Skip*LayerNormalization on float16 inputs whose squares
    pass 65504 stays finite and exact to float16 rounding (statistics in float32)."""
    rng = np.random.default_rng(2)
    w, b = rng.standard_normal(D).astype(np.float16), rng.standard_normal(D).astype(np.float16)
    args = ["x", "s", "w", "b"] if op == "SkipLayerNormalization" else ["x", "s", "w"]
    inits = {"w": w, "b": b} if len(args) == 4 else {"w": w}
    model = make_model(
        [(op, args, ["y"], {"domain": "com.microsoft", "epsilon": 1e-5})],
        {"x": (H, [2, D]), "s": (H, [2, D])},
        {"y": (H, [2, D])},
        inits,
    )
    x = (rng.standard_normal((2, D)) * 1e3).astype(np.float16)
    s = rng.standard_normal((2, D)).astype(np.float16)
    got = _session(ir.serde.serialize_model(model)).run(None, {"x": x, "s": s})[0]
    h = x.astype(np.float64) + s
    if len(args) == 4:
        want = _layernorm64(h, w, b, 1e-5)
    else:
        want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * w
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


@pytest.mark.parametrize(
    "value, whole, x_scale, reason",
    [
        (2e5, False, 1e-3, "fp16_overflow"),  # the huge scale meets small inputs
        (1e-7, True, 1e3, "fp16_underflow"),  # the tiny scale meets large ones
        (1e-9, False, 1.0, None),
        (3.0, False, 1.0, None),
    ],
)
def test_constants_float16_cannot_hold_stay_float32(tmp_path, value, whole, x_scale, reason):
    """A folded BatchNorm with a tiny running variance gives a huge scale, a huge variance a
    tiny one: that layer stays float32, where the generic converter clamps the values (to
    65504, or up to float16's smallest subnormal). One tiny value among normal ones (trained
    weights have them) is no loss: its flush moves ``x @ w`` less than float16's rounding."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((D, 4)).astype(np.float32)
    if whole:
        weight *= np.float32(value)
    else:
        weight[0, 0] = value
    model = make_model(
        [("MatMul", ["x", "w"], ["y"], {"name": "folded"})],
        {"x": (F, [2, D])},
        {"y": (F, [2, 4])},
        {"w": weight},
    )
    found, dst = _convert(model, tmp_path)
    assert [(k.node, k.reason) for k in found.kept_float32] == (
        [("folded", reason)] if reason else []
    )
    x = (rng.standard_normal((2, D)) * x_scale).astype(np.float32)
    got = _session(dst).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ weight
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    if reason is not None:
        generic = float16.convert_float_to_float16(
            ir.serde.serialize_model(model), keep_io_types=True
        )
        with np.errstate(over="ignore", invalid="ignore"):
            clamped = _session(generic).run(None, {"x": x})[0].astype(np.float64)
        assert not np.isfinite(clamped).all() or _rel_l2(clamped, want) > 0.1


@pytest.mark.parametrize("value, reason", [(2e5, "fp16_overflow"), (1e-8, "fp16_underflow")])
def test_constant_nodes_float16_cannot_hold_stay_float32(tmp_path, value, reason):
    """A Constant node's value is checked like an initializer: the node and its readers stay
    float32 (exact), where the generic converter clamps it to 65504 or flushes it to 0."""
    tensor = onnx.helper.make_tensor("k", F, [], [value])
    model = make_model(
        [
            ("Constant", [], ["k"], {"value": tensor, "name": "scale"}),
            ("Mul", ["x", "k"], ["h"], {"name": "scaled"}),
            ("Relu", ["h"], ["y"], {"name": "relu"}),
        ],
        {"x": (F, [2, D])},
        {"y": (F, [2, D])},
    )
    found, dst = _convert(model, tmp_path)
    assert [(k.node, k.reason) for k in found.kept_float32] == [
        ("scale", reason),
        ("scaled", reason),
    ]
    assert "constant k" in found.kept_float32[0].detail
    x = np.random.default_rng(4).uniform(1, 2, (2, D)).astype(np.float32)
    x *= np.float32(1e-3 if value > 1 else 1e3)
    want = x.astype(np.float64) * np.float32(value)
    got = _session(dst).run(None, {"x": x})[0]
    assert _rel_l2(got.astype(np.float64), want) < 2e-3
    generic = float16.convert_float_to_float16(ir.serde.serialize_model(model), keep_io_types=True)
    clamped = _session(generic).run(None, {"x": x})[0].astype(np.float64)
    assert _rel_l2(clamped, want) > 0.1


@pytest.mark.parametrize("value", [float(np.finfo(np.float32).min), -1e9])
def test_mask_fill_values_are_float16_fills_not_kept(tmp_path, value):
    """A mask fill (Where(mask, scores, fill)): the converter's clamp to -65504 is float16's own
    fill, so nothing stays float32, and a row masked throughout stays finite (float32 kept, then
    cast, it would be -inf, and softmax NaN)."""
    fill = onnx.helper.make_tensor("fill", F, [], [value])
    model = make_model(
        [
            ("Constant", [], ["fill"], {"value": fill, "name": "fill"}),
            ("Where", ["mask", "x", "fill"], ["masked"], {"name": "masked"}),
            ("Softmax", ["masked"], ["y"], {"axis": -1, "name": "softmax"}),
        ],
        {"mask": (TensorProto.BOOL, [2, D]), "x": (F, [2, D])},
        {"y": (F, [2, D])},
    )
    found, dst = _convert(model, tmp_path)
    assert found.kept_float32 == []
    mask = np.ones((2, D), bool)
    mask[1] = False  # the second row masked throughout
    x = np.random.default_rng(5).standard_normal((2, D)).astype(np.float32)
    y = _session(dst).run(None, {"mask": mask, "x": x})[0]
    assert np.isfinite(y).all() and np.allclose(y[1], 1 / D)


def test_half_precision_parity_rule():
    ref = np.linspace(-1, 1, 100)
    close = parity.compare("y", ref * (1 + 5e-3), ref, 1e-4, 1e-3, max_rel_l2=1e-2)
    far = parity.compare("y", ref * (1 + 5e-2), ref, 1e-4, 1e-3, max_rel_l2=1e-2)
    nan = parity.compare("y", np.where(ref > 0.9, np.nan, ref), ref, 1e-4, 1e-3, max_rel_l2=1)
    assert close.passed and not far.passed and not nan.passed
    # the float32 rule would fail the first: 5e-3 * 1 > 1e-4 + 1e-3 * 1
    assert not parity.compare("y", ref * (1 + 5e-3), ref, 1e-4, 1e-3).passed
    # where the float32 raw model is itself 4e-2 from the oracle, float16 is not blamed for it
    raw = ref * (1 + 4e-2)
    assert parity.compare("y", ref * 1.045, ref, 1e-4, 1e-3, raw=raw, max_rel_l2=1e-2).passed
    assert not parity.compare("y", ref * 1.06, ref, 1e-4, 1e-3, raw=raw, max_rel_l2=1e-2).passed


def test_input_rounding_allowance_scales_with_the_functions_sensitivity():
    # a sigmoid far in its tail: rounding x to float16 moves sigmoid(x) by |x| * 2**-11 in
    # relative terms, so a float16 model's relative error there is large and not a bug
    x = -np.linspace(20, 24, 64).reshape(1, 64)

    def oracle(feeds):
        return [1 / (1 + np.exp(-feeds["x"].astype(np.float64)))]

    def model(scale):  # float16 logits, 2 rounding steps more, and a wrong scale
        return lambda feeds: [
            oracle({"x": (feeds["x"].astype(np.float16) * np.float16(1 + 2 * 2**-11)) * scale})[0]
        ]

    def judge(scale, round_inputs):
        return parity.check_parity(
            model(scale),
            oracle,
            {"tail": {"x": x}},
            ["y"],
            reference_kind="onnx",
            atol=0.0,
            max_rel_l2=1e-2,
            round_inputs=round_inputs,
        )

    rounding = parity.compare(
        "y", oracle(precision.rounded_feeds({"x": x}))[0], oracle({"x": x})[0], 0, 0
    )
    assert rounding.rel_l2_err > 2e-3  # the oracle itself moves when x is rounded
    assert not judge(1.0, None).passed  # relative error ~2e-2 > 1e-2: a false alarm
    sure = judge(1.0, precision.rounded_feeds)
    entry = sure.probes["tail"][0]
    assert sure.passed and entry.rounding_rel_l2_err == pytest.approx(rounding.rel_l2_err)
    assert not judge(1.1, precision.rounded_feeds).passed  # logits 10% off: O(1) relative


def test_rounded_feeds_round_floats_only():
    feeds = {"x": np.array([1 + 2**-12, 1e5], np.float32), "ids": np.arange(3)}
    out = precision.rounded_feeds(feeds)
    assert out["x"].dtype == np.float32 and out["x"][0] == 1 and np.isinf(out["x"][1])
    assert out["ids"] is feeds["ids"]


def test_overflow_probe_has_outliers_and_keeps_integers():
    example = {"x": np.zeros((2, 32), np.float32), "ids": np.arange(4, dtype=np.int64)}
    feeds = precision.overflow_set(example)[precision.OVERFLOW_PROBE]
    assert feeds["ids"] is example["ids"] and feeds["x"].dtype == np.float32
    assert np.abs(feeds["x"][:, ::8]).max() > 256 > np.abs(feeds["x"][:, 1::8]).max()
    assert precision.overflow_set({"ids": example["ids"]}) == {}


def test_unknown_precision_and_stray_keep_io_types_are_refused(tmp_path, capsys):
    check_options(make_options(model="m.onnx", precision="bf16"))  # asked of ORT when converting
    with pytest.raises(UsageError, match="choose one of fp32, fp16, bf16"):
        check_options(make_options(model="m.onnx", precision="fp8"))
    model = make_model([("Relu", ["x"], ["y"], {})], {"x": (F, [2, 4])}, {"y": (F, [2, 4])})
    path = tmp_path / "m.onnx"
    files.save_model(model, path, external_data=False)
    assert cli.main([str(path), "--keep-io-types", "--no-benchmark"]) == 2
    assert "--precision fp16" in capsys.readouterr().err


def test_bf16_below_opset_13_is_refused_with_the_fix(tmp_path, out_dir, capsys):
    """An old export (opset 10, as ONNX Runtime's own test files): no Cast to bfloat16 exists
    there, so the refusal names the opset and what to do, exit 2."""
    model = make_model(
        [("Relu", ["x"], ["y"], {})], {"x": (F, [2, 4])}, {"y": (F, [2, 4])}, opset=10
    )
    path = tmp_path / "old.onnx"
    files.save_model(model, path, external_data=False)
    out = out_dir / "m.onnx"
    argv = [str(path), "--precision", "bf16", "--no-benchmark", "-o", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "opset 10" in err and "--opset 13" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(
    "nodes, lacking",
    [
        # ORT reports Tanh first (graph order), then MatMul: the linear op stays float32
        ([("Tanh", ["x"], ["t"], {}), ("MatMul", ["t", "w"], ["y"], {})], "Tanh, MatMul"),
        ([("Relu", ["x"], ["y"], {})], "Relu"),  # no linear op, no norm: every op counts
    ],
)
def test_cli_bf16_on_cpu_is_refused_with_the_kernels_ort_lacks(tmp_path, capsys, nodes, lacking):
    """ONNX Runtime's CPU provider has no bfloat16 MatMul, Tanh or Relu: the message names the
    provider and the op types ONNX Runtime reported, and says what to do; exit 2, no
    traceback."""
    w = np.random.default_rng(5).standard_normal((4, 4)).astype(np.float32)
    model = make_model(nodes, {"x": (F, [2, 4])}, {"y": (F, [2, 4])}, {"w": w})
    path = tmp_path / "m.onnx"
    files.save_model(model, path, external_data=False)
    assert cli.main([str(path), "--precision", "bf16", "--no-benchmark", "--provider", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"CPUExecutionProvider has no bfloat16 kernel for {lacking} (" in err
    assert "--precision fp16" in err and "--provider cuda" in err and "Traceback" not in err
    assert not (tmp_path / "m.opt.onnx").exists()


def _bf16_case(rng) -> tuple[ir.Model, dict]:
    """Two outputs of x (6, D): ``y1`` = BatchNorm(x @ w1 + b1) (folded; channel 0's scale
    1e-6 times its gamma, which float16 holds as a subnormal, channel 1's about 5e5, past
    float16's 65504); ``y2`` = LN2(LN1(x @ w2)), LN1 hand-written (fused), LN2 with eps outside
    the root (refused, kept float32)."""
    gamma = rng.uniform(-2, 2, D)
    gamma[0], gamma[1] = 1e-6, 50.0
    var = rng.uniform(0.5, 2, D)
    var[1] = 1e-8
    p = {
        "w1": rng.standard_normal((D, D)),
        "b1": rng.standard_normal(D),
        "gamma": gamma,
        "beta": rng.uniform(-1, 1, D),
        "mu": rng.uniform(-1, 1, D),
        "var": var,
        "w2": rng.standard_normal((D, D)),
        "g1": rng.standard_normal(D),
        "c1": rng.standard_normal(D),
        "g2": rng.standard_normal(D),
        "c2": rng.standard_normal(D),
    }
    p = {k: v.astype(np.float32) for k, v in p.items()}
    p |= {"axes": np.array([-1], np.int64), "eps": np.array(1e-5, np.float32)}
    ln1 = [
        ("ReduceMean", ["h", "axes"], ["m1"], {"name": "mean1"}),
        ("Sub", ["h", "m1"], ["d1"], {"name": "centre1"}),
        ("Mul", ["d1", "d1"], ["q1"], {"name": "square1"}),
        ("ReduceMean", ["q1", "axes"], ["v1"], {"name": "var1"}),
        ("Add", ["v1", "eps"], ["ve1"], {"name": "plus_eps1"}),
        ("Sqrt", ["ve1"], ["s1"], {"name": "root1"}),
        ("Div", ["d1", "s1"], ["n1"], {"name": "divide1"}),
        ("Mul", ["n1", "g1"], ["nw1"], {"name": "times_g1"}),
        ("Add", ["nw1", "c1"], ["l1"], {"name": "plus_c1"}),
    ]
    ln2 = [
        ("ReduceMean", ["l1", "axes"], ["m2"], {"name": "mean2"}),
        ("Sub", ["l1", "m2"], ["d2"], {"name": "centre2"}),
        ("Mul", ["d2", "d2"], ["q2"], {"name": "square2"}),
        ("ReduceMean", ["q2", "axes"], ["v2"], {"name": "var2"}),
        ("Sqrt", ["v2"], ["s2"], {"name": "root2"}),
        ("Add", ["s2", "eps"], ["den2"], {"name": "plus_eps2"}),
        ("Div", ["d2", "den2"], ["n2"], {"name": "divide2"}),
        ("Mul", ["n2", "g2"], ["nw2"], {"name": "times_g2"}),
        ("Add", ["nw2", "c2"], ["y2"], {"name": "plus_c2"}),
    ]
    bn = ["lin", "gamma", "beta", "mu", "var"]
    nodes = [
        ("MatMul", ["x", "w1"], ["mm"], {"name": "mm1"}),
        ("Add", ["mm", "b1"], ["lin"], {"name": "bias1"}),
        ("BatchNormalization", bn, ["y1"], {"name": "bn", "epsilon": 1e-9}),
        ("MatMul", ["x", "w2"], ["h"], {"name": "mm2"}),
        *ln1,
        *ln2,
    ]
    shape = [6, D]
    model = make_model(nodes, {"x": (F, shape)}, {"y1": (F, shape), "y2": (F, shape)}, p)
    return model, p


def _bf16_case64(x: np.ndarray, p: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs of :func:`_bf16_case`'s model in float64."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    x = x.astype(np.float64)
    lin = x @ p["w1"] + p["b1"]
    y1 = (lin - p["mu"]) / np.sqrt(p["var"] + 1e-9) * p["gamma"] + p["beta"]
    l1 = _layernorm64(x @ p["w2"], p["g1"], p["c1"], 1e-5)
    return [y1, _layernorm64(l1, p["g2"], p["c2"], 1e-5, outside=True)]


def test_bf16_graph_matches_float64_on_onnx_reference(tmp_path, monkeypatch):
    """bfloat16 conversion with every kernel present (ONNX Runtime's CPU provider has too few
    bfloat16 kernels to run it: the kernel question is answered "all present"), run on
    onnx.reference, which computes bfloat16 as written."""
    monkeypatch.setattr(kernels, "missing_kernel", lambda path, provider: None)
    rng = np.random.default_rng(6)
    model, p = _bf16_case(rng)
    report = fusion.optimize(model)
    assert (report.counts.get("batchnorm_folded"), report.counts.get("layernorm_fused")) == (1, 1)
    assert [(r.family, r.code) for r in report.refused] == [("layernorm", "eps_outside_sqrt")]
    found, dst = _convert(model, tmp_path, report.refused, keep_io_types=False, target="bf16")
    assert found.precision == "bf16" and found.keep_io_types and found.float32_op_types == []
    assert {k.node for k in found.kept_float32} == {
        "mean2", "centre2", "square2", "var2", "root2", "plus_eps2", "divide2"
    }  # fmt: skip
    assert "bfloat16" in found.kept_float32[0].detail and len(found.stash_float32) == 1
    written = onnx.load(dst)
    onnx.checker.check_model(written, full_check=True)  # types agree at every node
    _assert_no_float16(written.graph)
    typed = onnx.shape_inference.infer_shapes(written).graph
    elem = {v.name: v.type.tensor_type.elem_type for v in [*typed.value_info, *typed.output]}
    for node in written.graph.node:
        if node.name in {k.node for k in found.kept_float32}:
            assert elem[node.output[0]] == F, node.name
        if node.op_type == "LayerNormalization":
            assert {a.name: a.i for a in node.attribute}["stash_type"] == 1
            assert elem[node.input[0]] == TensorProto.BFLOAT16
    _assert_rounded_from_float32(written.graph, onnx.load(tmp_path / "f32.onnx").graph)
    x = rng.standard_normal((6, D)).astype(np.float32)
    got = ReferenceEvaluator(written).run(None, {"x": x})
    for g, want in zip(got, _bf16_case64(x, p), strict=True):
        assert g.dtype == np.float32 and np.isfinite(g).all()
        assert 2**-10 < _rel_l2(g, want) < parity.BF16_MAX_REL_L2


def _assert_no_float16(graph: onnx.GraphProto) -> None:
    """No float16 type, Cast target or tensor is left in ``graph``."""
    values = [*graph.input, *graph.output, *graph.value_info]
    assert all(v.type.tensor_type.elem_type != H for v in values)
    assert all(t.data_type != H for t in graph.initializer)
    for node in graph.node:
        for a in node.attribute:
            assert not (a.name == "to" and a.i == H) and a.t.data_type != H, node.name


def _assert_rounded_from_float32(graph: onnx.GraphProto, source: onnx.GraphProto) -> None:
    """Every bfloat16 initializer of ``graph`` is its float32 original in ``source`` rounded to
    bfloat16 (not through float16: the folded scale's 1e-6 and 5e5 survive)."""
    bf16 = ir.DataType.BFLOAT16.numpy()
    originals = {t.name: onnx.numpy_helper.to_array(t) for t in source.initializer}
    tensors = [ir.serde.deserialize_tensor(t) for t in graph.initializer]
    halves = [t for t in tensors if t.dtype == ir.DataType.BFLOAT16]
    assert halves
    for tensor in halves:
        want = originals[tensor.name].astype(bf16)
        np.testing.assert_array_equal(tensor.numpy(), want)
    values = np.concatenate([np.abs(t.numpy().astype(np.float64)).ravel() for t in halves])
    assert values.max() > FP16_MAX
    assert ((values > 0) & (values < 6e-5)).any()  # float16 subnormals


def test_bf16_where_the_provider_has_the_kernels(tmp_path):
    """ONNX Runtime's CPU provider has a bfloat16 LayerNormalization: a model of norms alone
    converts (statistics in float32), its inputs and outputs float32, and runs there."""
    rng = np.random.default_rng(7)
    w, b = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
    model = make_model(
        [("LayerNormalization", ["x", "w", "b"], ["y"], {"name": "norm", "epsilon": 1e-5})],
        {"x": (F, [2, 3, D])},
        {"y": (F, [2, 3, D])},
        {"w": w, "b": b},
    )
    found, dst = _convert(model, tmp_path, keep_io_types=False, target="bf16")
    assert found.stash_float32 == ["norm"] and found.keep_io_types
    assert "LayerNormalization" not in found.float32_op_types
    assert onnx.load(dst).graph.input[0].type.tensor_type.elem_type == F
    x = _outlier_input(rng)
    got = _session(dst).run(None, {"x": x})[0]
    want = _layernorm64(x, w, b, 1e-5)
    assert np.isfinite(got).all() and 2**-10 < _rel_l2(got, want) < parity.BF16_MAX_REL_L2


class HandNorms(nn.Module):
    """Linear -> hand-written LayerNorm (fused) -> x100 -> a look-alike LayerNorm with eps
    outside the root (refused, kept float32) -> Linear."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(32, 64), nn.Linear(64, 8)
        self.w1, self.b1 = nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(64))
        self.w2, self.b2 = nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(64))

    def forward(self, x):
        h = self.a(x)
        d = h - h.mean(-1, keepdim=True)
        h = d / torch.sqrt((d * d).mean(-1, keepdim=True) + 1e-5) * self.w1 + self.b1
        h = h * 100
        d = h - h.mean(-1, keepdim=True)
        h = d / (torch.sqrt((d * d).mean(-1, keepdim=True)) + 1e-5) * self.w2 + self.b2
        return self.c(h)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
def test_cli_fp16_passes_parity_on_the_overflow_probe(tmp_path, capsys, keep):
    torch.manual_seed(0)
    path = tmp_path / "m.pt"
    torch.save(HandNorms().eval(), path)
    out, report = tmp_path / "m.fp16.onnx", tmp_path / "r.json"
    argv = [
        path,
        "--trust-pickle",
        "--input-shape",
        "2,5,32",
        "--precision",
        "fp16",
        "--no-benchmark",
        "-o",
        out,
        "--report",
        report,
        "--provider",
        "cpu",
    ]
    code = cli.main([str(a) for a in argv + (["--keep-io-types"] if keep else [])])
    text = capsys.readouterr().out
    assert code == 0, text
    data = json.loads(report.read_text())
    assert data["fusions"]["layernorm_fused"] == 1 and "Kept in float32" in text
    assert data["precision"]["precision"] == "fp16" and data["precision"]["keep_io_types"] is keep
    assert len(data["precision"]["stash_float32"]) == 1
    assert {k["reason"] for k in data["precision"]["kept_float32"]} == {"decomposed_norm"}
    assert data["parity"]["max_rel_l2"] == parity.FP16_MAX_REL_L2
    probe = data["parity"]["sets"][precision.OVERFLOW_PROBE][0]
    assert probe["passed"] and probe["nonfinite_mismatch"] == 0
    io = onnx.load(out).graph.input[0].type.tensor_type.elem_type
    assert io == (F if keep else H)


def test_initializers_read_only_inside_a_subgraph_are_kept(tmp_path):
    """An If's branches read the outer graph's initializers and inputs by name (as
    GroupQueryAttention's guard does): the conversion keeps the initializers, puts its cast of
    an input before the If, writes the cast of an input only a branch reads (``v``: the
    converter names it and does not write it), and both branches run."""
    rng = np.random.default_rng(0)
    h = onnx.helper
    then = h.make_graph(
        [h.make_node("Slice", ["x", "starts", "ends", "axes"], ["y_then"])], "then", [],
        [h.make_tensor_value_info("y_then", TensorProto.FLOAT, None)],
    )  # fmt: skip
    otherwise = h.make_graph(
        [h.make_node("Mul", ["v", "w"], ["y_else"])], "else", [],
        [h.make_tensor_value_info("y_else", TensorProto.FLOAT, None)],
    )  # fmt: skip
    weights = {
        "w": rng.standard_normal(D).astype(np.float32),
        "starts": np.array([0]),
        "ends": np.array([2]),
        "axes": np.array([0]),
    }
    graph = h.make_graph(
        [h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=otherwise),
         h.make_node("Neg", ["x"], ["z"])], "g",
        [h.make_tensor_value_info("cond", TensorProto.BOOL, []),
         h.make_tensor_value_info("x", TensorProto.FLOAT, [2, D]),
         h.make_tensor_value_info("v", TensorProto.FLOAT, [2, D])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, None),
         h.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(a, n) for n, a in weights.items()],
    )  # fmt: skip
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10)
    _, dst = _convert(ir.serde.deserialize_model(proto), tmp_path)
    assert {t.name for t in onnx.load(dst).graph.initializer} >= set(weights)
    x, v = rng.standard_normal((2, 2, D)).astype(np.float32)
    session = _session(dst)
    for cond, want in ((True, x[:2]), (False, v * weights["w"])):
        got, negated = session.run(None, {"cond": np.array(cond), "x": x, "v": v})
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(negated, -x, rtol=1e-2, atol=1e-2)
