"""The main command on ONNX Runtime's own graph-transformer test models (shared/peer/ort/), as a
user would run it: from another folder, output elsewhere, CPU provider, no timing.

Every file either exits 0 with parity passed against the file's own graph in float64 (the
optimized model and the file as written both run by ONNX Runtime with its graph optimizations
off), or exits 2 with one line that says why ONNX Runtime cannot
load or run it as given; never 1, never 3. What each fusion became, case by case against ONNX
Runtime's own expectations, is tested in ``tests/fusion/test_peer_ort.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort
import pytest

from normexport import cli

PEER = Path(__file__).parents[2].parent / "shared/peer/ort"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PEER.is_dir(), reason=f"{PEER} (ONNX Runtime's test models) absent"),
]

FILES = sorted(PEER.glob("*.onnx")) + sorted(PEER.glob("variants/*.onnx"))

#: Files that are not runnable as given, and the words of the one line that says so.
UNRUNNABLE = {
    # BatchNormalization-7 with 2 outputs: invalid (ORT refuses to load it).
    "fuse-conv-bn-no-bias.bn_empty_opt_output.onnx": "ONNX Runtime cannot load",
    "fuse-matmul-bn-with-reshape.bn_empty_opt_output.onnx": "ONNX Runtime cannot load",
    # 5 BatchNorm channels over an axis of size 1: ORT stops with "Invalid input scale".
    "fuse-matmul-bn-directly-dont-fuse.onnx": "Invalid input scale",
    "fuse-matmul-bn-only-reshape.onnx": "Invalid input scale",
    "fuse-matmul-bn-only-transpose.onnx": "Invalid input scale",
}

#: Inputs whose dimensions are all symbolic: the user gives their shapes.
SHAPES = {"layer_norm.onnx": ["--input-shape", "X=4x8", "--input-shape", "Scale=8"] + [
    "--input-shape", "B=8"
]}  # fmt: skip


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_peer_file_through_the_cli(path, tmp_path, out_dir, monkeypatch, capsys):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    out = out_dir / path.name.replace(".onnx", ".opt.onnx")
    report = out_dir / "report.json"
    args = [str(path), "-o", str(out), "--report", str(report), "--no-benchmark"]
    code = cli.main([*args, "--provider", "cpu", *SHAPES.get(path.name, [])])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    if path.name in UNRUNNABLE:
        assert code == 2 and UNRUNNABLE[path.name] in err and len(err.strip().splitlines()) == 1
        assert not out.exists()
        return
    assert code == 0, err
    result = json.loads(report.read_text())
    parity = result["parity"]
    assert parity["passed"] and parity["reference"] == "onnx"
    # every file's oracle is float64 on ONNX Runtime, its Convs by their float64 form (the
    # BatchNorm in training mode and the negative Unsqueeze axes onnx.reference refused too)
    assert parity["oracle"] == "onnx_float64", parity["oracle_notes"]
    assert parity["oracle_float32"] == [], parity["oracle_float32"]
    assert all(e["raw_max_abs_err"] is not None for e in parity["outputs"].values())
    assert result["checker"]["output"] != "none" or result["checker"]["input"] == "none"
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_outputs()  # the written model loads, with ORT's optimizations on too
