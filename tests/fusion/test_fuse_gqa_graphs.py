"""FuseGroupQueryAttention on hand-built ONNX graphs (no PyTorch): which attention is its
candidate. The exporter-based cases are in test_fuse_gqa.py (slow).

A cross-attention, queries from ``x`` (B, S, D) and keys and values from ``y`` (B, T, D), T != S,
split into heads by Reshape and Transpose: with no rotation and no mask it is an encoder's (a
UNet's, an encoder-decoder's), no candidate of the pass, and nothing is said of it; masked
causally it is a decoder's, refused with ``shape_mismatch`` (one length for the op without a
past). Every weight is random.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from fusion import Code
from fusion.fuse_gqa import FuseGroupQueryAttention
from tests.support.graphs import assert_close, make_model, ops, run

F = TensorProto.FLOAT
B, S, T, HEADS, SIZE = 2, 6, 9, 2, 8
D = HEADS * SIZE


def _split(name: str, source: str, length: int) -> list[tuple]:
    """``source @ w_name`` split into ``(B, HEADS, length, SIZE)`` heads, named ``name``."""
    return [
        ("MatMul", [source, f"w_{name}"], [f"{name}_flat"], {}),
        ("Reshape", [f"{name}_flat", f"shape_{length}"], [f"{name}_split"], {}),
        ("Transpose", [f"{name}_split"], [name], {"perm": [0, 2, 1, 3]}),
    ]


def _cross_attention(rng: np.random.Generator, causal: bool):
    """The model (``x``, ``y`` in, ``out`` (B, S, D)) and its initializers."""
    inits = {f"w_{n}": rng.normal(size=(D, D)).astype(np.float32) for n in "qkv"}
    for length in (S, T):
        inits[f"shape_{length}"] = np.array([B, length, HEADS, SIZE], np.int64)
    inits["merged"] = np.array([B, S, D], np.int64)
    inits["scale"] = np.array(SIZE**-0.5, np.float32)
    scores = "scaled"
    nodes = [*_split("q", "x", S), *_split("k", "y", T), *_split("v", "y", T)]
    nodes += [
        ("Transpose", ["k"], ["kt"], {"perm": [0, 1, 3, 2]}),
        ("MatMul", ["q", "kt"], ["qk"], {}),
        ("Mul", ["qk", "scale"], ["scaled"], {}),
    ]
    if causal:  # the last S of the T keys: causal over the queries
        inits["mask"] = np.triu(np.full((S, T), -np.inf, np.float32), 1 + T - S)
        nodes.append(("Add", ["scaled", "mask"], ["masked"], {}))
        scores = "masked"
    nodes += [
        ("Softmax", [scores], ["p"], {"axis": -1}),
        ("MatMul", ["p", "v"], ["pv"], {}),
        ("Transpose", ["pv"], ["heads"], {"perm": [0, 2, 1, 3]}),
        ("Reshape", ["heads", "merged"], ["out"], {}),
    ]
    inputs = {"x": (F, (B, S, D)), "y": (F, (B, T, D))}
    return make_model(nodes, inputs, {"out": (F, (B, S, D))}, inits)


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder_causal"])
def test_cross_attention_is_a_candidate_only_in_a_decoder(causal, rng):
    model = _cross_attention(rng, causal)
    feeds = {
        n: rng.normal(size=(B, length, D)).astype(np.float32) for n, length in (("x", S), ("y", T))
    }
    before, op_types = run(model, feeds), ops(model)
    fusion_pass = FuseGroupQueryAttention()
    assert fusion_pass(model).modified is False
    codes = [(r.family, r.code) for r in fusion_pass.outcomes.refused]
    assert codes == ([("gqa", Code.SHAPE_MISMATCH)] if causal else [])
    assert ops(model) == op_types
    assert_close(run(model, feeds), before)
