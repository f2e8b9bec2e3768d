"""Files written by other frameworks' exporters, as users bring them: tf2onnx (Keras),
jax2onnx (Flax NNX) and paddle2onnx (Paddle), made by ``tools/make_exporter_files.py`` and
committed (``tests/data/exporters``, ``versions.json`` there gives the versions), so that the
suite needs none of the frameworks.

Each runs through the main job from another folder, its output written elsewhere: every
BatchNorm folded, every LayerNorm and RMSNorm one op, every GELU one op, parity passed; and the
published model, run on ONNX Runtime, gives the framework's own output for the input saved
beside the file (``NAME.ref.npz``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import normexport
from normexport.runtime import make_session, run

pytestmark = pytest.mark.slow  # the whole main job on each file

DATA = Path(__file__).resolve().parents[1] / "data" / "exporters"

#: Per file: the fusion counts it must show (at least), and the ops that must be gone.
EXPECTED = {
    "keras_cnn.onnx": ({"batchnorm_folded": 1}, ()),
    "keras_mobilenet_block.onnx": ({"batchnorm_folded": 1}, ()),
    "keras_encoder.onnx": (
        {"layernorm_fused": 4, "rmsnorm_fused": 1, "gelu_fused": 2, "attention_fused": 2},
        ("GlobalAveragePool", "Reciprocal", "Tanh", "Erf", "Softmax"),
    ),
    "flax_cnn.onnx": ({"batchnorm_folded": 2}, ("BatchNormalization",)),
    "flax_encoder.onnx": (
        {"layernorm_fused": 3, "rmsnorm_fused": 2, "sdpa_fused": 2},
        ("Sqrt", "Max", "Softmax"),
    ),
    "paddle_cnn.onnx": ({"batchnorm_folded": 2}, ("BatchNormalization",)),
    "paddle_encoder.onnx": ({"gelu_fused": 2, "attention_fused": 2}, ("Erf", "Softmax")),
}
# The same models with a symbolic batch, as users' files have it.
EXPECTED |= {
    "keras_cnn_dynamic.onnx": EXPECTED["keras_cnn.onnx"],
    "keras_encoder_dynamic.onnx": EXPECTED["keras_encoder.onnx"],
    "flax_encoder_dynamic.onnx": EXPECTED["flax_encoder.onnx"],
    "paddle_encoder_dynamic.onnx": EXPECTED["paddle_encoder.onnx"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_an_exporters_file_is_fused_and_exact(name, tmp_path, monkeypatch):
    counts, gone = EXPECTED[name]
    monkeypatch.chdir(tmp_path)  # from another folder than the model's
    out = tmp_path / "out" / name.replace(".onnx", ".opt.onnx")
    report = normexport.optimize(DATA / name, output=out, make_dirs=True, benchmark=False)
    assert report.passed, report.parity.failures()
    found = report.fusions.counts
    assert all(found[kind] >= n for kind, n in counts.items()), found
    ops = {node.op_type for node in onnx.load(out).graph.node}
    assert not ops & set(gone), sorted(ops & set(gone))
    reference = np.load(DATA / name.replace(".onnx", ".ref.npz"))
    feeds = {k.split(":", 1)[1]: v for k, v in reference.items() if k.startswith("input:")}
    expected = [v for k, v in reference.items() if k.startswith("output:")]
    got = run(make_session(out, "cpu"), feeds)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-4 * max(1.0, np.abs(e).max()))
