"""The main command on a few of ONNX Runtime's own fusion test models (``tests/data/ort/``,
:mod:`tests.support.peer`), as a user would run it: from another folder, output elsewhere, CPU
provider, no timing. A file exits 0 with its report written, or, where ONNX Runtime cannot load
or run it as given, exits 2 with one line that says why; never 1, never 3. Every file runs
through the API in ``test_peer_files.py``: here what only the command adds (its exit codes,
its one line, the report file, the shapes a user gives).
"""

from __future__ import annotations

import json

import onnxruntime as ort
import pytest

from normexport import cli
from tests.support.peer import ORT, UNRUNNABLE

pytestmark = pytest.mark.slow

#: The files run here, and the flags a user adds: a residual norm that fuses, a model whose
#: inputs' dimensions are all symbolic (the user gives their shapes), a file ONNX Runtime cannot
#: load and one it cannot run.
RUNS = {
    "skip_layer_norm_format1.onnx": [],
    "layer_norm.onnx": [f"--input-shape={shape}" for shape in ("X=4x8", "Scale=8", "B=8")],
    "variants/fuse-conv-bn-no-bias.bn_empty_opt_output.onnx": [],
    "fuse-matmul-bn-only-reshape.onnx": [],
}


@pytest.mark.parametrize("name", RUNS)
def test_peer_file_through_the_cli(name, tmp_path, out_dir, monkeypatch, capsys):
    path = ORT / name
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    out = out_dir / path.name.replace(".onnx", ".opt.onnx")
    report = out_dir / "report.json"
    args = [str(path), "-o", str(out), "--report", str(report), "--no-benchmark"]
    code = cli.main([*args, "--provider", "cpu", *RUNS[name]])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    if path.name in UNRUNNABLE:
        ours, theirs = UNRUNNABLE[path.name]
        assert code == 2 and ours in err and theirs in err, err
        assert len(err.strip().splitlines()) == 1 and not out.exists()
        return
    assert code == 0, err
    assert json.loads(report.read_text())["parity"]["passed"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_outputs()
