"""The overflow probe for token-id models (:mod:`normexport.verdict.hidden_probe`): hidden states
fed at the embedding lookup, in graphs built node by node and run on ONNX Runtime, and through the
CLI on an ONNX file of token ids."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

import fusion
from normexport import cli, precision
from normexport.io import files
from normexport.verdict import blocks, hidden_probe
from tests.support.norm_graphs import Graph, layernorm

F, I64 = TensorProto.FLOAT, TensorProto.INT64
IDS = (2, 6)
VOCAB, HIDDEN = 50, 16


def _token_model(rng, *, eps_outside: bool = False, scale: float = 1.0) -> ir.Model:
    """ids -> embedding lookup -> hand-written LayerNorm (fused by normexport; refused with
    ``eps_outside``) times a random weight, masked by ``mask`` -> MatMul. ``scale`` multiplies
    the output weight (a wrong model, for the negative case)."""
    g = Graph()
    g.const("table", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.1)
    g.const("gamma", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    g.const("w_out", (rng.standard_normal((HIDDEN, 4)) * scale).astype(np.float32))
    h = g.node("Gather", ["table", "ids"], "embedding")
    normed = layernorm(g, h, eps_outside=eps_outside)
    h = g.node("Mul", [normed, "gamma"], "scaled")
    mask = g.node("Cast", ["mask"], "mask_f", to=F)
    mask = g.node("Unsqueeze", [mask, g.const("last", np.array([-1], np.int64))], "mask_3d")
    h = g.node("Mul", [h, mask], "masked")
    g.node("MatMul", [h, "w_out"], "y")
    return g.model({"ids": (I64, IDS), "mask": (I64, IDS)}, {"y": (F, [*IDS, 4])})


def _example(rng) -> dict[str, np.ndarray]:
    return {
        "ids": rng.integers(0, VOCAB, IDS).astype(np.int64),
        "mask": (rng.uniform(size=IDS) > 0.2).astype(np.int64),
    }


def test_lookups_are_gathers_of_a_table_by_graph_input_ids(rng):
    model = _token_model(rng)
    (lookup,) = hidden_probe.embedding_lookups(model)
    assert lookup == hidden_probe.Lookup("embedding", "ids", (HIDDEN,), np.dtype(np.float32))
    feeds = hidden_probe.hidden_states([lookup], _example(rng))
    state = feeds["embedding"]
    assert state.shape == (*IDS, HIDDEN) and state.dtype == np.float32
    assert np.abs(state[..., ::8]).min() > 0 and np.abs(state[..., ::8]).max() > 256
    assert np.abs(state[..., 1::8]).max() < 10


def test_cut_makes_the_lookup_a_graph_input(rng, tmp_path):
    src = tmp_path / "m.onnx"
    files.save_model(_token_model(rng), src, external_data=True)
    cut = blocks.cut(src, ["embedding"])
    assert [v.name for v in cut.graph.inputs] == ["mask", "embedding"]
    assert "Gather" not in [n.op_type for n in cut.graph]
    assert "table" not in cut.graph.initializers
    with pytest.raises(ValueError, match="no node computes value 'nothing'"):
        blocks.cut(src, ["nothing"])


def test_probe_copies_no_weights(rng, tmp_path):
    """The cut models run from the graph alone, their weights read from the models' own
    external data files, and so does the float64 oracle where little is widened: the probe
    writes no copy of any model."""
    raw, half, _ = _half(rng, tmp_path)
    probe = tmp_path / "probe"
    result = hidden_probe.compare(raw, half, _example(rng), probe, **_RULE)
    assert result is not None and result.passed, result
    written = sorted(p.name for p in probe.rglob("*") if p.is_file())
    assert written == [], written


def _half(rng, tmp_path, **wrong) -> tuple:
    """The raw model (its LayerNorm look-alike refused by normexport's passes, so that it stays
    float32) and its float16 copy by normexport's converter, as files; ``wrong`` builds the
    copy from another model."""
    raw, half = tmp_path / "raw.onnx", tmp_path / "half.onnx"
    model = _token_model(rng, eps_outside=True)
    files.save_model(model, raw, external_data=True)
    if wrong:
        model = _token_model(np.random.default_rng(0), eps_outside=True, **wrong)
    refused = fusion.optimize(model).refused
    staged = tmp_path / "staged.onnx"
    files.save_model(model, staged, external_data=True)
    report = precision.to_half(
        staged, half, provider="cpu", keep_io_types=False, refused=refused, external_data=True
    )
    return raw, half, report


_RULE = {"provider": "cpu", "precision": "fp16", "atol": 1e-4, "rtol": 1e-3}


def test_probe_passes_a_safe_float16_model(tmp_path):
    raw, half, report = _half(np.random.default_rng(0), tmp_path)
    assert {k.reason for k in report.kept_float32} == {"decomposed_norm"}
    example = _example(np.random.default_rng(1))
    result = hidden_probe.compare(raw, half, example, tmp_path / "probe", **_RULE)
    (entry,) = result.probes[precision.OVERFLOW_PROBE]
    assert result.passed and result.oracle == "onnx_float64", result.notes
    assert entry.nonfinite_mismatch == 0 and entry.rel_l2_err < 1e-2
    assert entry.raw_rel_l2_err < 1e-5 and "'embedding'" in result.notes[0]


def test_probe_fails_a_wrong_float16_model(tmp_path):
    raw, half, _ = _half(np.random.default_rng(0), tmp_path, scale=1.1)
    example = _example(np.random.default_rng(1))
    result = hidden_probe.compare(raw, half, example, tmp_path / "probe", **_RULE)
    assert not result.passed
    assert result.probes[precision.OVERFLOW_PROBE][0].rel_l2_err > 0.05


def test_no_lookup_no_probe(tmp_path, rng):
    g = Graph()
    g.node("Relu", ["x"], "y")
    path = tmp_path / "m.onnx"
    files.save_model(g.model({"x": (F, [2, 4])}, {"y": (F, [2, 4])}), path, external_data=False)
    found = hidden_probe.compare(
        path, path, {}, tmp_path / "p", provider="cpu", precision="fp16", atol=0, rtol=0
    )
    assert found is None


def test_cli_token_ids_get_the_hidden_state_probe(tmp_path, out_dir, rng, capsys):
    """A token-id ONNX file with a hand-written LayerNorm, given from another folder: the fp16
    report has the probe, fed at the embedding, against the cut raw model in float64."""
    given = tmp_path / "given" / "tokens.onnx"
    given.parent.mkdir()
    files.save_model(_token_model(rng), given, external_data=True)
    inputs = tmp_path / "given" / "inputs.npz"
    np.savez(inputs, **_example(rng))
    out, report = out_dir / "t.onnx", out_dir / "r.json"
    argv = [given, "--inputs", inputs, "--precision", "fp16", "--no-benchmark"]
    code = cli.main([str(a) for a in [*argv, "-o", out, "--report", report, "--provider", "cpu"]])
    text = capsys.readouterr().out
    assert code == 0, text
    data = json.loads(report.read_text())
    assert data["fusions"]["layernorm_fused"] == 1
    parity = data["parity"]
    assert parity["probes"][-1] == precision.OVERFLOW_PROBE and parity["passed"]
    (entry,) = parity["sets"][precision.OVERFLOW_PROBE]
    assert entry["nonfinite_mismatch"] == 0 and entry["raw_rel_l2_err"] < 1e-5
    assert any(
        "hidden states with outliers fed at 'embedding'" in n for n in parity["oracle_notes"]
    )
