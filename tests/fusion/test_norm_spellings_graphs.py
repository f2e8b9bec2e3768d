"""The LayerNorm and RMSNorm spellings of other frameworks' exporters, node by node (no
PyTorch, no TensorFlow, no JAX): tf2onnx's TensorFlow moments (the mean as
``GlobalAveragePool``, ``Sqrt`` + ``Reciprocal``, the weight folded into the inverse and the
mean subtracted after it, batch-norm style), jax2onnx's Flax variance ``max(0, E[x^2] -
E[x]^2)``, and ``Pow(., -0.5)``. Each fused graph runs on ONNX Runtime before and after the pass
(random inputs, randomized weight and bias); each look-alike is refused by its code, the graph
left as it was. The exporters' own files: the main command's tests, ``test_exporter_files.py``."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

import fusion
from fusion import Code
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_rmsnorm import FuseRMSNorm
from fusion.norm_match.restored import shape_entries
from tests.support.exporter_norms import (
    affine,
    as_model,
    flax_layernorm,
    inverse_root,
    jax2tf_layernorm,
    jax2tf_rows_layernorm,
    jax_mean,
    rows_model,
    tf_layernorm,
    tf_moments,
)
from tests.support.graphs import assert_close, run
from tests.support.norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare

FLOAT = TensorProto.FLOAT
H = SHAPE[-1]


@pytest.mark.parametrize(
    "form",
    [
        {},
        {"gamma": False},
        {"beta": "sub"},
        {"beta": None},
        {"rsqrt": True},
        {"shift_first": True},
    ],
    ids=["keras", "no_gamma", "beta_minus", "no_beta", "rsqrt", "shift_first"],
)
def test_tensorflow_layernorm_is_fused(rng, form):
    g = Graph()
    model = as_model(g, tf_layernorm(g, rng, **form))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    (node,) = model.graph
    assert node.op_type == "LayerNormalization" and node.attributes.get_int("axis") == -1
    assert node.attributes.get_float("epsilon") == np.float32(1e-3)
    assert len(node.inputs) == (3 if form.get("beta", "add") else 2)


def test_a_global_average_pool_over_two_trailing_axes_is_a_norm_over_both(rng):
    """``GlobalAveragePool`` of a 4-D tensor is the mean over its last two axes: axis -2."""
    g = Graph()
    shape = (2, 3, 4, 5)
    m, var = tf_moments(g, "x")
    r = inverse_root(g, var)
    y = g.node("Mul", [g.node("Sub", ["x", m], "d2"), r], "y")
    model = as_model(g, y, shape)
    fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    (node,) = model.graph
    assert node.attributes.get_int("axis") == -2


def test_a_shift_by_another_tensors_mean_is_refused(rng):
    """``x * g + beta - m' * g`` where ``m'`` is not the mean the variance centers with."""
    g = Graph()
    other = g.reduce("ReduceMean", "x", "other_mean", (-2,))
    model = as_model(g, tf_layernorm(g, rng, mean=other))
    assert_refused(model, FuseLayerNorm("onnx"), Code.WRONG_NUMERATOR)


def test_a_mean_over_axes_the_variance_is_not_taken_over_is_refused(rng):
    g = Graph()
    m, var = tf_moments(g, "x", gap=False, var_axes=(-2, -1))
    y = g.node("Mul", [g.node("Sub", ["x", m], "d2"), inverse_root(g, var)], "y")
    assert_refused(as_model(g, y), FuseLayerNorm("onnx"), Code.DIFFERENT_AXES)


def test_tensorflow_rmsnorm_is_fused(rng):
    """Keras' RMSNormalization through tf2onnx: ``x * (Reciprocal(Sqrt(GAP(x * x) + eps)) *
    scale)``."""
    g = Graph()
    ms = g.node("GlobalAveragePool", [g.node("Mul", ["x", "x"], "sq")], "ms")
    scaled = g.node("Mul", [inverse_root(g, ms, eps=1e-6), affine(g, rng, "scale")], "g")
    model = as_model(g, g.node("Mul", ["x", scaled], "y"))
    report = fuse_and_compare(model, FuseRMSNorm("ort"), rng)
    assert report.counts["rmsnorm_fused"] == 1
    (node,) = model.graph
    assert node.op_type == "SimplifiedLayerNormalization"


@pytest.mark.parametrize("clip", ["Max", "Clip", None])
def test_flax_layernorm_from_the_moments_is_fused(rng, clip):
    g = Graph()
    model = as_model(g, flax_layernorm(g, rng, clip))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1
    (node,) = model.graph
    assert [v.name for v in node.inputs][1:] and node.attributes.get_int("axis") == -1


@pytest.mark.parametrize(
    "axes", [{"mean_axes": (-2, -1)}, {"center_axes": (-2, -1)}], ids=["mean", "center"]
)
def test_moments_over_other_axes_are_refused(rng, axes):
    """``E[x]`` (in the variance, or the one the numerator subtracts) over an axis the mean
    square is not taken over: not a LayerNorm."""
    g = Graph()
    model = as_model(g, flax_layernorm(g, rng, **axes))
    report = FuseLayerNorm("onnx")
    if "mean_axes" in axes:  # E[x^2] - E[x]^2 over different axes is no variance at all
        before = len(list(model.graph))
        assert not report(model).modified and len(list(model.graph)) == before
        assert report.outcomes.codes() in ([], [Code.DIFFERENT_AXES])
    else:
        assert_refused(model, report, Code.DIFFERENT_AXES)


def test_moments_are_no_rmsnorm(rng):
    """The variance from the moments never becomes an RMSNorm of ``x``: it is centered."""
    g = Graph()
    model = as_model(g, flax_layernorm(g, rng))
    assert not FuseRMSNorm("ort")(model).modified


@pytest.mark.parametrize("square", ["div", "mul"])
@pytest.mark.parametrize("mean", ["div", "mul"])
def test_jax2tf_layernorm_with_sums_over_the_count_is_fused(rng, mean, square):
    g = Graph()
    model = as_model(g, jax2tf_layernorm(g, rng, mean=mean, square=square))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    assert [n.op_type for n in model.graph] == ["LayerNormalization"]
    (node,) = model.graph
    assert node.attributes.get_float("epsilon") == np.float32(1e-6)
    assert len(node.inputs) == 3


@pytest.mark.parametrize("clamp", ["max_first", "max_last", "relu", "full", "expand", None])
def test_the_clamp_at_zero_goes_wherever_it_is_written(rng, clamp):
    """``max(0, E[x^2] - E[x]^2)`` in each spelling: the fused op's variance is never
    negative, so the clamp is implied."""
    g = Graph()
    model = as_model(g, jax2tf_layernorm(g, rng, clamp=clamp))
    report = fuse_and_compare(model, FuseLayerNorm("onnx"), rng)
    assert report.counts["layernorm_fused"] == 1 and not report.refused
    assert "LayerNormalization" in [n.op_type for n in model.graph]
    assert not {"Max", "Relu", "Sub"} & {n.op_type for n in model.graph}


@pytest.mark.parametrize(
    "form",
    [
        ({"count": H - 1}, Code.WRONG_MEAN_DIVISOR),
        ({"count": H - 1, "mean": "mul"}, Code.WRONG_MEAN_DIVISOR),
        ({"at": 0.1}, Code.CLAMP_NOT_ZERO),
        ({"at": 0.1, "clamp": "full"}, Code.CLAMP_NOT_ZERO),
    ],
    ids=["div_by_n_minus_1", "mul_by_1_over_n_minus_1", "clamp_at_0.1", "full_clamp_at_0.1"],
)
def test_sums_not_over_the_count_and_clamps_not_at_zero_are_refused(rng, form):
    g = Graph()
    model = as_model(g, jax2tf_layernorm(g, rng, **form[0]))
    assert_refused(model, FuseLayerNorm("onnx"), form[1])


def test_a_mean_square_not_over_the_count_is_refused(rng):
    """``E[x^2]`` written as ``sum(x * x) / (N - 1)``: ``E[x^2] * f - E[x]^2`` is no variance,
    scaled or not."""
    g = Graph()
    m = jax_mean(g, "x", "m", "div")
    ex2 = jax_mean(g, g.node("Mul", ["x", "x"], "xx"), "ex2", "div", H - 1)
    var = g.node("Sub", [ex2, g.node("Mul", [m, m], "mm")], "var")
    y = g.node("Mul", [g.node("Sub", ["x", m], "c"), inverse_root(g, var)], "y")
    assert_refused(as_model(g, y), FuseLayerNorm("onnx"), Code.WRONG_MEAN_DIVISOR)


def _at_two_batches(model, fusion_pass, rng) -> None:
    """Run ``fusion_pass`` on ``model`` (input ``inp`` of a symbolic batch): it fuses, and ONNX
    Runtime gives the same outputs before and after at batch 1 and 5."""
    dims = [d if isinstance(d, int) else None for d in model.graph.inputs[0].shape]
    feeds = [
        {"inp": (0.5 + 2 * rng.standard_normal([b if d is None else d for d in dims]))}
        for b in (1, 5)
    ]
    feeds = [{"inp": f["inp"].astype(np.float32)} for f in feeds]
    before = [run(model, f) for f in feeds]
    assert fusion_pass(model).modified
    fusion.check(model)
    for f, want in zip(feeds, before, strict=True):
        assert_close(run(model, f), want, rtol=1e-5)


@pytest.mark.parametrize(
    "form",
    [
        {},
        {"source": "x"},
        {"source": "x", "expand": True},
        {"source": "x", "leading": 2},
        {"source": "constant"},
    ],
    ids=["input_shape", "x_shape", "x_shape_expand", "x_shape_two_leading_axes", "minus_one"],
)
def test_statistics_put_back_by_a_run_time_reshape_are_fused(rng, form):
    """jax2tf's ``keepdims=0`` sums over a batch of unknown size, each put back by a Reshape to
    ``Concat(Slice(Shape(.), 0, 1), [1])``: the keepdims shape, from the element count where
    the batch comes from the model's input or is ``-1`` (one leading axis), from ``Shape(x)``
    itself otherwise."""
    g = Graph()
    model = rows_model(g, jax2tf_rows_layernorm(g, rng, **form), form.get("leading", 1))
    fusion_pass = FuseLayerNorm("onnx")
    _at_two_batches(model, fusion_pass, rng)
    assert fusion_pass.outcomes.counts["layernorm_fused"] == 1 and not fusion_pass.outcomes.refused
    ops = [n.op_type for n in model.graph]
    assert "LayerNormalization" in ops and not {"Reshape", "Expand", "Max", "Sub"} & set(ops)
    (node,) = (n for n in model.graph if n.op_type == "LayerNormalization")
    assert node.attributes.get_int("axis") == -1 and len(node.inputs) == 3


def test_the_run_time_expand_goes_in_the_whole_optimization(rng):
    """An Expand to the same run-time target after each Reshape: the pass alone cannot tell the
    target's batch entry, ``fusion.optimize`` removes the Expand from the shapes, and fuses."""
    g = Graph()
    model = rows_model(g, jax2tf_rows_layernorm(g, rng, expand=True))
    assert_refused(model, FuseLayerNorm("onnx"), Code.VARIANCE_RESHAPED)
    feeds = {"inp": rng.standard_normal((3, H)).astype(np.float32)}
    before = run(model, feeds)
    assert fusion.optimize(model, target="onnx").counts["layernorm_fused"] == 1
    assert [n.op_type for n in model.graph] == ["Add", "LayerNormalization"]
    assert_close(run(model, feeds), before, rtol=1e-5)


@pytest.mark.parametrize(
    "form",
    [{"leading": 2}, {"flipped": True}],
    ids=["two_leading_axes_from_the_input", "ones_first"],
)
def test_a_run_time_reshape_not_provably_the_keepdims_shape_is_refused(rng, form):
    """Two leading axes read from another tensor's shape (the element count no longer tells
    each), or the target ``[1, batch]``: ``variance_reshaped``, the graph left as it was."""
    g = Graph()
    model = rows_model(g, jax2tf_rows_layernorm(g, rng, **form), form.get("leading", 1))
    assert_refused(model, FuseLayerNorm("onnx"), Code.VARIANCE_RESHAPED)


@pytest.mark.parametrize("form", ["squares_reshaped", "keepdims_differ"])
def test_moments_the_keepdims_shape_cannot_hold_are_refused(rng, form):
    """``E[x^2]`` alone reshaped before the difference (``variance_reshaped``), or ``E[x]`` with
    its axes kept and ``E[x^2]`` without (``keepdims_zero``: the difference would broadcast
    rows against rows): recognised as the moments, refused, not passed over."""
    g = Graph()
    inv = g.const("inv_n", np.float32(1 / H))
    m = g.node("Mul", [g.reduce("ReduceSum", "x", "m_sum", (-1,), 1), inv], "m")
    sums = g.reduce("ReduceSum", g.node("Mul", ["x", "x"], "xx"), "ex2_sum", (-1,), 0)
    if form == "squares_reshaped":
        kept = g.const("kept", np.array([*SHAPE[:-1], 1], np.int64))
        sums = g.node("Reshape", [sums, kept], "ex2_kept")
    ex2 = g.node("Mul", [sums, inv], "ex2")
    var = g.node("Sub", [ex2, g.node("Mul", [m, m], "mm")], "var")
    y = g.node("Mul", [g.node("Sub", ["x", m], "c"), inverse_root(g, var)], "xg")
    code = Code.VARIANCE_RESHAPED if form == "squares_reshaped" else Code.KEEPDIMS_ZERO
    assert_refused(as_model(g, y), FuseLayerNorm("onnx"), code)


def test_a_target_is_read_entry_by_entry():
    """:func:`fusion.norm_match.restored.shape_entries`: ``x``'s own sizes as axes, another
    tensor's symbolic size unknown, a constant as itself, and one that an int32 Cast wraps
    around unknown."""
    g = Graph()
    x = g.node("Add", ["inp", g.const("shift", np.float32(0.25))], "x")
    zero, one = g.const("zero", np.array([0], np.int64)), g.const("one", np.array([1], np.int64))
    own = g.node("Slice", [g.node("Shape", [x], "sx"), zero, one], "own")
    other = g.node("Slice", [g.node("Shape", ["inp"], "si"), zero, one], "other")
    big = g.node("Cast", [g.const("big", np.array([2**32 + 1], np.int64))], "big32", to=6)
    big = g.node("Cast", [big], "big64", to=7)
    t = g.node("Concat", [own, other, one, big], "t", axis=0)
    model = g.model({"inp": (FLOAT, ("batch", H))}, {t: (TensorProto.INT64, (4,))})
    values = {v.name: v for n in model.graph for v in n.outputs}
    assert shape_entries(values["t"], values["x"]) == [("x", 0), None, 1, None]
