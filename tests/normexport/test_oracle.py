"""The float64 oracle of an ONNX graph (:func:`normexport.verdict.oracle.onnx_float64`).

Graphs are built node by node with random weights and statistics; each oracle is compared with
an exact numpy computation in float64, and with the graph as written in float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

from normexport import runtime
from normexport.io import files
from normexport.verdict import oracle
from tests.support.graphs import make_model

F = TensorProto.FLOAT


def _save(model: ir.Model, tmp_path: Path) -> Path:
    path = tmp_path / "given" / "m.onnx"
    path.parent.mkdir()
    ir.save(model, path)
    return path


def _oracle(model: ir.Model, tmp_path: Path, feeds: dict) -> oracle.Oracle:
    path = _save(model, tmp_path)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    (tmp_path / "work").mkdir()
    return oracle.onnx_float64(
        path, lambda f: runtime.run(session, f), feeds, tmp_path / "work", "the input graph"
    )


def _layernorm_model(rng, d: int = 8) -> tuple[ir.Model, dict]:
    """MatMul -> LayerNormalization (no stash_type: float32 statistics as written)."""
    weights = {
        "w": rng.standard_normal((d, d)).astype(np.float32),
        "scale": rng.uniform(0.5, 1.5, d).astype(np.float32),
        "bias": rng.standard_normal(d).astype(np.float32),
    }
    nodes = [
        ("MatMul", ["x", "w"], ["h"], {}),
        ("LayerNormalization", ["h", "scale", "bias"], ["y"], {"epsilon": 1e-5}),
    ]
    model = make_model(nodes, {"x": (F, [2, 3, d])}, {"y": (F, [2, 3, d])}, weights)
    return model, weights


@pytest.mark.parametrize("inline_bytes", [oracle.INLINE_BYTES, 0])
def test_float64_graph_with_external_data_in_one_protobuf_or_written(
    rng, tmp_path, monkeypatch, inline_bytes
):
    """A float16 model's oracle widens little: its graph opens from one protobuf, its float16
    weights read from the model's own external data file, and nothing is written; with no room
    for that (``INLINE_BYTES`` 0), the float64 model is written to the work folder. Same
    outputs either way."""
    monkeypatch.setattr(oracle, "INLINE_BYTES", inline_bytes)
    d = 64
    weights = {
        "w": rng.standard_normal((d, d)).astype(np.float16),
        "scale": rng.uniform(0.5, 1.5, d).astype(np.float32),
    }
    nodes = [
        ("MatMul", ["x", "w"], ["h"], {}),
        ("Cast", ["h"], ["h32"], {"to": ir.DataType.FLOAT}),
        ("Mul", ["h32", "scale"], ["y"], {}),
    ]
    f16 = ir.DataType.FLOAT16
    model = make_model(nodes, {"x": (f16, [2, d])}, {"y": (F, [2, d])}, weights)
    path = tmp_path / "given" / "m.onnx"
    path.parent.mkdir()
    files.save_model(model, path, external_data=True)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    x = rng.standard_normal((2, d)).astype(np.float16)
    (tmp_path / "work").mkdir()
    found = oracle.onnx_float64(
        path, lambda f: runtime.run(session, f), {"x": x}, tmp_path / "work", "the input graph"
    )
    assert found.kind == "onnx_float64", found.notes
    (y,) = found.run({"x": x})
    h = (x.astype(np.float64) @ weights["w"].astype(np.float64)).astype(np.float16)
    np.testing.assert_allclose(y, h.astype(np.float64) * weights["scale"], rtol=2e-3)
    written = sorted(p.name for p in (tmp_path / "work").iterdir())
    expected = ["oracle_float64.onnx", "oracle_float64.onnx.data"] if not inline_bytes else []
    assert written == expected


def _layernorm_exact(x, w) -> np.ndarray:
    h = x.astype(np.float64) @ w["w"].astype(np.float64)
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    return h * w["scale"] + w["bias"]


def test_float64_on_onnx_runtime_is_exact(rng, tmp_path):
    model, weights = _layernorm_model(rng)
    x = (rng.standard_normal((2, 3, 8)) * 1e3).astype(np.float32)
    found = _oracle(model, tmp_path, {"x": x})
    assert found.kind == "onnx_float64" and "ONNX Runtime" in found.notes[0]
    (y,) = found.run({"x": x})
    assert y.dtype == np.float64
    exact = _layernorm_exact(x, weights)
    # float64 statistics (stash_type widened too): ~1e-13, where float32 is ~1e-6 off
    assert np.abs(y - exact).max() < 1e-10


def _conv_bn_model(rng, momentum: bool) -> tuple[ir.Model, dict]:
    """Conv -> BatchNormalization (opset 11), which ONNX Runtime's CPU provider cannot run in
    float64; with ``momentum`` written, as Paddle's exporter writes it in inference models."""
    c = 4
    weights = {
        "w": rng.standard_normal((c, 3, 3, 3)).astype(np.float32),
        "scale": rng.uniform(0.5, 1.5, c).astype(np.float32),
        "b": rng.standard_normal(c).astype(np.float32),
        "mean": rng.standard_normal(c).astype(np.float32),
        "var": rng.uniform(0.3, 3, c).astype(np.float32),
    }
    attrs = {"epsilon": 1e-5, **({"momentum": 0.9} if momentum else {})}
    nodes = [
        ("Conv", ["x", "w"], ["h"], {"pads": [1, 1, 1, 1]}),
        ("BatchNormalization", ["h", "scale", "b", "mean", "var"], ["y"], attrs),
    ]
    shapes = {"x": (F, [2, 3, 5, 5])}, {"y": (F, [2, c, 5, 5])}
    return make_model(nodes, *shapes, weights, opset=11), weights


def _conv_bn_exact(x, w) -> np.ndarray:
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))
    h = np.einsum("nchwij,ocij->nohw", windows, w["w"].astype(np.float64))
    per_channel = [w[k].astype(np.float64)[None, :, None, None] for k in ("scale", "b")]
    mean, var = (w[k].astype(np.float64)[None, :, None, None] for k in ("mean", "var"))
    return (h - mean) / np.sqrt(var + 1e-5) * per_channel[0] + per_channel[1]


@pytest.mark.parametrize("momentum", [False, True])
def test_float64_falls_back_to_onnx_reference(rng, tmp_path, momentum):
    """No float64 Conv in ONNX Runtime's CPU provider: onnx.reference runs the graph, and a
    BatchNormalization with ``momentum`` written is still inference mode."""
    model, weights = _conv_bn_model(rng, momentum)
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    found = _oracle(model, tmp_path, {"x": x})
    assert found.kind == "onnx_float64", found.notes
    assert "Conv" in found.notes[0] and "onnx.reference" in found.notes[1]
    assert "[ONNXRuntimeError]" not in found.notes[0], found.notes  # ORT's status, in words
    (y,) = found.run({"x": x})
    assert np.abs(y - _conv_bn_exact(x, weights)).max() < 1e-10


def test_onnx_reference_gathers_along_an_axis_over_64_long(rng, tmp_path):
    """A BERT export's token types: GatherElements of a (1, 300) buffer by (1, 200) indices,
    after an Erf (no float64 Erf in ONNX Runtime's CPU provider: onnx.reference runs it), with
    the tensors in external data as torch writes them (the int64 ones are not widened, and
    stay there)."""
    weights = {
        "buffer": rng.standard_normal((1, 300)).astype(np.float32),
        "ids": rng.integers(0, 300, (1, 200)).astype(np.int64),
    }
    nodes = [
        ("Erf", ["x"], ["e"], {}),
        ("GatherElements", ["buffer", "ids"], ["g"], {"axis": 1}),
        ("Add", ["e", "g"], ["y"], {}),
    ]
    model = make_model(nodes, {"x": (F, [1, 200])}, {"y": (F, [1, 200])}, weights)
    path = tmp_path / "given" / "m.onnx"
    path.parent.mkdir()
    files.save_model(model, path, external_data=True)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    (tmp_path / "work").mkdir()
    x = rng.standard_normal((1, 200)).astype(np.float32)
    found = oracle.onnx_float64(
        path, lambda f: runtime.run(session, f), {"x": x}, tmp_path / "work", "the input graph"
    )
    assert found.kind == "onnx_float64" and "onnx.reference" in found.notes[1], found.notes
    (y,) = found.run({"x": x})
    erf = np.vectorize(math.erf)(x.astype(np.float64))
    exact = erf + weights["buffer"].astype(np.float64)[0, weights["ids"]]
    # onnx.reference's Erf is good to ~1e-8; a wrong gather is O(1) off
    assert np.abs(y - exact).max() < 1e-6


@pytest.mark.parametrize("norm", ["LayerNormalization", "RMSNormalization"])
def test_onnx_reference_norms_compute_in_float64(rng, tmp_path, norm):
    """A 1x1 Conv (no float64 Conv in ONNX Runtime's CPU provider: onnx.reference runs the
    graph) then a norm over the last axis, on inputs of 1e3: float64 statistics (stash_type
    11), where float32's would be ~1e-4 off."""
    weights = {
        "w": rng.standard_normal((6, 3, 1, 1)).astype(np.float32),
        "scale": rng.uniform(0.5, 1.5, 4).astype(np.float32),
        "bias": rng.standard_normal(4).astype(np.float32),
    }
    inputs = ["h", "scale", "bias"] if norm == "LayerNormalization" else ["h", "scale"]
    nodes = [
        ("Conv", ["x", "w"], ["h"], {}),
        (norm, inputs, ["y"], {"epsilon": 1e-5, "axis": -1}),
    ]
    shapes = {"x": (F, [2, 3, 4, 4])}, {"y": (F, [2, 6, 4, 4])}
    model = make_model(nodes, *shapes, weights, opset=23)
    x = (rng.standard_normal((2, 3, 4, 4)) * 1e3 + 5e3).astype(np.float32)
    found = _oracle(model, tmp_path, {"x": x})
    assert found.kind == "onnx_float64" and "onnx.reference" in found.notes[1], found.notes
    (y,) = found.run({"x": x})
    h = np.einsum("nchw,oc->nohw", x.astype(np.float64), weights["w"][:, :, 0, 0])
    if norm == "LayerNormalization":
        h = h - h.mean(-1, keepdims=True)
    exact = h / np.sqrt(np.square(h).mean(-1, keepdims=True) + 1e-5) * weights["scale"]
    exact += weights["bias"] if norm == "LayerNormalization" else 0
    assert np.abs(y - exact).max() < 1e-10


def test_float_only_inputs_are_cast_back(rng, tmp_path):
    """``Resize``'s scales admit float32 only: the oracle casts them back, and runs."""
    nodes = [
        ("Mul", ["x", "k"], ["h"], {}),
        ("Resize", ["h", "", "scales"], ["y"], {"mode": "nearest"}),
    ]
    weights = {
        "k": rng.uniform(0.5, 2, (1, 3, 1, 1)).astype(np.float32),
        "scales": np.array([1, 1, 2, 2], np.float32),
    }
    model = make_model(nodes, {"x": (F, [1, 3, 2, 2])}, {"y": (F, [1, 3, 4, 4])}, weights)
    x = rng.standard_normal((1, 3, 2, 2)).astype(np.float32)
    found = _oracle(model, tmp_path, {"x": x})
    assert found.kind == "onnx_float64", found.notes
    (y,) = found.run({"x": x})
    exact = (x.astype(np.float64) * weights["k"]).repeat(2, axis=2).repeat(2, axis=3)
    assert y.dtype == np.float64 and np.abs(y - exact).max() < 1e-12


def test_an_oracle_that_disagrees_with_the_file_is_not_used(rng, tmp_path, monkeypatch):
    """A conversion that changes the function (here: the bias moved by 1) fails the self-check
    against the file run as written, and the oracle falls back with the reason."""
    model, _ = _layernorm_model(rng)
    real = oracle.to_float64

    def wrong(m):
        real(m)
        bias = m.graph.initializers["bias"]
        bias.const_value = ir.tensor(bias.const_value.numpy() + 1, name="bias")

    monkeypatch.setattr(oracle, "to_float64", wrong)
    found = _oracle(model, tmp_path, {"x": rng.standard_normal((2, 3, 8)).astype(np.float32)})
    assert found.run is None and "disagrees" in found.notes[0]
