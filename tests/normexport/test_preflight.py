"""The environment checks of the preflight: two ONNX Runtime distributions in one environment
are said in one line with the fix, at start; a package they left broken is exit 2."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from normexport import cli
from normexport.arguments import check_onnxruntime
from normexport.arguments.preflight import ONNXRUNTIME_DISTRIBUTIONS


def _installed(monkeypatch, versions: dict[str, str]) -> None:
    """Make ``importlib.metadata.version`` answer as if ``versions`` were the ONNX Runtime
    distributions installed (other names as they are)."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name not in ONNXRUNTIME_DISTRIBUTIONS:
            return real(name)
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)


def _model(path) -> None:
    weight = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_one_distribution_is_no_conflict(monkeypatch):
    _installed(monkeypatch, {"onnxruntime-gpu": "1.31.1"})
    assert check_onnxruntime() is None


def test_two_distributions_are_said_at_start_with_the_fix(monkeypatch, tmp_path, capsys):
    _installed(monkeypatch, {"onnxruntime-gpu": "1.31.1", "onnxruntime": "1.32.0"})
    _model(tmp_path / "m.onnx")
    argv = [str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "--no-benchmark"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("normexport: warning:")]
    assert code == 0 and len(warned) == 1, err
    assert "onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1" in warned[0]
    assert "pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime (CPU)" in err
    assert err.splitlines()[0] == warned[0]  # said first, before any work


def test_a_package_they_left_broken_is_exit_2(monkeypatch, tmp_path, capsys):
    """Uninstalling one of the two removes files the other needs: ``import onnxruntime`` then
    gives a module without ``InferenceSession``."""
    _installed(monkeypatch, {"onnxruntime-gpu": "1.31.1", "onnxruntime": "1.32.0"})
    monkeypatch.setitem(sys.modules, "onnxruntime", types.ModuleType("onnxruntime"))
    _model(tmp_path / "m.onnx")
    code = cli.main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "now `import onnxruntime` fails" in line and "pip install" in line, line


def test_no_onnxruntime_is_exit_2_with_the_install_line(monkeypatch, tmp_path, capsys):
    """Installed without an extra (``pip install normexport``), there is no ONNX Runtime: one
    line that says which extra to install, exit 2, before any work."""
    _installed(monkeypatch, {})
    _model(tmp_path / "m.onnx")
    code = cli.main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "ONNX Runtime is not installed" in line, line
    assert "normexport[cpu]" in line and "normexport[gpu]" in line
    assert not (tmp_path / "o.onnx").exists()


def test_the_api_warns(monkeypatch, tmp_path):
    import normexport

    _installed(monkeypatch, {"onnxruntime-gpu": "1.31.1", "onnxruntime": "1.32.0"})
    _model(tmp_path / "m.onnx")
    with pytest.warns(RuntimeWarning, match="overwrite each other's files") as warned:
        report = normexport.optimize(
            tmp_path / "m.onnx", output=tmp_path / "o.onnx", benchmark=False
        )
    said = [w for w in warned if "overwrite each other's files" in str(w.message)]
    assert len(said) == 1 and "onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1" in str(
        said[0].message
    )
    assert report.passed  # a warning, not a stop: the run goes on


def test_onnx_runtime_is_an_extra_one_package_each():
    """The base install names no ONNX Runtime distribution (``onnxruntime-gpu`` has no wheels
    for macOS or aarch64, and beside a user's ``onnxruntime`` it clashes): the ``cpu`` extra
    takes ``onnxruntime``, ``gpu`` takes ``onnxruntime-gpu``, one each."""
    import tomllib

    project = tomllib.loads(Path(__file__).parents[2].joinpath("pyproject.toml").read_text())
    project = project["project"]
    names = [re.split(r"[<>=!~ \[;]", d)[0] for d in project["dependencies"]]
    assert not set(names) & set(ONNXRUNTIME_DISTRIBUTIONS), names
    extras = project["optional-dependencies"]
    assert [re.split(r"[<>=]", d)[0] for d in extras["cpu"]] == ["onnxruntime"]
    assert [re.split(r"[<>=]", d)[0] for d in extras["gpu"]] == ["onnxruntime-gpu"]
