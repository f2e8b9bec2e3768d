"""Model files as users have them: external data as torch writes it by default, run from
another folder, outputs moved away from their inputs, models over protobuf's 2 GiB limit, and
the file modes of what is written."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from torch import nn

from normexport import cli
from normexport.io import files

pytestmark = pytest.mark.slow  # every test exports a PyTorch model first


class HandLayerNorm(nn.Module):
    """A LayerNorm written out, as tutorials do (eps 1e-5 survives torch's own optimizer)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 256)
        self.norm = HandLayerNorm(256)
        self.head = nn.Linear(256, 8)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


def _export(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """``m.onnx`` + ``m.onnx.data`` in ``folder``, by torch.onnx.export's defaults; the input
    and the network's output on it."""
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(4, 32)
    torch.onnx.export(net, (x,), str(folder / "m.onnx"))
    assert (folder / "m.onnx.data").exists()  # torch 2.13 writes external data by default
    with torch.no_grad():
        return x.numpy(), net(x).numpy()


@pytest.fixture
def exported_with_external_data(tmp_path, export_cache):
    """``models/m.onnx`` + ``models/m.onnx.data``, by torch.onnx.export's defaults (exported
    once per session, copied for each test), the input and the expected output."""
    folder, (x, expected) = export_cache.copy("files-net", _export, tmp_path / "models")
    return folder / "m.onnx", x, expected


def _run(path: Path, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_external_data_from_another_folder_output_moved_and_input_deleted(
    exported_with_external_data, tmp_path, monkeypatch
):
    model, x, expected = exported_with_external_data
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    old_mask = os.umask(0o027)
    try:
        code = cli.main(
            ["../models/m.onnx", "-o", "../out/m.opt.onnx", "--report", "../out/r.json"]
            + ["--no-benchmark", "--provider", "cpu", "--make-dirs"]
        )
    finally:
        os.umask(old_mask)
    assert code == 0
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o750  # made as mkdir makes it, under the umask
    written = sorted(p.name for p in out.iterdir())
    assert written == ["m.opt.onnx", "m.opt.onnx.data", "r.json"]  # no temp files left
    for name in written:  # what open() gives under the umask, not mkstemp's 0600
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o640, name
    proto = onnx.load(out / "m.opt.onnx", load_external_data=False)
    locations = {
        entry.value
        for tensor in proto.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    assert locations == {"m.opt.onnx.data"}  # its own data, never the input's
    ops = [n.op_type for n in proto.graph.node]
    assert "LayerNormalization" in ops and "ReduceMean" not in ops

    moved = tmp_path / "shipped"
    shutil.move(out, moved)
    shutil.rmtree(model.parent)  # the input and its data are gone
    np.testing.assert_allclose(_run(moved / "m.opt.onnx", {"x": x}), expected, rtol=1e-4, atol=1e-4)


def test_output_without_external_data_replaces_a_stale_data_file(
    exported_with_external_data, tmp_path, out_dir
):
    """A small model from a file without external data is written inline; a ``.data`` file
    left beside the output by an earlier run is removed, not left to mislead."""
    model, x, expected = exported_with_external_data
    inline = tmp_path / "inline.onnx"
    files.save_model(ir.load(model), inline, external_data=False)
    out = out_dir / "inline.opt.onnx"
    files.data_path(out).write_bytes(b"stale")
    assert cli.main([str(inline), "-o", str(out), "--no-benchmark", "--provider", "cpu"]) == 0
    assert not files.data_path(out).exists()
    np.testing.assert_allclose(_run(out, {"x": x}), expected, rtol=1e-4, atol=1e-4)


def _big_model(folder: Path, rows: int, width: int = 64) -> Path:
    """``ids (1, 8) -> Gather(table) -> Cast to float32 -> hand-written LayerNorm``, whose
    table of ``rows x width`` float16 (a half-precision embedding) lives in external data. The
    data file is sparse: only the rows the random ids can reach (0-127) hold data, so a model
    over 2 GiB costs no disk writes to make; float16, the oracle's float64 graph keeps it as it
    is and reads it from that file (a float32 table would be written out again in float64,
    twice its size: 4 GiB, half a minute of disk)."""
    path = folder / "big.onnx"
    data = files.data_path(path)
    rng = np.random.default_rng(0)
    with open(data, "wb") as f:
        f.truncate(rows * width * 2)
        f.write(rng.standard_normal((128, width)).astype(np.float16).tobytes())
    table = ir.Value(
        name="table",
        shape=ir.Shape([rows, width]),
        type=ir.TensorType(ir.DataType.FLOAT16),
        const_value=ir.ExternalTensor(
            data.name,
            offset=0,
            length=rows * width * 2,
            dtype=ir.DataType.FLOAT16,
            shape=ir.Shape([rows, width]),
            name="table",
            base_dir=folder,
        ),
    )

    def const(name, array):
        return ir.Value(
            name=name,
            shape=ir.Shape(array.shape),
            type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
            const_value=ir.tensor(array, name=name),
        )

    axes = const("axes", np.array([-1], dtype=np.int64))
    eps = const("eps", np.array(1e-5, dtype=np.float32))
    gamma = const("gamma", rng.standard_normal(width).astype(np.float32))
    beta = const("beta", rng.standard_normal(width).astype(np.float32))
    ids = ir.Value(name="ids", shape=ir.Shape([1, 8]), type=ir.TensorType(ir.DataType.INT64))
    gathered = ir.node("Gather", [table, ids], {"axis": 0})
    x = ir.node("Cast", [gathered.outputs[0]], {"to": ir.DataType.FLOAT})
    mean = ir.node("ReduceMean", [x.outputs[0], axes])
    centered = ir.node("Sub", [x.outputs[0], mean.outputs[0]])
    square = ir.node("Mul", [centered.outputs[0], centered.outputs[0]])
    var = ir.node("ReduceMean", [square.outputs[0], axes])
    shifted = ir.node("Add", [var.outputs[0], eps])
    root = ir.node("Sqrt", [shifted.outputs[0]])
    normed = ir.node("Div", [centered.outputs[0], root.outputs[0]])
    scaled = ir.node("Mul", [normed.outputs[0], gamma])
    y = ir.node("Add", [scaled.outputs[0], beta])
    y.outputs[0].name = "y"
    nodes = [gathered, x, mean, centered, square, var, shifted, root, normed, scaled, y]
    graph = ir.Graph(
        [ids],
        [y.outputs[0]],
        nodes=nodes,
        initializers=[table, axes, eps, gamma, beta],
        opset_imports={"": 18},
    )
    ir.save(ir.Model(graph, ir_version=10), path)  # the table stays where it is
    return path


def test_model_over_2_gib(tmp_path, out_dir):
    rows = (2**31 + 2**26) // (64 * 2)  # 2.06 GiB of table
    model = _big_model(tmp_path, rows)
    out = out_dir / "big.opt.onnx"
    try:
        code = cli.main([str(model), "-o", str(out), "--no-benchmark", "--provider", "cpu"])
        assert code == 0
        assert files.data_path(out).stat().st_size >= 2**31
        proto = onnx.load(out, load_external_data=False)
        assert [n.op_type for n in proto.graph.node] == ["Gather", "Cast", "LayerNormalization"]
        ids = np.arange(8, dtype=np.int64).reshape(1, 8)
        np.testing.assert_allclose(
            _run(out, {"ids": ids}), _run(model, {"ids": ids}), rtol=1e-4, atol=1e-4
        )
    finally:  # pytest keeps recent tmp folders: do not leave GBs behind
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("damage", ["missing", "truncated", "ir_version_99"])
def test_broken_input_files_are_the_users_to_fix(
    exported_with_external_data, tmp_path, out_dir, capsys, damage
):
    model, _, _ = exported_with_external_data
    data = files.data_path(model)
    if damage == "missing":
        data.unlink()
    elif damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:
        proto = onnx.load(model, load_external_data=False)
        proto.ir_version = 99
        onnx.save(proto, model)
    out = out_dir / "m.opt.onnx"
    code = cli.main([str(model), "-o", str(out), "--no-benchmark", "--provider", "cpu"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    expected = {
        "missing": "m.onnx.data is missing",
        "truncated": "m.onnx.data is shorter than its tensors say",
        "ir_version_99": "Unsupported model IR version: 99",
    }[damage]
    assert expected in err
    assert not out.exists() and not list(out.parent.glob(".*"))  # no scratch left behind


@pytest.mark.parametrize(
    "args",
    [
        ["m.onnx", "--report", "m.onnx"],
        ["m.onnx", "--report", "m.onnx.data"],
        ["m.onnx", "-o", "new_dir/../m.onnx", "--make-dirs"],
        ["m.onnx", "-o", "o.onnx", "--report", "o.onnx"],
        ["bench", "m.onnx", "--json", "m.onnx"],
        ["bench", "m.onnx", "--chart", "./m.onnx.data"],
    ],
    ids=["report", "report-data", "dotdot", "report-is-output", "bench-json", "bench-chart"],
)
def test_outputs_never_land_on_the_input(exported_with_external_data, monkeypatch, capsys, args):
    model, _, _ = exported_with_external_data
    monkeypatch.chdir(model.parent)
    before = {p.name: p.read_bytes() for p in model.parent.iterdir()}
    assert cli.main([*args, "--provider", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("overwrite the input" in err or "also written" in err)
    assert {p.name: p.read_bytes() for p in model.parent.iterdir()} == before


def test_a_killed_runs_work_folder_is_removed_by_the_next_run(tmp_path):
    """A work folder whose process is gone (a run killed: the kernel's OOM killer, kill -9) is
    removed when the next run on the same output starts; a running process's folder, one
    without an owner file, and another output's are left alone."""
    output = tmp_path / "m.onnx"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = f"{gone.pid} 1"  # a process that has exited (start time 1: never a reused PID's)
    folders = {
        "killed": (".m.onnx.killed.work", dead),
        "running": (".m.onnx.running.work", files._owner(os.getpid())),
        "unowned": (".m.onnx.unowned.work", None),
        "other": (".n.onnx.other.work", dead),
    }
    for name, owner in folders.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx.data").write_bytes(b"weights")
        if owner is not None:
            (tmp_path / name / files.OWNER).write_text(owner)
    with files.work_folder(output) as work:
        assert (work / files.OWNER).read_text() == files._owner(os.getpid())
        left = sorted(p.name for p in tmp_path.iterdir() if p != work)
    kept = [folders[k][0] for k in ("running", "unowned", "other")]
    assert left == sorted(kept) and not work.exists()


def _external_weight_model(folder: Path, fields: dict[str, int | bool]) -> tuple[Path, np.ndarray]:
    """``y = x @ w`` with ``w`` (4, 3) in ``w.bin`` beside the model, its ``external_data``
    entries ``location`` and those of ``fields`` (``offset``, ``length``, ``checksum``: True
    for the SHA-1 of its bytes); the data file holds ``offset`` bytes of padding first."""
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    offset = fields.get("offset", 0)
    folder.mkdir(parents=True)
    (folder / "w.bin").write_bytes(b"\0" * offset + w.tobytes())
    tensor = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=w.shape)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entries = {"location": "w.bin"}
    if "offset" in fields:
        entries["offset"] = str(offset)
    if "length" in fields:
        entries["length"] = str(w.nbytes)
    if fields.get("checksum"):
        entries["checksum"] = hashlib.sha1(w.tobytes()).hexdigest()
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [tensor],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "m.onnx"
    onnx.save(model, path)
    return path, w


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields",
    [{}, {"offset": 64}, {"length": True}, {"offset": 64, "length": True}, {"checksum": True}],
    ids=["location", "offset", "length", "offset_length", "checksum"],
)
def test_every_legal_external_data_entry_is_read(tmp_path, out_dir, fields, capsys):
    """ONNX's external data (onnx/docs/ExternalData.md) needs ``location`` only; ``offset``
    (default 0), ``length`` and ``checksum`` are optional. Each combination ONNX Runtime loads
    is a model normexport runs (it once ended a location-only file with exit 3)."""
    path, w = _external_weight_model(tmp_path / "in", fields)
    x = np.ones((2, 4), np.float32)
    (expected,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    np.testing.assert_allclose(expected, x @ w, rtol=1e-6)
    out = out_dir / "m.onnx"
    code = cli.main([str(path), "-o", str(out), "--no-benchmark", "--provider", "cpu"])
    assert code == 0, capsys.readouterr().out
    (got,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-6)
