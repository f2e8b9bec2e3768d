"""The built wheel: it installs ``normexport`` and ``fusion`` only (the zoo, ``models/``, stays a
folder of the repository), and its CLI, installed alone, optimizes an ONNX file from another
folder with the output written elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from tests.support.graphs import make_model

ROOT = Path(__file__).resolve().parents[1]
#: What building the wheel reads: the project file, its readme and the two packages.
SOURCES = ("pyproject.toml", "README.md", "normexport", "fusion")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, capture_output=True)


def _wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the sources (the build leaves nothing in the checkout)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(ROOT / name, source / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("normexport-*.whl")
    return wheel


def _layernorm_model(path: Path) -> None:
    """x (2, 8, 16) -> a hand-written LayerNorm with random weight and bias."""
    rng = np.random.default_rng(0)
    nodes = [
        ("ReduceMean", ["x"], ["mean"], {"axes": [-1], "keepdims": 1}),
        ("Sub", ["x", "mean"], ["d"], {}),
        ("Mul", ["d", "d"], ["sq"], {}),
        ("ReduceMean", ["sq"], ["var"], {"axes": [-1], "keepdims": 1}),
        ("Add", ["var", "eps"], ["ve"], {}),
        ("Sqrt", ["ve"], ["std"], {}),
        ("Div", ["d", "std"], ["n"], {}),
        ("Mul", ["n", "gamma"], ["ng"], {}),
        ("Add", ["ng", "beta"], ["y"], {}),
    ]
    weights = {
        "eps": np.array(1e-5, np.float32),
        "gamma": rng.uniform(0.5, 1.5, 16).astype(np.float32),
        "beta": rng.standard_normal(16).astype(np.float32),
    }
    shape = [2, 8, 16]
    model = make_model(nodes, {"x": (1, shape)}, {"y": (1, shape)}, weights, opset=17)
    path.parent.mkdir(parents=True)
    ir.save(model, path)


@pytest.mark.slow
def test_the_wheel_installs_normexport_and_fusion_and_its_cli_runs(tmp_path, out_dir):
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert tops == {"normexport", "fusion"}, tops
    assert "normexport/runtime/cuda_kernels.json" in names  # its package data
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(site), str(wheel))
    model, output, elsewhere = (
        tmp_path / "in" / "m.onnx",
        out_dir / "m.onnx",
        tmp_path / "cwd",
    )
    _layernorm_model(model)
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import normexport, fusion; print(normexport.__file__, fusion.__file__)",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert all(Path(p).is_relative_to(site) for p in where.stdout.split()), where.stdout
    ran = subprocess.run(
        [sys.executable, "-m", "normexport", str(model), "-o", str(output), "--no-benchmark"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "layernorm_fused" in ran.stdout or "LayerNormalization" in ran.stdout, ran.stdout
    assert [n.op_type for n in ir.load(output).graph] == ["LayerNormalization"]
