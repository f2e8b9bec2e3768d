"""FuseSkip on hand-written ONNX graphs (no PyTorch): residual Add + norm -> Skip*Normalization.

Every fused graph runs on ONNX Runtime before and after the pass on random inputs with
randomized weights, and must pass :func:`fusion.check`; every refusal is asserted by its code,
with the graph left byte for byte as it was. The exporter-based cases are in
``test_fuse_skip.py`` (slow).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

from fusion import Code
from fusion.base import MS_DOMAIN
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_rmsnorm import FuseRMSNorm
from fusion.fuse_skip import FuseSkip
from tests.support.graphs import ops
from tests.support.norm_graphs import (
    SHAPE,
    Graph,
    assert_refused,
    fuse_and_compare,
    layernorm,
    rmsnorm,
)

H = SHAPE[-1]
FLOAT = TensorProto.FLOAT

#: norm op -> (opset, the Skip op it becomes)
NORMS = {
    "LayerNormalization": (17, "SkipLayerNormalization"),
    "SimplifiedLayerNormalization": (17, "SkipSimplifiedLayerNormalization"),
    "RMSNormalization": (23, "SkipSimplifiedLayerNormalization"),
}


def _residual_norm(
    rng: np.random.Generator,
    op: str,
    *,
    sum_read: bool = False,
    dtype: int = FLOAT,
    cast: bool = False,
    bias: np.ndarray | None = None,
    bias_input: bool = False,
    bias_read: bool = False,
    beta: bool = True,
    **attributes,
):
    """``op(Add(a, b))`` with a random scale (and bias for LayerNormalization unless ``beta`` is
    False), epsilon 1e-5; ``sum_read`` makes the sum a graph output too, ``cast`` puts a Cast to
    float32 between the Add (in ``dtype``) and the norm. With ``bias``, ``a`` is first
    ``Add(bias, a)`` (a dense layer's bias; a graph input of its shape where ``bias_input``, the
    output ``a_biased`` a graph output too where ``bias_read``)."""
    g = Graph(NORMS[op][0])
    inputs = {"a": (dtype, SHAPE), "b": (dtype, SHAPE)}
    a = "a"
    if bias is not None:
        if bias_input:
            inputs["bias"] = (dtype, bias.shape)
        name = "bias" if bias_input else g.const("bias", bias)
        a = g.node("Add", [name, "a"], "a_biased")
    total = g.node("Add", [a, "b"], "sum")
    if cast:
        total = g.node("Cast", [total], "sum32", to=FLOAT)
    params = [g.const("gamma", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))]
    if op == "LayerNormalization" and beta:
        params.append(g.const("beta", rng.standard_normal(H).astype(np.float32)))
    attributes.setdefault("epsilon", 1e-5)
    g.nodes.append((op, [total, *params], ["y"], {"name": "norm", **attributes}))
    outputs = {"y": (FLOAT, SHAPE), **({"sum": (dtype, SHAPE)} if sum_read else {})}
    if bias_read:
        outputs[a] = (dtype, SHAPE)
    return g.model(inputs, outputs)


@pytest.mark.parametrize("sum_read", [False, True], ids=["sum_unread", "sum_read"])
@pytest.mark.parametrize("op", list(NORMS))
def test_add_and_norm_are_fused(rng, op, sum_read):
    model = _residual_norm(rng, op, sum_read=sum_read)
    report = fuse_and_compare(model, FuseSkip("ort"), rng, rtol=1e-4)
    assert report.counts["skip_fused"] == 1 and not report.refused
    (node,) = model.graph
    assert (node.op_type, node.domain) == (NORMS[op][1], MS_DOMAIN)
    assert [v.name for v in node.inputs[:2]] == ["a", "b"]
    assert node.attributes.get_float("epsilon") == np.float32(1e-5)
    assert model.opset_imports[MS_DOMAIN] == 1
    if sum_read:
        assert node.outputs[3].name == "sum" and node.outputs[3].is_graph_output()


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_hand_written_norm_after_a_residual_add_becomes_one_skip_op(rng, norm):
    """The norm passes, then FuseSkip: the whole residual block is one node."""
    g = Graph(18)
    total = g.node("Add", ["a", "b"], "sum")
    normed = layernorm(g, total) if norm == "layernorm" else rmsnorm(g, total)
    w = g.const("w", (1 + 0.5 * rng.standard_normal(H)).astype(np.float32))
    y = g.node("Mul", [normed, w], "y")
    model = g.model({"a": (FLOAT, SHAPE), "b": (FLOAT, SHAPE)}, {y: (FLOAT, SHAPE)})
    norm_pass = FuseLayerNorm("ort") if norm == "layernorm" else FuseRMSNorm("ort")
    fuse_and_compare(model, norm_pass, rng)
    fuse_and_compare(model, FuseSkip("ort"), rng, rtol=1e-4)
    expected = (
        "SkipLayerNormalization" if norm == "layernorm" else "SkipSimplifiedLayerNormalization"
    )
    assert ops(model) == [expected]


def test_cast_between_residual_and_norm_is_refused(rng):
    model = _residual_norm(rng, "LayerNormalization", dtype=TensorProto.FLOAT16, cast=True)
    assert_refused(model, FuseSkip("ort"), Code.CAST_BETWEEN)


def test_negative_epsilon_is_refused(rng):
    model = _residual_norm(rng, "LayerNormalization", epsilon=-1e-5)
    assert_refused(model, FuseSkip("ort"), Code.NEGATIVE_EPSILON)


def test_norm_over_two_axes_is_refused(rng):
    g = Graph(17)
    total = g.node("Add", ["a", "b"], "sum")
    gamma = g.const("gamma", rng.standard_normal(SHAPE[1:]).astype(np.float32))
    g.nodes.append(("LayerNormalization", [total, gamma], ["y"], {"name": "norm", "axis": -2}))
    model = g.model({"a": (FLOAT, SHAPE), "b": (FLOAT, SHAPE)}, {"y": (FLOAT, SHAPE)})
    assert_refused(model, FuseSkip("ort"), Code.NOT_LAST_AXIS)


def test_other_com_microsoft_version_is_refused(rng):
    model = _residual_norm(rng, "LayerNormalization")
    model.opset_imports[MS_DOMAIN] = 2
    assert_refused(model, FuseSkip("ort"), Code.MS_OPSET_VERSION)


def test_cast_between_residual_and_norm_says_how_the_sum_rounds(rng):
    model = _residual_norm(rng, "LayerNormalization", dtype=TensorProto.FLOAT16, cast=True)
    (refusal,) = assert_refused(model, FuseSkip("ort"), Code.CAST_BETWEEN).refused
    assert "from FLOAT16 to FLOAT" in refusal.detail
    assert "rounds its sum to FLOAT16" in refusal.detail


@pytest.mark.parametrize("sum_read", [False, True], ids=["sum_unread", "sum_read"])
def test_no_op_cast_between_residual_and_norm_is_fused(rng, sum_read):
    """A Cast to float32 of a float32 sum changes nothing: the Add and the norm become one op."""
    model = _residual_norm(rng, "LayerNormalization", cast=True, sum_read=sum_read)
    report = fuse_and_compare(model, FuseSkip("ort"), rng, rtol=1e-4)
    assert report.counts["skip_fused"] == 1 and not report.refused
    assert ops(model) == ["SkipLayerNormalization"]


def _bias(rng: np.random.Generator, shape=(H,)) -> np.ndarray:
    """A random float32 bias of ``shape``."""
    return rng.standard_normal(shape).astype(np.float32)


def _cpu_mode() -> FuseSkip:
    """FuseSkip as ``fusion.optimize(skip="kv_cache")`` makes it (the CPU provider's policy)."""
    return FuseSkip("ort", skip="kv_cache")


@pytest.mark.parametrize("sum_read", [False, True], ids=["sum_unread", "sum_read"])
@pytest.mark.parametrize(
    ("op", "beta"), [*((op, True) for op in NORMS), ("LayerNormalization", False)]
)
def test_bias_add_is_absorbed_as_the_bias_input(rng, op, sum_read, beta):
    """``norm(Add(Add(bias, a), b))``: three nodes become one, ``a`` as input, the vector as the
    Skip op's ``bias`` (input 4 of SkipLayerNormalization, 3 of the Simplified one); output 3,
    read where ``sum_read``, still includes the bias."""
    model = _residual_norm(rng, op, sum_read=sum_read, bias=_bias(rng), beta=beta)
    report = fuse_and_compare(model, FuseSkip("ort"), rng, rtol=1e-4)
    assert report.counts["skip_fused"] == 1 and not report.refused
    assert "with the bias" in report.fused[0].became
    (node,) = model.graph
    assert node.op_type == NORMS[op][1]
    bias_index = 4 if node.op_type == "SkipLayerNormalization" else 3
    assert len(node.inputs) == bias_index + 1 and node.inputs[bias_index].name == "bias"
    assert [v.name for v in node.inputs[:2]] == ["a", "b"]
    if op == "LayerNormalization" and not beta:
        assert node.inputs[3] is None
    if sum_read:
        assert node.outputs[3].name == "sum" and node.outputs[3].is_graph_output()


def _assert_bias_add_kept(model, fusion_pass: FuseSkip, rng) -> None:
    """The residual Add and the norm are fused; the bias Add stays before them."""
    fuse_and_compare(model, fusion_pass, rng, rtol=1e-4)
    assert ops(model) == ["Add", "SkipLayerNormalization"]
    assert len(model.graph[1].inputs) == 4  # no bias input


def test_bias_add_read_elsewhere_is_not_absorbed(rng):
    model = _residual_norm(rng, "LayerNormalization", bias=_bias(rng), bias_read=True)
    _assert_bias_add_kept(model, FuseSkip("ort"), rng)


@pytest.mark.parametrize("kind", ["graph_input", "two_d"])
def test_bias_that_is_no_constant_vector_is_not_absorbed(rng, kind):
    if kind == "graph_input":
        model = _residual_norm(rng, "LayerNormalization", bias=_bias(rng), bias_input=True)
    else:
        model = _residual_norm(rng, "LayerNormalization", bias=_bias(rng, SHAPE[1:]))
    _assert_bias_add_kept(model, FuseSkip("ort"), rng)


@pytest.mark.parametrize("op", list(NORMS))
def test_cpu_mode_fuses_a_bias_absorbing_candidate_without_kv_cache(rng, op):
    """A post-norm model's residual: the bias absorbed, the sum read by the norm alone."""
    model = _residual_norm(rng, op, bias=_bias(rng))
    report = fuse_and_compare(model, _cpu_mode(), rng, rtol=1e-4)
    assert report.counts["skip_fused"] == 1
    assert ops(model) == [NORMS[op][1]]


def test_cpu_mode_leaves_a_plain_residual_add_and_norm_alone(rng):
    """Without a bias to absorb (and no KV cache), where the bias Add is read elsewhere, and
    where the sum is read elsewhere too (a pre-norm model's residual stream: slower there)."""
    for model in (
        _residual_norm(rng, "LayerNormalization"),
        _residual_norm(rng, "LayerNormalization", bias=_bias(rng), bias_read=True),
        _residual_norm(rng, "LayerNormalization", bias=_bias(rng), sum_read=True),
    ):
        before = ir.to_proto(model).SerializeToString()
        fusion_pass = _cpu_mode()
        assert not fusion_pass(model).modified
        assert not fusion_pass.outcomes.fused and not fusion_pass.outcomes.refused
        assert ir.to_proto(model).SerializeToString() == before
