"""Symbolic axes sized by name (normexport.io.dims): ``--dim NAME=SIZE``, the usual names'
defaults, expressions of names, and the one error that names every input's axes.

The model is built with onnx-ir the way Optimum writes a decoder's inputs (``batch_size``,
``sequence_length``, ``past_sequence_length + sequence_length``), and run through the CLI.
"""

from __future__ import annotations

import json
import shlex

import numpy as np
import onnx_ir as ir
import pytest

from normexport import cli
from normexport.errors import EXIT_OK, EXIT_USAGE
from normexport.io import dims, files
from tests.support.graphs import make_model

F = ir.DataType.FLOAT


def _decoder_inputs(path, rng, mask_axis="past_sequence_length + sequence_length"):
    """x (batch_size, sequence_length, 8) and mask (batch_size, ``mask_axis``): y = the mean
    of x over its last axis times a randomized weight, plus the mask's mean (shape (batch,))."""
    weights = {"w": rng.uniform(0.5, 1.5, 8).astype(np.float32)}
    nodes = [
        ("Mul", ["x", "w"], ["xw"], {}),
        ("ReduceMean", ["xw"], ["mx"], {"axes": [1, 2], "keepdims": 0}),
        ("ReduceMean", ["mask"], ["mm"], {"axes": [1], "keepdims": 0}),
        ("Add", ["mx", "mm"], ["y"], {}),
    ]
    inputs = {
        "x": (F, ["batch_size", "sequence_length", 8]),
        "mask": (F, ["batch_size", mask_axis]),
    }
    model = make_model(nodes, inputs, {"y": (F, ["batch_size"])}, weights)
    model.opset_imports[""] = 17
    path.parent.mkdir(parents=True, exist_ok=True)
    files.save_model(model, path, external_data=False)
    return path


def _run(argv, tmp_path):
    report = tmp_path / "r.json"
    code = cli.main([*argv, "--no-benchmark", "--provider", "cpu", "--report", str(report)])
    return code, json.loads(report.read_text()) if report.exists() else None


def test_usual_names_get_their_defaults_and_the_report_says_so(tmp_path, out_dir, rng):
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng)
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    assert code == EXIT_OK
    assert report["inputs"]["x"]["shape"] == [1, 16, 8]
    assert report["inputs"]["mask"]["shape"] == [1, 32]  # 16 + 16
    note = next(n for n in report["notes"] if "usual size" in n)
    assert "sequence_length=16" in note and "past_sequence_length=16" in note


def test_dim_sets_every_axis_of_that_name_and_their_sums(tmp_path, out_dir, rng):
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng)
    given = ["--dim", "sequence_length=3", "--dim", "past_sequence_length=5", "--dim",
             "batch_size=2"]  # fmt: skip
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx"), *given], tmp_path)
    assert code == EXIT_OK
    assert report["inputs"]["x"]["shape"] == [2, 3, 8]
    assert report["inputs"]["mask"]["shape"] == [2, 8]
    assert not [n for n in report["notes"] if "usual size" in n]


def test_unknown_axes_are_one_error_with_a_command_that_works(tmp_path, out_dir, rng, capsys):
    """An axis of a name with no default: exit 2, one line naming every input and its axes,
    and the command it prints runs."""
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng, mask_axis="n_memory + n_text")
    out = out_dir / "m.onnx"
    code, _ = _run([str(path), "-o", str(out)], tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(err) == 1, err
    line = err[0]
    assert "x (batch_size, sequence_length, 8)" in line
    assert "mask (batch_size, n_memory + n_text)" in line
    command = shlex.split(line.split("e.g.: ", 1)[1])
    assert command[:2] == ["normexport", str(path)]
    assert "--dim" in command and "n_memory=16" in command and "n_text=16" in command
    code, report = _run([*command[1:], "-o", str(out)], tmp_path)
    assert code == EXIT_OK and report["inputs"]["mask"]["shape"] == [1, 32]


def _paddle_input(path):
    """A Paddle export's input ``x (-1, 3, ?, ?)``: a batch of any size written ``-1``, two
    axes named ``?``, and one ``(-1, 3, ?, ?)`` with the last axis unnamed; y = x * w."""
    weights = {"w": np.array([0.5, 1.5, 2.0], np.float32).reshape(1, 3, 1, 1)}
    nodes = [("Mul", ["x", "w"], ["y"], {})]
    shape = [-1, 3, "?", "?"]
    model = make_model(nodes, {"x": (F, shape)}, {"y": (F, shape)}, weights)
    model.opset_imports[""] = 17
    path.parent.mkdir(parents=True, exist_ok=True)
    files.save_model(model, path, external_data=False)
    return path


def test_the_command_suggested_for_a_paddle_input_runs(tmp_path, out_dir, capsys):
    """``x (-1, 3, ?, ?)``: the suggestion sizes the axes named ``?`` (quoted for the shell)
    and the ``-1`` batch is a batch of 1, not a negative size (it ended the run with exit 3:
    ``negative dimensions are not allowed``)."""
    path = _paddle_input(tmp_path / "in folder" / "ppocr.onnx")
    out = out_dir / "m.onnx"
    code, _ = _run([str(path), "-o", str(out)], tmp_path)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and "x (-1, 3, ?, ?)" in line, line
    command = shlex.split(line.split("e.g.: ", 1)[1])
    assert command[:2] == ["normexport", str(path)] and "?=64" in command, command
    code, report = _run([*command[1:], "-o", str(out)], tmp_path)
    assert code == EXIT_OK and report["inputs"]["x"]["shape"] == [1, 3, 64, 64]


def test_an_unnamed_axis_gets_an_input_shape_that_runs(tmp_path, out_dir, capsys):
    """A ``-1`` past the first axis has no name to size it by: the suggestion gives the input's
    whole shape (the batch 1, the others 16), and it runs."""
    weights = {"w": np.array([0.5, 1.5, 2.0], np.float32).reshape(1, 3, 1)}
    model = make_model([("Mul", ["x", "w"], ["y"], {})], {"x": (F, [1, 3, -1])}, {"y": (F, None)},
                       weights)  # fmt: skip
    model.opset_imports[""] = 17
    path = tmp_path / "in" / "m.onnx"
    path.parent.mkdir()
    files.save_model(model, path, external_data=False)
    out = out_dir / "m.onnx"
    code, _ = _run([str(path), "-o", str(out)], tmp_path)
    (line,) = capsys.readouterr().err.strip().splitlines()
    command = shlex.split(line.split("e.g.: ", 1)[1])
    assert code == EXIT_USAGE and "x=1x3x16" in command, line
    code, report = _run([*command[1:], "-o", str(out)], tmp_path)
    assert code == EXIT_OK and report["inputs"]["x"]["shape"] == [1, 3, 16]


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("seq=4", "no input of"),
        ("sequence_length", "expected NAME=SIZE"),
        ("sequence_length=0", "expected NAME=SIZE"),
    ],
)
def test_a_bad_dim_is_one_line_naming_it(tmp_path, out_dir, rng, capsys, flag, words):
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng)
    code, _ = _run([str(path), "-o", str(out_dir / "m.onnx"), "--dim", flag], tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(err) == 1 and words in err[0] and "--dim" in err[0]


def test_axis_expressions():
    used: dict[str, int] = {}
    assert dims.size(ir.SymbolicDim("a + b"), {"a": 2, "b": 5}, used) == 7
    assert dims.size(ir.SymbolicDim("2 * a - 1"), {"a": 3}, used) == 5
    assert dims.size(ir.SymbolicDim("total_sequence_length"), {}, used) == 32
    assert used == {"total_sequence_length": 32}
    assert dims.size(ir.SymbolicDim("mystery"), {}, used) is None
    assert dims.size(ir.SymbolicDim("a - a"), {"a": 3}, used) is None  # not a size
    assert dims.size(ir.SymbolicDim(None), {}, used) is None
    assert dims.names(ir.SymbolicDim("a + b * 2")) == ["a", "b"]


def test_sizes_that_disagree_are_named_in_the_error(tmp_path, out_dir, rng, capsys):
    """A mask over the past and the new tokens, its axis named apart (as a dynamo export with
    its own ``Dim`` names writes it): sizes given that disagree are the user's to fix, and the
    error says which flags to check."""
    nodes = [
        ("Concat", ["past", "x"], ["both"], {"axis": 1}),
        ("Add", ["both", "mask"], ["y"], {}),
    ]
    inputs = {
        "x": (F, ["batch", "sequence"]),
        "past": (F, ["batch", "past"]),
        "mask": (F, ["batch", "total"]),
    }
    model = make_model(nodes, inputs, {"y": (F, ["batch", "total"])})
    path = tmp_path / "in" / "m.onnx"
    path.parent.mkdir(parents=True)
    files.save_model(model, path, external_data=False)
    out = ["-o", str(out_dir / "m.onnx")]
    code, _ = _run([str(path), *out, "--dim", "past=4", "--dim", "total=4"], tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(err) == 1, err
    assert "cannot run this model as given" in err[0] and "--dim sizes agree" in err[0]
    code, _ = _run([str(path), *out, "--dim", "past=4", "--dim", "total=20"], tmp_path)
    assert code == EXIT_OK  # 4 + the sequence's usual 16


def test_a_spatial_axis_of_an_image_is_suggested_64():
    """At 16 (or 32) a network that downsamples by 32 makes empty tensors (the PaddleOCR
    classifier's outputs came out constant, onnx.reference warned of means of empty slices):
    the axes 2 and 3 of a 4-D input are suggested 64, every other axis 16."""
    image = ir.Value(name="img", shape=ir.Shape([1, 3, None, None]))
    pixels = ir.Value(name="pix", shape=ir.Shape([1, 3, "height", "width"]))
    ids = ir.Value(name="ids", shape=ir.Shape(["batch", "seq"]))
    error = dims.missing("m.onnx", [image, pixels, ids], ["height", "width", "seq"], [image])
    command = shlex.split(str(error).split("e.g.: ", 1)[1])
    assert "height=64" in command and "width=64" in command and "seq=16" in command, command
    assert "img=1x3x64x64" in command, command
