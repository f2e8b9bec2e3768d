"""FuseSDPA on hand-built graphs whose scores are scaled per head: SwinV2's cosine attention
(``normalize(q) @ normalize(k)^T * exp(min(logit_scale, log 100))``, relative positions and the
shifted windows' mask after it) and EdgeNeXt's cross-covariance attention (XCA: ``* temperature``
on the channels' scores), the scale ``(N, 1, 1)``, random and of either sign. The scale moves
into ``Q`` (a Mul), the op's ``scale`` is the rest, one number; the numbers are the unfused
graph's on ONNX Runtime. A scale that varies along another axis, or is computed at run time,
stays refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto

import fusion
from fusion import Code
from tests.support.graphs import assert_close, make_model, ops, run

F = TensorProto.FLOAT
B, N, S, H = 2, 3, 4, 8  # SwinV2: windows of S = 4 tokens; XCA: S channels of H tokens per head
WINDOWS = 2  # the shifted windows' mask: one per window, the batch B * WINDOWS windows


def _normalized(name: str) -> list:
    """``F.normalize(name, dim=-1)``: ``name / max(||name||_2, 1e-12)`` into ``{name}n``."""
    return [
        ("ReduceL2", [name, "last"], [f"{name}_norm"], {"keepdims": 1}),
        ("Max", [f"{name}_norm", "eps"], [f"{name}_clamped"], {}),
        ("Div", [name, f"{name}_clamped"], [f"{name}n"], {}),
    ]


def _cosine(scale: list, inputs: dict, inits: dict, after: list = ()):
    """``normalize(q) @ normalize(k)^T``, the nodes ``scale`` (from ``raw`` into ``scaled``),
    the nodes ``after`` (from ``scaled`` into ``scores``), Softmax, ``@ v``."""
    nodes = [
        *_normalized("q"),
        *_normalized("k"),
        ("Transpose", ["kn"], ["knt"], {"perm": [0, 1, 3, 2]}),
        ("MatMul", ["qn", "knt"], ["raw"], {}),
        *scale,
        *(after or [("Identity", ["scaled"], ["scores"], {})]),
        ("Softmax", ["scores"], ["p"], {"axis": -1}),
        ("MatMul", ["p", "v"], ["y"], {}),
    ]
    inits = {"last": np.array([-1], np.int64), "eps": np.float32(1e-12), **inits}
    return make_model(nodes, inputs, {"y": (F, None)}, inits, opset=20)


def _inputs(batch: int = B, **more) -> dict:
    return {n: (F, (batch, N, S, H)) for n in "qkv"} | more


def _feeds(rng, inputs: dict) -> dict:
    return {n: rng.standard_normal(s).astype(np.float32) for n, (_, s) in inputs.items()}


def _fused(model, feeds, target: str = "onnx"):
    """Optimize ``model``: one Attention, no Softmax, exact on ONNX Runtime; the Attention."""
    (before,) = run(model, feeds)
    report = fusion.optimize(model, target=target)
    assert report.counts["sdpa_fused"] == 1, report.refused
    assert "Softmax" not in ops(model), ops(model)
    fusion.check(model)
    assert_close(run(model, feeds), [before])
    (node,) = [n for n in model.graph if n.op_type == "Attention"]
    return node


def _head_scale(node) -> np.ndarray:
    """The constant of the Mul that makes the Attention's ``Q``."""
    mul = node.inputs[0].producer()
    assert mul.op_type == "Mul", mul
    return mul.inputs[1].const_value.numpy()


def _swinv2(rng, target: str) -> tuple[np.ndarray, np.ndarray]:
    """SwinV2's window attention: the logit scale clamped at log(100) and exponentiated (folded
    to a constant by the clean-up), the relative position bias, the shifted windows' mask added
    through a 5-D view of the scores; fused (:func:`_fused`). The scale the Mul on Q holds,
    and the one the formula gives."""
    logit = rng.uniform(-1.0, 6.0, (N, 1, 1)).astype(np.float32)  # some above log(100)
    inits = {
        "logit_scale": logit,
        "log100": np.float32(math.log(100)),
        "bias": rng.standard_normal((1, N, S, S)).astype(np.float32),
        "windows": np.array([-1, WINDOWS, N, S, S], np.int64),
        "mask": np.where(rng.random((1, WINDOWS, 1, S, S)) > 0.3, 0, -100).astype(np.float32),
        "heads": np.array([-1, N, S, S], np.int64),
    }
    scale = [
        ("Min", ["logit_scale", "log100"], ["clamped"], {}),
        ("Exp", ["clamped"], ["logit"], {}),
        ("Mul", ["raw", "logit"], ["scaled"], {}),
    ]
    after = [
        ("Add", ["scaled", "bias"], ["biased"], {}),
        ("Reshape", ["biased", "windows"], ["five"], {}),
        ("Add", ["five", "mask"], ["masked"], {}),
        ("Reshape", ["masked", "heads"], ["scores"], {}),
    ]
    inputs = _inputs(B * WINDOWS)
    model = _cosine(scale, inputs, inits, after)
    node = _fused(model, _feeds(rng, inputs), target)
    return _head_scale(node), np.exp(np.minimum(logit, math.log(100)))


@pytest.mark.parametrize("target", ["onnx", "ort"])
def test_swinv2_cosine_attention_takes_the_logit_scale_into_q(rng, target):
    moved, expected = _swinv2(rng, target)
    np.testing.assert_allclose(moved, expected)


XCA = {  # the temperature on the scores: Mul either way round, Div, with a number beside it
    "mul": ([("Mul", ["raw", "t"], ["scaled"], {})], 1.0),
    "mul_first": ([("Mul", ["t", "raw"], ["scaled"], {})], 1.0),
    "div": ([("Div", ["raw", "t"], ["scaled"], {})], 1.0),
    "and_a_number": (
        [("Mul", ["raw", "t"], ["ts"], {}), ("Mul", ["ts", "half"], ["scaled"], {})],
        0.5,
    ),
}


@pytest.mark.parametrize("form", XCA)
def test_xca_temperature_of_either_sign_moves_into_q(rng, form):
    """EdgeNeXt's XCA: q, k, v (B, N, C, L), scores over the channels scaled by a temperature
    per head, here of either sign: the sign goes into Q, the op's scale stays the number."""
    nodes, number = XCA[form]
    temperature = rng.standard_normal((N, 1, 1)).astype(np.float32)
    temperature[0] = -abs(temperature[0]) - 0.5
    inits = {"t": temperature, "half": np.float32(0.5)}
    node = _fused(_cosine(nodes, _inputs(), inits), _feeds(rng, _inputs()))
    assert node.attributes.get_float("scale") == number
    expected = 1 / temperature if form == "div" else temperature
    np.testing.assert_allclose(_head_scale(node), expected, rtol=1e-6)


def test_heads_in_the_batch_take_a_scale_per_batch_and_head(rng):
    """A 3-D attention (B * N, S, H) with a constant (B * N, 1, 1) on its scores."""
    inputs = {n: (F, (B * N, S, H)) for n in "qkv"}
    nodes = [
        ("Transpose", ["k"], ["kt"], {"perm": [0, 2, 1]}),
        ("MatMul", ["q", "kt"], ["raw"], {}),
        ("Mul", ["raw", "t"], ["scores"], {}),
        ("Softmax", ["scores"], ["p"], {"axis": -1}),
        ("MatMul", ["p", "v"], ["y"], {}),
    ]
    t = rng.standard_normal((B * N, 1, 1)).astype(np.float32)
    model = make_model(nodes, inputs, {"y": (F, None)}, {"t": t}, opset=20)
    node = _fused(model, _feeds(rng, inputs))
    np.testing.assert_array_equal(_head_scale(node), t)


def _outcome(model) -> tuple[int, bool, list]:
    """Optimize ``model``: the attentions fused, whether a Softmax is left, the attention
    family's refusal codes."""
    report = fusion.optimize(model, target="onnx")
    return report.counts["sdpa_fused"], "Softmax" in ops(model), report.codes("attention")


def _scaled_by(shape, rng, inputs=None, values=None, before=()):
    """The cosine attention, its scores scaled by ``t``: a constant of ``shape`` (random, or
    ``values``), an input where ``inputs`` has it; the nodes ``before`` on ``raw`` first."""
    t = rng.standard_normal(shape).astype(np.float32) if values is None else values
    inits = {"m": rng.standard_normal((1, N, S, S)).astype(np.float32)}
    inits |= {} if "t" in (inputs or {}) else {"t": t}
    scale = [*before, ("Mul", [before[-1][2][0] if before else "raw", "t"], ["scaled"], {})]
    return _cosine(scale, inputs or _inputs(), inits)


INFINITE = np.array([1, np.inf, 2], np.float32).reshape(N, 1, 1)
MASKED = [("Add", ["raw", "m"], ["masked"], {})]
LOOK_ALIKES = {
    "a scale per query row": ({"shape": (1, 1, S, 1)}, Code.SCALE_NOT_SCALAR),
    "per head and query row": ({"shape": (N, S, 1)}, Code.SCALE_NOT_SCALAR),
    "per key": ({"shape": (S,)}, Code.SCALE_NOT_SCALAR),
    "per batch": ({"shape": (B, 1, 1, 1)}, Code.SCALE_NOT_SCALAR),
    "per head of a one-head attention (it broadcasts the scores)": (
        {"shape": (N, 1, 1), "inputs": {n: (F, (B, 1, S, H)) for n in "qkv"}},
        Code.SCALE_NOT_SCALAR,
    ),
    "per head, computed at run time": (
        {"shape": (N, 1, 1), "inputs": _inputs(t=(F, (N, 1, 1)))},
        Code.NOT_CONSTANT,
    ),
    "per head, a head's infinite": ({"shape": None, "values": INFINITE}, Code.SCALE_NOT_POSITIVE),
    "per head, a mask added under it": ({"shape": (N, 1, 1), "before": MASKED}, Code.SCORES_FORM),
}


@pytest.mark.parametrize("case", LOOK_ALIKES)
def test_other_scales_stay_refused(rng, case):
    kwargs, code = LOOK_ALIKES[case]
    assert _outcome(_scaled_by(rng=rng, **kwargs)) == (0, True, [code])
