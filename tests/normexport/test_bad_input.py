"""Bad input, faults and hostile files, as a new user would try them (issue 10): every case
exits 0, or 2 with one line that names the file / node / option and the fix (130 / 143 when a
signal stops the run), never 3, never with a traceback; the input's bytes are unchanged, no
temporary file is left, and a hostile file's payload never runs.

One table, :data:`CASES`; each case is run in its own folder holding a copy of the same small
files (a few-layer nn.Module with randomized LayerNorm weights, and onnx_ir-built ONNX files).
Most run in-process through ``cli.main``; subprocesses only where a real signal or the installed
``normexport`` script is what is tested.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from normexport import cli, runtime
from normexport.io.files import default_output, save_model
from tests.support.graphs import stft_front_end

REPO = Path(__file__).resolve().parents[2]

#: The model code, importable from the case's folder as ``tinynet`` (``--model-class``).
TINYNET = '''
import os
import signal
import time

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)
        with torch.no_grad():  # default norm weights (1, 0) hide bugs
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


class ReturnsNone(Net):
    def forward(self, x):
        self.head(self.norm(self.fc(x)))


class Unexportable(Net):
    def forward(self, x):
        return torch.linalg.eigvals(self.fc(x).reshape(-1, 4, 4)).real  # no ONNX op for eig


def _tracing(x):
    return type(x) is not torch.Tensor  # fake / functional tensors while exporting


class Stall(Net):
    """Waits for a signal: while exporting, or in the eager run for parity (inside the
    output's scratch folder), as NORMEXPORT_TEST_STALL says; touches NORMEXPORT_TEST_READY."""

    def forward(self, x):
        ready = os.environ.get("NORMEXPORT_TEST_READY", "")
        when = os.environ.get("NORMEXPORT_TEST_STALL")
        if ready and not os.path.exists(ready) and when == ("export" if _tracing(x) else "parity"):
            open(ready, "w").close()
            time.sleep(120)
        return super().forward(x)


class InterruptedImport(Net):
    """Ctrl-C while exporting, caught where torch imports lazily: what the exporter then sees
    is an AttributeError from a half-initialized module."""

    def forward(self, x):
        if _tracing(x):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                raise AttributeError(
                    "partially initialized module 'torch._lazy' has no attribute 'x'"
                ) from None
        return super().forward(x)
'''

LONG_INPUT = "m" * 247 + ".pt"  # 250 bytes: its default output name is 256
LONG_OUTPUT = "o" * 245 + ".onnx"  # 250 bytes: allowed (255 is the limit)
# 250 bytes, with external data: its default output name is 254 bytes, allowed, and that
# output's data file cannot be named OUTPUT.data (259 bytes; onnx-ir writes it under 269)
LONG_ONNX = "m" * 245 + ".onnx"
MARKER = "pwned"  # what a hostile payload creates, in the shared folder


class Hostile:
    """Unpickling this creates ``marker`` (stands for any code a pickle can run)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _import_tinynet(folder: Path):
    sys.path.insert(0, str(folder))
    try:
        import tinynet
    finally:
        sys.path.remove(str(folder))
    return tinynet


def _onnx_file(
    path: Path,
    *,
    nodes: bool = True,
    shape: bool = True,
    dangling: bool = False,
    custom_op: bool = False,
    ir_version: int = 10,
) -> Path:
    """x (2, 8) -> MatMul(random 8x4) -> Relu, built with onnx_ir, with one fault at most."""
    rng = np.random.default_rng(0)
    x = ir.val("x", ir.DataType.FLOAT, [2, 8] if shape else None)
    w = ir.tensor(rng.standard_normal((8, 4)).astype(np.float32), name="w")
    w_value = ir.val("w", ir.DataType.FLOAT, [8, 4], const_value=w)
    if not nodes:
        graph = ir.Graph([x], [x], nodes=[], opset_imports={"": 18}, name="empty")
    else:
        ghost = ir.val("ghost", ir.DataType.FLOAT, [2, 8])
        matmul = ir.node("MatMul", [ghost if dangling else x, w_value])
        if custom_op:
            last = ir.node("Swish", matmul.outputs, domain="com.example", version=1)
        else:
            last = ir.node("Relu", matmul.outputs)
        last.outputs[0].name = "y"
        last.outputs[0].dtype = ir.DataType.FLOAT
        last.outputs[0].shape = ir.Shape([2, 4])
        opsets = {"": 18} | ({"com.example": 1} if custom_op else {})
        graph = ir.Graph(
            [x],
            last.outputs,
            nodes=[matmul, last],
            initializers=[w_value],
            opset_imports=opsets,
            name="tiny",
        )
    ir.save(ir.Model(graph, ir_version=ir_version), path)
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """The files every case gets a copy of (made once)."""
    folder = tmp_path_factory.mktemp("shared")
    (folder / "tinynet.py").write_text(TINYNET)
    tinynet = _import_tinynet(folder)
    torch.manual_seed(0)
    net = tinynet.Net().eval()
    torch.save(net.state_dict(), folder / "state.pt")
    shutil.copy(folder / "state.pt", folder / LONG_INPUT)
    data = (folder / "state.pt").read_bytes()
    (folder / "truncated.pt").write_bytes(data[: len(data) // 2])
    (folder / "empty.pt").write_bytes(b"")
    (folder / "random.bin").write_bytes(np.random.default_rng(1).bytes(4096))
    (folder / "notes.txt").write_text("not a folder\n")
    (folder / "notes.onnx").write_text("a text file named like a model\n")
    (folder / "adir").mkdir()
    marker = folder / MARKER
    # hostile files: a legacy (non-zip) pickle, a .pt2 whose example inputs are a pickle, .npz
    torch.save(Hostile(marker), folder / "hostile.pt", _use_new_zipfile_serialization=False)
    program = torch.export.export(net, (torch.randn(2, 8),))
    torch.export.save(program, folder / "hostile.pt2")
    _replace_in_zip(folder / "hostile.pt2", "data/sample_inputs/model.pt", ((Hostile(marker),), {}))
    np.savez(folder / "hostile.npz", x=np.array([Hostile(marker)], dtype=object))
    assert not marker.exists()
    # --trust-pickle on a damaged pickle, and on a class that lived in a script's __main__
    tinynet.Net.__module__ = "__main__"
    main = sys.modules["__main__"]
    main.Net = tinynet.Net
    try:
        torch.save(net, folder / "main_class.pt")
    finally:
        del main.Net
        tinynet.Net.__module__ = "tinynet"
    legacy = io.BytesIO()
    torch.save(net, legacy, _use_new_zipfile_serialization=False)
    (folder / "truncated_legacy.pt").write_bytes(legacy.getvalue()[: len(legacy.getvalue()) // 2])
    # a TorchScript archive saved in training mode
    traced = torch.jit.trace(tinynet.Net().train(), torch.randn(2, 8), check_trace=False)
    traced.save(str(folder / "training.ts"))
    np.savez(folder / "f64.npz", x=np.random.default_rng(2).standard_normal((2, 8)))
    np.savez(folder / "f64_exact.npz", x=np.arange(16, dtype=np.float64).reshape(2, 8) / 8)
    # ONNX files
    _onnx_file(folder / "good.onnx")
    _onnx_file(folder / "no_nodes.onnx", nodes=False)
    _onnx_file(folder / "no_shape.onnx", shape=False)
    _onnx_file(folder / "dangling.onnx", dangling=True)
    _onnx_file(folder / "custom_op.onnx", custom_op=True)
    _onnx_file(folder / "ir99.onnx", ir_version=99)
    window = stft_front_end(np.random.default_rng(0), kernel=8000)  # runs at no size picked
    save_model(window, folder / "window.onnx", external_data=False)
    model = ir.load(_onnx_file(folder / "ext.onnx"))
    ir.save(model, folder / "ext.onnx", external_data="ext.onnx.data", size_threshold_bytes=0)
    (folder / "ext.onnx.data").unlink()
    model = ir.load(_onnx_file(folder / LONG_ONNX))
    ir.save(model, folder / LONG_ONNX, external_data="long.data", size_threshold_bytes=0)
    return folder


def _replace_in_zip(path: Path, rel: str, obj) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(path) as archive:
        entries = [(i.filename, archive.read(i)) for i in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries:
            hit = name.partition("/")[2] == rel
            archive.writestr(name, buffer.getvalue() if hit else data)


def _read_only_folder(cwd: Path) -> str:
    """A folder nobody may create files in: a mode-555 one, or /sys for root (whom file modes
    do not stop)."""
    if os.geteuid() == 0:
        return "/sys"
    (cwd / "ro").mkdir()
    (cwd / "ro").chmod(0o555)
    return "ro"


def _no_cuda() -> None:
    if runtime.resolve_provider("auto")[0] == "cuda":
        pytest.skip("CUDA loads on this machine")


@dataclasses.dataclass
class Case:
    """One bad (or good) input.

    Attributes:
        id: the test id.
        argv: the command line after ``normexport``, run in the case's folder; ``{ro}`` is a
            folder that cannot be written.
        code: the expected exit code.
        says: words the last line of the output must contain.
        how: ``inproc`` (``cli.main``), ``threads`` (two at once), ``module`` (``python -m
            normexport``: all that reaches the terminal, torch's own log lines included),
            ``script`` (the installed ``normexport`` script), ``sigint`` / ``sigterm`` (a
            subprocess signalled when the model's forward() stalls).
        env: environment for the run (the Stall model reads it).
        absent: files that must not exist afterwards.
        setup: called with the case's folder before the run.
        fast: append ``--no-benchmark --provider cpu``.
    """

    id: str
    argv: list[str]
    code: int
    says: tuple[str, ...]
    how: str = "inproc"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    absent: tuple[str, ...] = ()
    setup: Callable[[], None] | None = None
    fast: bool = True


SD = ["state.pt", "--model-class", "tinynet:Net"]
SHAPE = ["--input-shape", "2,8"]
OUT = ["-o", "out/m.onnx", "--make-dirs"]

CASES = [
    # --- files: missing, empty, damaged, random, hostile, of the wrong kind
    Case("missing-file", ["nope.pt"], 2, ("nope.pt: no such file",)),
    Case("directory", ["adir"], 2, ("adir is a folder, not a model file",)),
    Case("empty-file", ["empty.pt"], 2, ("empty.pt is empty",)),
    Case("truncated-zip", ["truncated.pt", *SHAPE], 2, ("truncated.pt: not a torch.save file",)),
    Case("random-bytes", ["random.bin"], 2, ("random.bin: not a torch.save file",)),
    Case("text-named-onnx", ["notes.onnx"], 2, ("notes.onnx: not an ONNX model: it does not",)),
    Case("hostile-pickle", ["hostile.pt"], 2, ("hostile.pt", "--trust-pickle")),
    Case("hostile-pt2", ["hostile.pt2"], 2, ("hostile.pt2", "--trust-pickle")),
    Case("hostile-npz", [*SD, "--inputs", "hostile.npz"], 2, ("--inputs hostile.npz",)),
    Case("truncated-legacy-pickle-trusted", ["truncated_legacy.pt", "--trust-pickle", *SHAPE],
         2, ("truncated_legacy.pt: cannot unpickle it", "complete")),
    Case("main-class-pickle-trusted", ["main_class.pt", "--trust-pickle", *SHAPE], 2,
         ("main_class.pt", "__main__", "--model-class")),
    # --- ONNX files
    Case("onnx-no-nodes", ["no_nodes.onnx"], 2, ("no_nodes.onnx: an ONNX model with no nodes",)),
    Case("onnx-missing-external-data", ["ext.onnx"], 2, ("ext.onnx.data is missing",)),
    Case("onnx-dangling-input", ["dangling.onnx"], 2,
         ("dangling.onnx: ONNX Runtime cannot load", "ghost")),
    Case("onnx-input-without-shape", ["no_shape.onnx"], 2,
         ("input 'x' has no shape", "--input-shape x=")),
    Case("onnx-custom-op", ["custom_op.onnx"], 2,
         ("custom_op.onnx: ONNX Runtime cannot load", "Swish")),
    Case("onnx-ir-version-99", ["ir99.onnx"], 2, ("ir99.onnx: ONNX Runtime cannot load",)),
    Case("onnx-wrong-input-shape", ["good.onnx", "--input-shape", "2,5"], 2,
         ("cannot run this model as given", "--input-shape")),
    Case("onnx-no-size-picked-runs", ["window.onnx"], 2,
         ("window.onnx: ONNX Runtime cannot run this model at the largest sizes tried",
          "tried samples=16, 256, 4096", "--dim samples=SIZE")),
    Case("onnx-good", ["good.onnx", *OUT], 0, ("parity passed",)),
    # --- options
    Case("state-dict-without-model-class", ["state.pt", *SHAPE], 2, ("--model-class",)),
    Case("model-class-missing-module", ["state.pt", "--model-class", "nosuch:Net", *SHAPE], 2,
         ("--model-class 'nosuch:Net': cannot import it",)),
    Case("model-class-without-colon", ["state.pt", "--model-class", "tinynet", *SHAPE], 2,
         ("--model-class 'tinynet'", "package.module:Class")),
    Case("model-kwargs-not-json", [*SD, "--model-kwargs", "{width", *SHAPE], 2,
         ("--model-kwargs is not valid JSON",)),
    Case("model-kwargs-not-object", [*SD, "--model-kwargs", "[16]", *SHAPE], 2,
         ("--model-kwargs must be a JSON object",)),
    Case("model-kwargs-unknown", [*SD, "--model-kwargs", '{"depth": 3}', *SHAPE], 2,
         ("--model-class tinynet:Net: cannot build it", "depth")),
    Case("model-kwargs-wrong-size", [*SD, "--model-kwargs", '{"width": 32}', *SHAPE], 2,
         ("state.pt does not fit tinynet:Net",)),
    Case("input-shape-syntax", [*SD, "--input-shape", "2;8"], 2, ("--input-shape '2;8'",)),
    Case("input-shape-str-dtype", [*SD, "--input-shape", "2,16:str"], 2,
         ("--input-shape '2,16:str'", "not a tensor dtype")),
    Case("input-shape-7-tib", [*SD, "--input-shape", "100000x100000x100"], 2,
         ("--input-shape", "100000x100000x100", "TiB", "smaller shape")),
    Case("input-shape-wrong-size", [*SD, "--input-shape", "2,5"], 2,
         ("state.pt: could not export to ONNX",)),
    Case("inputs-float64-inexact", [*SD, "--inputs", "f64.npz", *OUT], 2,
         ("--inputs f64.npz: input 'x' is float64 but the model takes float32",),
         absent=("out",)),
    Case("inputs-float64-exact", ["good.onnx", "--inputs", "f64_exact.npz", *OUT], 0,
         ("parity passed",)),
    Case("opset-5", [*SD, *SHAPE, "--opset", "5"], 2, ("--opset 5: give an ai.onnx opset",)),
    Case("opset-99", [*SD, *SHAPE, "--opset", "99"], 2, ("--opset 99: give an ai.onnx opset",)),
    Case("opset-13-dynamo", [*SD, *SHAPE, "--opset", "13", "--exporter", "dynamo"], 2,
         ("could not export", "--opset 13: it wrote opset 18")),
    Case("opset-13-falls-back", [*SD, *SHAPE, "--opset", "13", *OUT], 0, ("exporter torchscript",
         "opset 13", "parity passed")),
    Case("atol-negative", [*SD, *SHAPE, "--atol", "-1"], 2, ("--atol -1.0",)),
    Case("atol-nan", [*SD, *SHAPE, "--atol", "nan"], 2, ("--atol nan",)),
    Case("threads-zero", [*SD, *SHAPE, "--threads", "0"], 2, ("--threads 0: give a number",)),
    Case("provider-cuda-missing", [*SD, *SHAPE, "--provider", "cuda", "--no-benchmark"], 2,
         ("--provider cuda", "--provider cpu"), setup=_no_cuda, fast=False),
    # --- outputs
    Case("output-is-input", [*SD, *SHAPE, "-o", "state.pt"], 2, ("never overwrites",)),
    Case("output-resolves-to-input", [*SD, *SHAPE, "-o", "new/../state.pt", "--make-dirs"], 2,
         ("never overwrites",)),
    Case("output-folder-missing", [*SD, *SHAPE, "-o", "no/such/m.onnx"], 2,
         ("-o no/such/m.onnx: the folder no/such does not exist", "--make-dirs"),
         absent=("no",)),
    Case("report-folder-missing", [*SD, *SHAPE, "-o", "m.onnx", "--report", "typo/r.json"], 2,
         ("--report typo/r.json: the folder typo does not exist",), absent=("m.onnx", "typo")),
    Case("output-is-a-folder", [*SD, *SHAPE, "-o", "adir"], 2, ("-o adir is a folder",)),
    Case("output-under-a-file", [*SD, *SHAPE, "-o", "notes.txt/m.onnx"], 2,
         ("-o notes.txt/m.onnx: notes.txt is a file, not a folder",)),
    Case("output-read-only-folder", [*SD, *SHAPE, "-o", "{ro}/m.onnx"], 2,
         ("-o {ro}/m.onnx: cannot write in the folder",)),
    Case("report-read-only-folder", [*SD, *SHAPE, *OUT, "--report", "{ro}/r.json"], 2,
         ("--report {ro}/r.json: cannot write in the folder",), absent=("out",)),
    Case("long-name-default-output", [LONG_INPUT, "--model-class", "tinynet:Net", *SHAPE], 2,
         ("-o", "the file name is 256 bytes", "choose a shorter name with -o")),
    Case("long-names", [LONG_INPUT, "--model-class", "tinynet:Net", *SHAPE, "-o", LONG_OUTPUT],
         0, ("parity passed",)),
    Case("long-name-legal-default-output", [LONG_ONNX], 0, ("parity passed",)),
    Case("concurrent-runs-same-output", ["good.onnx", *OUT], 0, ("parity passed",),
         how="threads"),
    # --- models
    Case("unexportable-op", ["state.pt", "--model-class", "tinynet:Unexportable", *SHAPE], 2,
         ("state.pt: could not export to ONNX", "No ONNX function found for", "linalg_eig",
          "TorchScript exporter"), how="module"),
    Case("forward-returns-none", ["state.pt", "--model-class", "tinynet:ReturnsNone", *SHAPE,
                                  *OUT], 2, ("forward() returns no tensor",), absent=("out",)),
    Case("training-mode-is-reported", ["training.ts", *SHAPE, *OUT], 0,
         ("training mode", "eval mode")),
    # --- the script, and signals
    Case("model-class-from-cwd-script", [*SD, *SHAPE, *OUT], 0, ("parity passed",),
         how="script"),
    Case("interrupt-inside-lazy-import", ["state.pt", "--model-class",
         "tinynet:InterruptedImport", *SHAPE, *OUT], 130, ("interrupted (SIGINT)",),
         absent=("out",)),
    Case("sigint-during-export", ["state.pt", "--model-class", "tinynet:Stall", *SHAPE, *OUT],
         130, ("interrupted (SIGINT)",), how="sigint",
         env={"NORMEXPORT_TEST_STALL": "export"}, absent=("out/m.onnx",)),
    Case("sigterm-during-write", ["state.pt", "--model-class", "tinynet:Stall", *SHAPE, *OUT],
         143, ("interrupted (SIGTERM)", "temporary files removed"), how="sigterm",
         env={"NORMEXPORT_TEST_STALL": "parity"}),
]  # fmt: skip


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _subprocess(case: Case, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    env = os.environ | {"PYTHONPATH": str(REPO)} | case.env
    if case.how in ("script", "module"):
        script = Path(sys.executable).parent / "normexport"
        if not script.exists():  # what pip writes for the console script
            script = cwd.parent / "normexport-script"
            script.write_text("import sys\nfrom normexport.cli import main\nsys.exit(main())\n")
        command = [sys.executable, str(script), *argv]
        if case.how == "module":
            command = [sys.executable, "-m", "normexport", *argv]
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
        return result.returncode, result.stdout, result.stderr
    ready = cwd.parent / "ready"
    env["NORMEXPORT_TEST_READY"] = str(ready)
    command = [sys.executable, "-m", "normexport", *argv]
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT if case.how == "sigint" else signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out.decode(), err.decode()


def _threads(argv: list[str], capsys) -> tuple[int, str, str]:
    codes = []
    runs = [threading.Thread(target=lambda: codes.append(cli.main(argv))) for _ in range(2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    captured = capsys.readouterr()
    assert len(codes) == 2 and codes[0] == codes[1], codes
    return codes[0], captured.out, captured.err


#: Cases that export a model, run to the end or start a Python process (a second or more each);
#: the others stop at their error before any export and stay in ``make test-fast``.
SLOW_CASES = {
    "sigterm-during-write",
    "sigint-during-export",
    "unexportable-op",
    "model-class-from-cwd-script",
    "interrupt-inside-lazy-import",
    "long-names",
    "input-shape-wrong-size",
    "opset-13-falls-back",
    "opset-13-dynamo",
    "forward-returns-none",
    "training-mode-is-reported",
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.id in SLOW_CASES else [])
        for c in CASES
    ],
)
def test_bad_input(case, shared, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    shutil.copytree(shared, cwd, ignore=shutil.ignore_patterns("__pycache__", MARKER))
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the cwd on it, as -m does
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    if case.setup:
        case.setup()
    ro = _read_only_folder(cwd) if "{ro}" in " ".join(case.argv) else ""
    argv = [a.replace("{ro}", ro) for a in case.argv]
    says = [s.replace("{ro}", ro) for s in case.says]
    argv += ["--no-benchmark", "--provider", "cpu"] if case.fast else []
    before = _digests(cwd)
    for name in list(logging.root.manager.loggerDict):  # torch's log lines reach the terminal
        for handler in logging.getLogger(name).handlers if name.startswith("torch") else []:
            if type(handler) is logging.StreamHandler:
                monkeypatch.setattr(handler, "stream", sys.stderr)
    try:
        if case.how in ("script", "module", "sigint", "sigterm"):
            code, out, err = _subprocess(case, argv, cwd)
        elif case.how == "threads":
            code, out, err = _threads(argv, capsys)
        else:
            code = cli.main(argv)
            out, err = capsys.readouterr()
    finally:
        if ro == "ro":
            (cwd / "ro").chmod(0o755)

    last = (out if code == 0 else err).strip().splitlines()[-1]
    print(f"{case.id}: exit {code}: {last}")  # shown with pytest -rA
    assert "Traceback" not in out + err, out + err
    assert code == case.code, out + err
    if code == 0:
        assert out.strip().splitlines()[-1] == "parity passed", out
        assert all(s in out for s in says), (says, out)
        assert not err.strip(), err
    else:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err  # one line, nothing else
        assert all(s in lines[-1] for s in says), (says, lines[-1])
    after = _digests(cwd)
    assert {k: after.get(k) for k in before} == before  # every input byte unchanged
    left = [p for p in cwd.rglob("*") if p.name.endswith((".tmp", ".work")) or "probe" in p.name]
    assert not left, left
    assert not (shared / MARKER).exists(), "a hostile payload ran"
    for name in case.absent:
        assert not (cwd / name).exists(), name
    if code == 0:  # the output loads (with its external data, where it has some)
        output = cwd / argv[argv.index("-o") + 1] if "-o" in argv else default_output(cwd / argv[0])
        session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
        feeds = {session.get_inputs()[0].name: np.zeros((2, 8), np.float32)}
        assert session.run(None, feeds)[0].shape == (2, 4)


@pytest.mark.parametrize(
    "argv",
    [["nope.onnx"], ["notes.onnx"], ["notes.onnx", "--atol", "nan"], ["explain", "nope.onnx"]],
    ids=["missing", "not_onnx", "bad_option", "explain_missing"],
)
def test_a_mistake_is_answered_before_pytorch_is_imported(tmp_path, argv):
    """The options and the input file are checked before PyTorch, ONNX Runtime, the fusion
    passes (onnxscript) or the pipeline are imported (those imports alone took about 13 s), and
    before onnx and onnx-ir (0.9 s: ml_dtypes, sympy) unless the file must be parsed as ONNX to
    be told apart: the usual mistakes answer in well under a second, exit 2."""
    (tmp_path / "notes.onnx").write_text("a text file named like a model\n")
    heavy = ["torch", "onnxruntime", "onnxscript", "fusion", "normexport.pipeline", "onnx_ir"]
    heavy += ["sympy"] + (["onnx", "ml_dtypes"] if "notes.onnx" not in argv else [])
    code = (
        "import sys\nfrom normexport import cli\ncode = cli.main(sys.argv[1:])\n"
        f"print(code, *[name in sys.modules for name in {heavy}])\n"
    )
    env = os.environ | {"PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.stdout.split() == ["2"] + ["False"] * len(heavy), result.stdout + result.stderr
    assert "normexport: error:" in result.stderr and "Traceback" not in result.stderr


def _endless_loop(path: Path) -> None:
    """A valid model whose Loop runs 2**62 iterations (the fuzzer's hang)."""
    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("v_in", "v_out")]
    cond = [helper.make_tensor_value_info(n, TensorProto.BOOL, []) for n in ("c_in", "c_out")]
    body = helper.make_graph(
        [helper.make_node("Add", ["v_in", "one"], ["v_out"]),
         helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), cond[0], value[0]],
        [cond[1], value[1]],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "cond", "x"], ["y"], body=body)],
        "endless",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [helper.make_tensor("M", TensorProto.INT64, [], [2**62]),
         helper.make_tensor("cond", TensorProto.BOOL, [], [True])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True)
    onnx.save(model, path)


def test_a_run_past_the_run_timeout_is_cancelled(tmp_path):
    """A Loop of 2**62 iterations ran until it was killed, leaving the work folder behind: the
    run is cancelled at --run-timeout (RunOptions.terminate), exit 2 with one line naming the
    limit and the stage, nothing left in the output's folder, the input unchanged."""
    model = tmp_path / "in" / "loop.onnx"
    _endless_loop(model)
    before = model.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(model), "-o", str(out / "loop.onnx"), "--no-benchmark", "--run-timeout", "2"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "normexport", *argv], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    (line,) = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "went past --run-timeout 2 s (the reference stage)" in line, line
    assert list(out.iterdir()) == [] and model.read_bytes() == before
