"""MergeBranches on linear branches of one input (:mod:`fusion.merge_branches.dense`): timm's
RepViT distillation heads, ``(head(x) + head_dist(x)) / 2`` with each head a BatchNorm1d and a
Linear, become one Gemm, as timm's own re-parameterization writes it; the MatMul + Add form of a
3-D input likewise; and the look-alikes left. Every weight, bias and statistic is random; each
graph runs on ONNX Runtime before and after ``fusion.optimize``."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from onnx import TensorProto

import fusion
from tests.support.graphs import assert_close, make_model, run

F = TensorProto.FLOAT
D, N = 64, 10


def _head(rng, i: int, x: str, matmul: bool = False) -> tuple[list, dict]:
    """BatchNorm then Linear (a Gemm with transB) on ``x``; ``matmul``: a Linear alone, MatMul
    then Add, on a 3-D ``x``."""
    c = {
        f"s{i}": rng.uniform(0.5, 2, D),
        f"t{i}": rng.uniform(-1, 1, D),
        f"m{i}": rng.uniform(-1, 1, D),
        f"v{i}": rng.uniform(0.5, 2, D),
        f"b{i}": rng.standard_normal(N),
    }
    c[f"w{i}"] = rng.standard_normal((D, N) if matmul else (N, D)) / 8
    if matmul:
        nodes = [
            ("MatMul", [x, f"w{i}"], [f"h{i}m"], {}),
            ("Add", [f"h{i}m", f"b{i}"], [f"h{i}"], {}),
        ]
    else:
        nodes = [
            ("BatchNormalization", [x, f"s{i}", f"t{i}", f"m{i}", f"v{i}"], [f"n{i}"], {}),
            ("Gemm", [f"n{i}", f"w{i}", f"b{i}"], [f"h{i}"], {"transB": 1}),
        ]
    return nodes, {k: np.asarray(v, np.float32) for k, v in c.items()}


def _heads(rng, scale: tuple[str, float] = ("Div", 2.0), second: str = "x", matmul=False):
    """Two heads summed then scaled (``Div`` by or ``Mul`` by ``scale``), the first reading
    ``x``, the second ``second``: ``x``, another input ``z``, or ``r = Relu(x)``; ``matmul``: a
    (B, T, D) input, each head a MatMul + Add."""
    first, c1 = _head(rng, 1, "x", matmul)
    other, c2 = _head(rng, 2, second, matmul)
    op, k = scale
    relu = [("Relu", ["x"], ["r"], {})] if second == "r" else []
    nodes = [*relu, *first, *other, ("Add", ["h1", "h2"], ["h"], {}), (op, ["h", "k"], ["y"], {})]
    shape = [2, 5, D] if matmul else [2, D]
    inputs = {"x": (F, shape)} | ({"z": (F, shape)} if second == "z" else {})
    out = [2, 5, N] if matmul else [2, N]
    constants = c1 | c2 | {"k": np.array(k, np.float32)}
    return make_model(nodes, inputs, {"y": (F, out)}, constants, opset=17), inputs


def _optimized(rng, model, inputs):
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, (_, s) in inputs.items()}
    before = run(model, feeds)
    report = fusion.optimize(model, target="onnx")
    assert_close(run(model, feeds), before, rtol=1e-4, atol=1e-5)
    counts = {k: v for k, v in report.counts.items() if v}
    return counts, collections.Counter(n.op_type for n in model.graph), report


@pytest.mark.parametrize("scale", [("Div", 2.0), ("Mul", 0.5), ("Div", 3.0)])
def test_two_gemm_heads_scaled_become_one_gemm(rng, scale):
    """Averaged (``/ 2``, ``* 0.5``) or scaled by any constant (``/ 3``: still a linear map of
    ``x``): one Gemm of the summed weights and biases, the scale folded into it."""
    counts, ops, report = _optimized(rng, *_heads(rng, scale))
    assert ops == {"Gemm": 1}, ops
    assert counts == {"batchnorm_folded": 2, "reparam_merged": 1, "affine_folded": 1}, counts
    assert not report.refused, report.to_dict()


def test_two_matmul_heads_become_one_matmul(rng):
    counts, ops, _ = _optimized(rng, *_heads(rng, matmul=True))
    assert ops == {"MatMul": 1, "Add": 1}, ops
    assert counts == {"reparam_merged": 1, "affine_folded": 1}, counts


def test_heads_on_two_inputs_are_left(rng):
    """Two heads on different tensors: no one layer computes the sum; nothing merged, nothing
    refused."""
    counts, ops, report = _optimized(rng, *_heads(rng, second="z"))
    assert ops["Gemm"] == 2 and "reparam_merged" not in counts, (ops, counts)
    assert not report.refused, report.to_dict()


def test_a_head_through_another_op_is_left(rng):
    """One head reads ``relu(x)``: no sum of linear maps of one tensor; left, no refusal."""
    counts, ops, report = _optimized(rng, *_heads(rng, second="r"))
    assert ops["Gemm"] == 2 and "reparam_merged" not in counts, (ops, counts)
    assert not report.refused, report.to_dict()
