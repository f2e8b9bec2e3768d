"""fusion.optimize end to end on small hand-written graphs: checker, contrib ops, idempotence.

No PyTorch: the graphs are written with onnx.helper (:mod:`norm_graphs`), and each optimized
model is compared with the original on ONNX Runtime (graph optimizations off).
"""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto

import fusion
from tests.support.graphs import assert_close, run
from tests.support.norm_graphs import Graph, inputs, layernorm, rmsnorm

FLOAT = TensorProto.FLOAT
X = (2, 3, 5, 6)


def _conv_bn_rms(opset: int, rng: np.random.Generator) -> ir.Model:
    """Conv -> BatchNormalization, then a LLaMA-style RMSNorm over the last axis (random
    weights and statistics)."""
    g = Graph(opset)
    w = g.const("conv_w", rng.standard_normal((4, 3, 1, 1)).astype(np.float32))
    b = g.const("conv_b", rng.standard_normal(4).astype(np.float32))
    h = g.node("Conv", ["x", w, b], "conv")
    bn = [
        g.const("bn_scale", rng.uniform(0.5, 1.5, 4).astype(np.float32)),
        g.const("bn_bias", rng.uniform(-1, 1, 4).astype(np.float32)),
        g.const("bn_mean", rng.uniform(-1, 1, 4).astype(np.float32)),
        g.const("bn_var", rng.uniform(0.5, 2, 4).astype(np.float32)),
    ]
    h = g.node("BatchNormalization", [h, *bn], "bn", epsilon=1e-5)
    weight = g.const("rms_w", (1 + 0.5 * rng.standard_normal(X[-1])).astype(np.float32))
    y = g.node("Mul", [weight, rmsnorm(g, h)], "y")
    return g.model({"x": (FLOAT, X)}, {y: (FLOAT, (2, 4, 5, 6))})


@pytest.mark.parametrize(("opset", "op"), [(18, "SimplifiedLayerNormalization"),
                                           (23, "RMSNormalization")])  # fmt: skip
def test_optimize_passes_the_checker_and_matches_the_original(rng, opset, op):
    model = _conv_bn_rms(opset, rng)
    feeds = inputs(rng, model)
    expected = run(model, feeds)
    report = fusion.optimize(model, target="ort")
    assert report.counts["batchnorm_folded"] == 1 and report.counts["rmsnorm_fused"] == 1
    assert fusion.norm_ops(model) == {op: 1}
    assert model.opset_imports[""] == opset  # never raised
    fusion.check(model)
    assert_close(run(model, feeds), expected, rtol=1e-4)


def test_second_optimize_changes_nothing(rng):
    model = _conv_bn_rms(18, rng)
    fusion.optimize(model)
    before = ir.to_proto(model).SerializeToString()
    report = fusion.optimize(model)
    assert not any(report.counts.values())
    assert ir.to_proto(model).SerializeToString() == before


def test_check_rejects_an_invalid_model(rng):
    model = _conv_bn_rms(18, rng)
    fusion.optimize(model)
    node = next(n for n in model.graph if n.op_type == "Conv")
    node.attributes["group"] = ir.AttrString("group", "one")  # wrong attribute type
    with pytest.raises(onnx.checker.ValidationError):
        fusion.check(model)


def _residual_norm(rng: np.random.Generator) -> ir.Model:
    """``LayerNorm(x + Linear(x))``, the LayerNorm written out (weight and bias), hidden 16."""
    g = Graph(18)
    w = g.const("lin_w", rng.standard_normal((16, 16)).astype(np.float32) / 4)
    b = g.const("lin_b", rng.standard_normal(16).astype(np.float32))
    lin = g.node("Add", [g.node("MatMul", ["x", w], "mm"), b], "lin")
    total = g.node("Add", ["x", lin], "sum")
    gamma = g.const("gamma", (1 + 0.5 * rng.standard_normal(16)).astype(np.float32))
    beta = g.const("beta", rng.standard_normal(16).astype(np.float32))
    y = g.node("Add", [g.node("Mul", [layernorm(g, total), gamma], "scaled"), beta], "y")
    return g.model({"x": (FLOAT, (2, 5, 16))}, {y: (FLOAT, (2, 5, 16))})


def test_skip_is_opt_in_and_exact(rng):
    plain = _residual_norm(rng)
    fusion.optimize(plain)
    assert fusion.norm_ops(plain) == {"LayerNormalization": 1}
    skipped = _residual_norm(np.random.default_rng(0))
    feeds = inputs(rng, skipped)
    expected = run(skipped, feeds)
    report = fusion.optimize(skipped, skip=True)
    assert report.counts["skip_fused"] == 1
    assert fusion.norm_ops(skipped) == {"SkipLayerNormalization": 1}
    fusion.check(skipped)
    assert_close(run(skipped, feeds), expected, rtol=1e-4)
    with pytest.raises(ValueError, match="target='ort'"):
        fusion.optimize(skipped, target="onnx", skip=True)


def test_excluded_rewrites_are_left_as_they_were(rng):
    """``exclude`` leaves out exactly the rewrites named by an earlier run's report (kind and
    anchor), without a refusal of its own; the model keeps the original nodes there."""
    model = _conv_bn_rms(18, rng)
    feeds = inputs(rng, model)
    expected = run(model, feeds)
    first = fusion.optimize(_conv_bn_rms(18, np.random.default_rng(0)))
    (fold,) = [f for f in first.fused if f.kind == "batchnorm_folded"]
    report = fusion.optimize(model, exclude=[fold])
    assert [f.kind for f in report.fused] == ["rmsnorm_fused"]
    assert not report.refused
    assert fusion.norm_ops(model) == {"BatchNormalization": 1, "SimplifiedLayerNormalization": 1}
    assert_close(run(model, feeds), expected, rtol=1e-4)
    (rms,) = [f for f in first.fused if f.kind == "rmsnorm_fused"]
    again = _conv_bn_rms(18, np.random.default_rng(0))
    assert [f.kind for f in fusion.optimize(again, exclude=[rms]).fused] == ["batchnorm_folded"]


def test_target_ort_may_hold_ops_only_onnx_runtime_runs(rng):
    """A LayerNorm in an opset-7 model: ``--target ort`` writes LayerNormalization (ONNX has it
    from 17; ONNX Runtime registers it at every opset), and says so; ``--target onnx`` refuses
    it for the opset and writes standard ONNX."""
    g = Graph(7)
    y = g.node("Mul", [layernorm(g, "x"), g.const("gamma", np.float32(1.5))], "y")
    model = g.model({"x": (FLOAT, (2, 5, 16))}, {y: (FLOAT, (2, 5, 16))})
    feeds = inputs(rng, model)
    expected = run(model, feeds)
    fusion.optimize(model, target="ort")
    assert fusion.onnxruntime_ops(model) == {"LayerNormalization": 1}
    fusion.check(model)  # checked as ONNX Runtime's own op (the checker alone rejects it)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(ir.to_proto(model))
    assert_close(run(model, feeds), expected, rtol=1e-4)
    standard = g.model({"x": (FLOAT, (2, 5, 16))}, {y: (FLOAT, (2, 5, 16))})
    report = fusion.optimize(standard, target="onnx")
    assert report.codes("layernorm") == ["opset_too_low"]
    assert fusion.onnxruntime_ops(standard) == {}
    onnx.checker.check_model(ir.to_proto(standard), full_check=True)


def test_for_the_onnx_target_the_opset_is_raised_before_the_norms(rng):
    """An opset-20 model with an RMSNorm before an attention, for ``--target onnx``: FuseSDPA
    raises the opset to 23 before the norm passes run (its plan), so the RMSNorm becomes
    RMSNormalization in the model that ends at 23, not a refusal for an opset it no longer has."""
    g = Graph(20)
    weight = g.const("rms_w", (1 + 0.5 * rng.standard_normal(8)).astype(np.float32))
    h = g.node("Mul", [weight, rmsnorm(g, "x")], "h")
    g.node("Transpose", [h], "ht", perm=[0, 1, 3, 2])
    g.node("MatMul", [h, "ht"], "raw")
    g.node("Mul", ["raw", g.const("scale", np.float32(8**-0.5))], "scores")
    g.node("Softmax", ["scores"], "p", axis=-1)
    y = g.node("MatMul", ["p", h], "y")
    model = g.model({"x": (FLOAT, (1, 2, 5, 8))}, {y: (FLOAT, (1, 2, 5, 8))})
    feeds = inputs(rng, model)
    expected = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    assert report.counts["rmsnorm_fused"] == 1 and report.counts["sdpa_fused"] == 1, report.refused
    assert fusion.norm_ops(model) == {"RMSNormalization": 1}
    assert model.opset_imports[""] == 23
    assert any("raised from 20 to 23" in note for note in report.notes)
    fusion.check(model)
    assert_close(run(model, feeds), expected, rtol=1e-4, atol=1e-5)


_LONG_1D = """
import resource, sys
import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper
import fusion

n = int(sys.argv[1])  # a waveform of n samples, as an audio model's input is
half = numpy_helper.from_array(np.array([0.5], np.float32))
nodes = [
    helper.make_node("ConstantOfShape", ["shape"], ["c"], value=half),
    helper.make_node("Add", ["x", "c"], ["s"]),
    helper.make_node("Mul", ["s", "x"], ["y"]),
]
shape = numpy_helper.from_array(np.array([n], np.int64), "shape")
graph = helper.make_graph(
    nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], [shape],
)
model = ir.serde.deserialize_model(helper.make_model(graph))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fusion.optimize(model, target="ort")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_a_long_1d_tensor_does_not_make_shape_inference_hold_its_values(tmp_path):
    """ONNX's data propagation keeps a 1-D tensor's values as shape dimensions, one message per
    element: a 10-million-sample waveform through an Add took 2.1 GB more to infer. The passes
    infer shapes without it: the optimize call grows the process by well under the tensor's
    own 40 MB times ten."""
    import subprocess
    import sys

    script = tmp_path / "long.py"
    script.write_text(_LONG_1D)
    done = subprocess.run(
        [sys.executable, str(script), str(10_000_000)], capture_output=True, text=True, check=True
    )
    grown = int(done.stdout.split()[-1])
    assert grown < 400 * 2**20, f"{grown / 2**20:.0f} MiB"
