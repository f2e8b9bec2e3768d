"""The float64 oracle of an ONNX graph (:func:`normexport.verdict.oracle.onnx_float64`) on
ONNX Runtime: widened, with float32 islands where there is no float64 kernel, mended where a
node fails, and never the end of a run. The float64 forms: ``test_oracle_forms.py``.

Graphs are built node by node with random weights and statistics; each oracle is compared with
an exact numpy computation in float64, and with the graph as written in float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from normexport import pipeline, runtime
from normexport.io import files
from normexport.verdict import float64, oracle
from tests.support.graphs import make_model

F = TensorProto.FLOAT


def _save(model: ir.Model, tmp_path: Path) -> Path:
    path = tmp_path / "given" / "m.onnx"
    path.parent.mkdir(parents=True)
    ir.save(model, path)
    return path


def _oracle(model: ir.Model, tmp_path: Path, feeds: dict) -> oracle.Oracle:
    path = _save(model, tmp_path)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    (tmp_path / "work").mkdir(parents=True)
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
    """Conv -> BatchNormalization (opset 11); with ``momentum`` written, as Paddle's exporter
    writes it in inference models."""
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
    epsilon = np.float64(np.float32(1e-5))  # as the model holds it
    return (h - mean) / np.sqrt(var + epsilon) * per_channel[0] + per_channel[1]


@pytest.mark.parametrize("momentum", [False, True])
def test_conv_and_batchnorm_in_float64_on_onnx_runtime(rng, tmp_path, momentum):
    """No float64 Conv in ONNX Runtime's CPU provider: its float64 form runs in its place (the
    notes say so), and a BatchNormalization with ``momentum`` written is still inference
    mode; nothing runs in float32."""
    model, weights = _conv_bn_model(rng, momentum)
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    found = _oracle(model, tmp_path, {"x": x})
    assert found.kind == "onnx_float64" and "on ONNX Runtime" in found.notes[0], found.notes
    assert "1 Conv" in found.notes[1] and not found.float32
    assert "[ONNXRuntimeError]" not in " ".join(found.notes)
    (y,) = found.run({"x": x})
    assert np.abs(y - _conv_bn_exact(x, weights)).max() < 1e-12


def test_erf_and_a_gather_along_an_axis_over_64_long(rng, tmp_path):
    """A BERT export's token types: GatherElements of a (1, 300) buffer by (1, 200) indices,
    beside an Erf (its float64 form), with the tensors in external data as torch writes them
    (the int64 ones are not widened, and stay there)."""
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
    assert found.kind == "onnx_float64" and "on ONNX Runtime" in found.notes[0], found.notes
    (y,) = found.run({"x": x})
    erf = np.vectorize(math.erf)(x.astype(np.float64))
    exact = erf + weights["buffer"].astype(np.float64)[0, weights["ids"]]
    assert np.abs(y - exact).max() < 1e-15 * 4


@pytest.mark.parametrize("norm", ["LayerNormalization", "RMSNormalization"])
def test_norms_compute_in_float64(rng, tmp_path, norm):
    """A 1x1 Conv then a norm over the last axis, on inputs of 1e3: float64 statistics
    (stash_type 11), where float32's would be ~1e-4 off."""
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
    assert found.kind == "onnx_float64" and "on ONNX Runtime" in found.notes[0], found.notes
    (y,) = found.run({"x": x})
    h = np.einsum("nchw,oc->nohw", x.astype(np.float64), weights["w"][:, :, 0, 0])
    if norm == "LayerNormalization":
        h = h - h.mean(-1, keepdims=True)
    exact = h / np.sqrt(np.square(h).mean(-1, keepdims=True) + 1e-5) * weights["scale"]
    exact += weights["bias"] if norm == "LayerNormalization" else 0
    assert np.abs(y - exact).max() < 1e-10


def test_float_only_inputs_are_cast_back(rng, tmp_path):
    """A Resize of uint8 data: its scales admit float32 only, and its output is not float, so
    the scales are cast back and the node runs as it is; the rest is float64."""
    nodes = [
        ("Cast", ["x"], ["q"], {"to": TensorProto.UINT8}),
        ("Resize", ["q", "", "scales"], ["r"], {"mode": "nearest"}),
        ("Cast", ["r"], ["f"], {"to": F}),
        ("Mul", ["f", "k"], ["y"], {}),
    ]
    weights = {"k": np.array(1 / 3, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)}
    model = make_model(nodes, {"x": (F, [1, 3, 2, 2])}, {"y": (F, [1, 3, 4, 4])}, weights)
    x = rng.uniform(0, 200, (1, 3, 2, 2)).astype(np.float32)
    found = _oracle(model, tmp_path, {"x": x})
    assert found.kind == "onnx_float64" and not found.float32, found.notes
    (y,) = found.run({"x": x})
    q = x.astype(np.uint8).astype(np.float64).repeat(2, axis=2).repeat(2, axis=3)
    assert y.dtype == np.float64 and np.abs(y - q * np.float64(weights["k"])).max() < 1e-13


def test_an_oracle_that_disagrees_with_the_file_is_not_used(rng, tmp_path, monkeypatch):
    """A conversion that changes the function (here: the bias moved by 1) fails the self-check
    against the file run as written, and the oracle falls back with the reason."""
    model, _ = _layernorm_model(rng)
    real = oracle.to_float64

    def wrong(m):
        wide = real(m)
        bias = m.graph.initializers["bias"]
        bias.const_value = ir.tensor(bias.const_value.numpy() + 1, name="bias")
        return wide

    monkeypatch.setattr(oracle, "to_float64", wrong)
    found = _oracle(model, tmp_path, {"x": rng.standard_normal((2, 3, 8)).astype(np.float32)})
    assert found.run is None and "disagrees" in found.notes[0]


def _quantized_model(rng) -> tuple[ir.Model, dict]:
    """What ``quantize_dynamic`` makes of a MatMul, at opset 18: the activation quantized by
    DynamicQuantizeLinear, an int8 weight, MatMulInteger, the scales multiplied back; and an
    embedding table dequantized by DequantizeLinear (no float64 kernel for either)."""
    weights = {
        "wq": rng.integers(-127, 128, (8, 6)).astype(np.int8),
        "w_scale": np.array(0.02, np.float32),
        "w_zero": np.array(0, np.int8),
        "tq": rng.integers(-127, 128, (1, 6)).astype(np.int8),
        "t_scale": np.array(0.05, np.float32),
    }
    nodes = [
        ("DynamicQuantizeLinear", ["x"], ["xq", "x_scale", "x_zero"], {}),
        ("MatMulInteger", ["xq", "wq", "x_zero", "w_zero"], ["acc"], {}),
        ("Cast", ["acc"], ["accf"], {"to": F}),
        ("Mul", ["x_scale", "w_scale"], ["scale"], {}),
        ("Mul", ["accf", "scale"], ["h"], {}),
        ("DequantizeLinear", ["tq", "t_scale"], ["table"], {}),
        ("Add", ["h", "table"], ["y"], {}),
    ]
    return make_model(nodes, {"x": (F, [4, 8])}, {"y": (F, [4, 6])}, weights), weights


def test_a_quantized_graph_runs_with_float32_islands(rng, tmp_path):
    """DynamicQuantizeLinear and DequantizeLinear (opset 18: none on onnx.reference, none in
    float64 on ONNX Runtime) run as written in float32, between casts, and are listed; what
    follows them is float64: the scales' product and the dequantized sum are exact."""
    model, weights = _quantized_model(rng)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    found = _oracle(model, tmp_path, {"x": x})
    assert found.kind == "onnx_float64" and "on ONNX Runtime" in found.notes[0], found.notes
    islands = {f.op_type: f for f in found.float32}
    assert set(islands) == {"DynamicQuantizeLinear", "DequantizeLinear"}
    assert "no float64 kernel" in islands["DequantizeLinear"].why
    assert any("2 DequantizeLinear" in n or "1 DequantizeLinear" in n for n in found.notes)
    (y,) = found.run({"x": x})
    quantize = make_model(
        [("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], {})],
        {"x": (F, [4, 8])},
        {"q": (TensorProto.UINT8, None), "s": (F, None), "z": (TensorProto.UINT8, None)},
    )
    q, scale, zero = runtime.run(runtime.make_session(ir.to_proto(quantize)), {"x": x})
    acc = (q.astype(np.int64) - zero) @ weights["wq"].astype(np.int64)
    exact = acc * (np.float64(scale) * np.float64(weights["w_scale"]))
    table = weights["tq"].astype(np.float32) * weights["t_scale"]  # the island: float32
    assert np.abs(y - (exact + table)).max() < 1e-14


def _lstm_in_if_model(rng, hidden: int = 4) -> tuple[ir.Model, dict]:
    """A voice-activity-like graph: an LSTM with state inputs inside an ``If`` on the sample
    rate (the else branch a plain MatMul), as spox writes it."""
    weights = {
        "W": rng.standard_normal((1, 4 * hidden, 3)).astype(np.float32) * 0.5,
        "R": rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32) * 0.5,
        "B": rng.standard_normal((1, 8 * hidden)).astype(np.float32) * 0.1,
        "proj": rng.standard_normal((3, hidden)).astype(np.float32),
        "rate": np.array(16000, np.int64),
    }
    lstm = helper.make_graph(
        [
            helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["Y", "Yh", "Yc"],
                             hidden_size=hidden),
            helper.make_node("Add", ["Yh", "Yc"], ["then_out"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", F, None)],
    )  # fmt: skip
    plain = helper.make_graph(
        [helper.make_node("MatMul", ["x", "proj"], ["else_out"])],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", F, None)],
    )
    nodes = [
        ("Equal", ["sr", "rate"], ["is16k"], {}),
        ("If", ["is16k"], ["y"], {"then_branch": lstm, "else_branch": plain}),
    ]
    inputs = {
        "x": (F, [2, 1, 3]),
        "h0": (F, [1, 1, hidden]),
        "c0": (F, [1, 1, hidden]),
        "sr": (TensorProto.INT64, []),
    }
    return make_model(nodes, inputs, {"y": (F, None)}, weights, opset=16), weights


@pytest.mark.parametrize("known", [True, False])
def test_an_lstm_inside_an_if_runs_on_onnx_runtime(rng, tmp_path, monkeypatch, known):
    """ONNX Runtime loads a float64 LSTM and then refuses to run it ("does not support double
    yet"): it is a float32 island from the start (``REFUSED``), or, where that were not known,
    once its first run fails, named with ONNX Runtime's reason; the graph runs on ONNX Runtime
    on every input set, either branch (onnx.reference's LSTM failed on such state inputs)."""
    if not known:
        monkeypatch.setattr(float64, "REFUSED", frozenset())
    model, _ = _lstm_in_if_model(rng)
    feeds = {
        "x": rng.standard_normal((2, 1, 3)).astype(np.float32),
        "h0": rng.standard_normal((1, 1, 4)).astype(np.float32),
        "c0": rng.standard_normal((1, 1, 4)).astype(np.float32),
        "sr": np.array(16000, np.int64),
    }
    path = _save(model, tmp_path)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    (tmp_path / "work").mkdir()
    as_written = lambda f: runtime.run(session, f)  # noqa: E731
    found = oracle.onnx_float64(path, as_written, feeds, tmp_path / "work", "the input graph")
    assert found.kind == "onnx_float64" and "on ONNX Runtime" in found.notes[0], found.notes
    (lstm,) = found.float32
    why = "no float64 kernel" if known else "does not support double yet"
    assert lstm.op_type == "LSTM" and why in lstm.why, lstm.why
    for sr in (16000, 8000):
        other = {**feeds, "x": rng.standard_normal((2, 1, 3)).astype(np.float32)}
        other["sr"] = np.array(sr, np.int64)
        (y,) = found.run(other)
        (written,) = as_written(other)
        assert y.dtype == np.float64 and np.abs(y - written).max() < 1e-5
    assert not any("file as written" in n for n in found.notes)


def _skip_norm_model(rng) -> ir.Model:
    """ONNX Runtime's SkipLayerNormalization (com.microsoft: float32 and float16 kernels only)
    between float64 Muls."""
    nodes = [
        ("Mul", ["x", "k"], ["h"], {}),
        ("SkipLayerNormalization", ["h", "x", "gamma", "beta"], ["g"], {"domain": "com.microsoft"}),
        ("Mul", ["g", "k"], ["y"], {}),
    ]
    weights = {
        "k": np.array(1 / 3, np.float32),
        "gamma": rng.uniform(0.5, 1.5, 5).astype(np.float32),
        "beta": rng.standard_normal(5).astype(np.float32),
    }
    return make_model(nodes, {"x": (F, [2, 3, 5])}, {"y": (F, [2, 3, 5])}, weights)


def test_a_contrib_op_with_no_float64_kernel_is_an_island(rng, tmp_path):
    """A contrib op is probed like any other: SkipLayerNormalization runs as written in float32
    (its output type from ONNX Runtime's own schema), the Muls around it in float64."""
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    model = _skip_norm_model(rng)
    weights = {k: v.const_value.numpy() for k, v in model.graph.initializers.items()}
    found = _oracle(model, tmp_path, {"x": x})
    (skip,) = found.float32
    assert (skip.op_type, skip.domain) == ("SkipLayerNormalization", "com.microsoft")
    assert "no float64 kernel" in skip.why and len(skip.nodes) == 1
    (y,) = found.run({"x": x})
    third = np.float64(weights["k"])
    h = (x.astype(np.float64) * third).astype(np.float32)  # the island's input, cast
    alone = make_model(
        [
            (
                "SkipLayerNormalization",
                ["h", "x", "gamma", "beta"],
                ["g"],
                {"domain": "com.microsoft"},
            )
        ],
        {"h": (F, [2, 3, 5]), "x": (F, [2, 3, 5])},
        {"g": (F, None)},
        {"gamma": weights["gamma"], "beta": weights["beta"]},
    )
    (g,) = runtime.run(runtime.make_session(ir.to_proto(alone)), {"h": h, "x": x})
    assert np.abs(y - g.astype(np.float64) * third).max() < 1e-15


def test_a_node_onnx_runtime_cannot_load_is_made_an_island(rng, tmp_path, monkeypatch):
    """Where the probe is wrong (here: made to say every node loads), the node ONNX Runtime
    names as it loads the whole graph becomes an island and the graph is built again; with no
    repairs left, the oracle falls back and says why."""
    monkeypatch.setattr(float64, "_kernel", lambda wide, node: True)
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    found = _oracle(_skip_norm_model(rng), tmp_path / "a", {"x": x})
    (skip,) = found.float32
    assert skip.op_type == "SkipLayerNormalization" and "could not load" in skip.why, skip.why
    assert any("SkipLayerNormalization made a float32 island" in n for n in found.notes)
    monkeypatch.setattr(oracle, "REPAIRS", 0)
    found = _oracle(_skip_norm_model(rng), tmp_path / "b", {"x": x})
    assert found.run is None and "SkipLayerNormalization" in found.notes[0], found.notes


def test_an_input_set_the_float64_graph_fails_on_gets_the_file_as_written(
    rng, tmp_path, monkeypatch
):
    """A float64 run that fails on an input set after the example, naming no node that can be
    made an island: that set's oracle is the file as written (in float64), the notes say so,
    and the run goes on (the next set is float64 again)."""
    model, weights = _layernorm_model(rng)
    path = _save(model, tmp_path)
    written = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    real, calls = runtime.run, []

    def failing(session, feeds, **kw):
        calls.append(session)
        if len(calls) == 2:
            raise RuntimeError("no kernel for this input set")
        return real(session, feeds, **kw)

    (tmp_path / "work").mkdir()
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    monkeypatch.setattr(runtime, "run", failing)
    found = oracle.onnx_float64(
        path, lambda f: real(written, f), {"x": x}, tmp_path / "work", "the input graph"
    )
    assert found.kind == "onnx_float64" and len(calls) == 1
    other = {"x": rng.standard_normal((2, 3, 8)).astype(np.float32)}
    (y,) = found.run(other)
    assert y.dtype == np.float64 and np.array_equal(y, real(written, other)[0])
    assert "no kernel for this input set" in found.notes[-1]
    assert "the oracle there is the file as written" in found.notes[-1]
    (again,) = found.run({"x": x})
    assert np.abs(again - _layernorm_exact(x, weights)).max() < 1e-10


@pytest.mark.slow
def test_the_report_lists_the_float32_islands(rng, tmp_path):
    """Through the pipeline (an ONNX file with a quantized MatMul, a dequantized table and a
    FastGelu): a verdict (no internal error), the oracle ``onnx_float64``, and
    ``oracle_float32`` naming each island's op, its nodes and why."""
    model, _ = _quantized_model(rng)
    path = _save(model, tmp_path)
    options = pipeline.Options(model=path, output=tmp_path / "out.onnx", benchmark=False)
    parity = pipeline.run(options).to_dict()["parity"]
    assert parity["oracle"] == "onnx_float64", parity["oracle_notes"]
    listed = {entry["op_type"]: entry for entry in parity["oracle_float32"]}
    assert set(listed) == {"DynamicQuantizeLinear", "DequantizeLinear"}
    assert listed["DequantizeLinear"]["nodes"] and listed["DequantizeLinear"]["domain"] == ""
    assert "no float64 kernel" in listed["DequantizeLinear"]["why"]


def test_the_oracle_runs_once_per_input_set_where_the_rewrite_is_within_rounding(
    rng, tmp_path, monkeypatch
):
    """Through the pipeline, a graph whose rewrite is exact: the float64 oracle runs once on
    each input set (the example's run is its self-check's), not again on the sets moved by one ulp
    (that run decides nothing where the noise ratio is within the warning; ``check_parity``
    runs it where it could: ``test_parity.py``)."""
    model, _ = _layernorm_model(rng)
    path = _save(model, tmp_path)
    real, ran = oracle._widen, []

    def counted(feeds):  # the float64 graph's feeds, made once per run
        ran.append(feeds)
        return real(feeds)

    monkeypatch.setattr(oracle, "_widen", counted)
    options = pipeline.Options(model=path, output=tmp_path / "out.onnx", benchmark=False)
    parity = pipeline.run(options).to_dict()["parity"]
    assert parity["oracle"] == "onnx_float64" and parity["passed"], parity["oracle_notes"]
    assert len(ran) == len(parity["probes"]), len(ran)


def test_the_float64_session_runs_on_one_intra_op_thread(rng, tmp_path):
    """The oracle's float64 session has one intra-op thread (``oracle.THREADS``: faster than
    ONNX Runtime's default of one per core on the Conv forms' memory traffic)."""
    model, _ = _layernorm_model(rng)
    found = _oracle(model, tmp_path, {"x": rng.standard_normal((2, 3, 8)).astype(np.float32)})
    assert found.kind == "onnx_float64", found.notes
    options = found.run.session.open().get_session_options()
    assert options.intra_op_num_threads == oracle.THREADS == 1
