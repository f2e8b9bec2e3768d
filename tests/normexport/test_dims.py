"""An ONNX file's example inputs (normexport.io.dims, normexport.io.inputs): symbolic axes
sized by name (``--dim NAME=SIZE``, the usual names' defaults, expressions of names, one size per
name across the inputs), the sizes normexport picks where none is given and the larger ones it
tries where the model refuses them, and token ids drawn within the tables they index.

The models are built node by node (the way Optimum writes a decoder's inputs, a BERT-like
encoder's embeddings, an STFT-as-Conv audio front end) and run through the CLI.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from normexport import cli
from normexport.errors import EXIT_OK, EXIT_USAGE
from normexport.io import dims, files, inputs
from tests.support.graphs import make_model, stft_front_end

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


def _picked(report):
    return next(n for n in report["notes"] if "sizes normexport picked" in n)


def test_usual_names_get_their_defaults_and_the_report_says_so(tmp_path, out_dir, rng):
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng)
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    assert code == EXIT_OK
    assert report["inputs"]["x"]["shape"] == [1, 16, 8]
    assert report["inputs"]["mask"]["shape"] == [1, 32]  # 16 + 16
    note = _picked(report)
    assert "sequence_length=16" in note and "past_sequence_length=16" in note


def test_dim_sets_every_axis_of_that_name_and_their_sums(tmp_path, out_dir, rng):
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng)
    given = ["--dim", "sequence_length=3", "--dim", "past_sequence_length=5", "--dim",
             "batch_size=2"]  # fmt: skip
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx"), *given], tmp_path)
    assert code == EXIT_OK
    assert report["inputs"]["x"]["shape"] == [2, 3, 8]
    assert report["inputs"]["mask"]["shape"] == [2, 8]
    assert not [n for n in report["notes"] if "sizes normexport picked" in n]


def test_a_shape_given_sizes_its_names_in_the_other_inputs(tmp_path, out_dir, rng):
    """``--input-shape x=2x3x8`` sizes ``batch_size`` and ``sequence_length`` in the mask too
    (it got the usual 1 and 16 + 16: two sizes for one name)."""
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng)
    argv = [str(path), "-o", str(out_dir / "m.onnx"), "--input-shape", "x=2x3x8"]
    code, report = _run(argv, tmp_path)
    assert code == EXIT_OK and report["inputs"]["mask"]["shape"] == [2, 19]  # 16 past + 3
    assert "past_sequence_length=16" in _picked(report) and "batch" not in _picked(report)


def test_axes_of_other_names_are_picked_and_said(tmp_path, out_dir, rng):
    """An axis of a name with no default gets the size suggested before (16) and runs; the
    report's note says so (it was exit 2 with a command to copy)."""
    path = _decoder_inputs(tmp_path / "in" / "m.onnx", rng, mask_axis="n_memory + n_text")
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    assert code == EXIT_OK and report["inputs"]["mask"]["shape"] == [1, 32]
    assert "n_memory=16, n_text=16" in _picked(report)


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


def test_a_paddle_input_runs_at_the_image_size(tmp_path, out_dir):
    """``x (-1, 3, ?, ?)``: the axes named ``?`` (Paddle's placeholder) are an image's, 64
    each, and the ``-1`` batch is a batch of 1, not a negative size (it ended the run with exit
    3: ``negative dimensions are not allowed``)."""
    path = _paddle_input(tmp_path / "in folder" / "ppocr.onnx")
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    assert code == EXIT_OK and report["inputs"]["x"]["shape"] == [1, 3, 64, 64]
    assert "x[2]=64, x[3]=64" in _picked(report)


def test_an_unnamed_axis_is_picked(tmp_path, out_dir):
    """A ``-1`` past the first axis has no name to size it by: it is picked on its own (16)."""
    weights = {"w": np.array([0.5, 1.5, 2.0], np.float32).reshape(1, 3, 1)}
    model = make_model([("Mul", ["x", "w"], ["y"], {})], {"x": (F, [1, 3, -1])}, {"y": (F, None)},
                       weights)  # fmt: skip
    model.opset_imports[""] = 17
    path = tmp_path / "in" / "m.onnx"
    path.parent.mkdir()
    files.save_model(model, path, external_data=False)
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    assert code == EXIT_OK and report["inputs"]["x"]["shape"] == [1, 3, 16]
    assert "x[2]=16" in _picked(report)


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
    assert dims.size(ir.SymbolicDim("a + b"), {"a": 2, "b": 5}) == 7
    assert dims.size(ir.SymbolicDim("2 * a - 1"), {"a": 3}) == 5
    assert dims.size(ir.SymbolicDim("mystery"), {}) is None
    assert dims.size(ir.SymbolicDim("a - a"), {"a": 3}) is None  # not a size
    assert dims.size(ir.SymbolicDim(None), {}) is None
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
    assert "cannot run this model" in err[0] and "--dim sizes agree" in err[0]
    code, _ = _run([str(path), *out, "--dim", "past=4", "--dim", "total=20"], tmp_path)
    assert code == EXIT_OK  # 4 + the sequence's usual 16


def test_a_spatial_axis_of_an_image_is_picked_64_and_a_name_has_one_size():
    """At 16 (or 32) a network that downsamples by 32 makes empty tensors (the PaddleOCR
    classifier's outputs came out constant, onnx.reference warned of means of empty slices):
    the axes 2 and 3 of a 4-D input are picked 64, every other axis 16; a name is one size
    across the inputs (``batch`` a first axis here, the second there: 1 in both), and each
    further try grows what was picked, never the batch; the last halves the first."""
    image = ir.Value(name="img", shape=ir.Shape([1, 3, None, None]))
    pixels = ir.Value(name="pix", shape=ir.Shape([1, 3, "height", "width"]))
    ids = ir.Value(name="ids", shape=ir.Shape(["batch", "seq"]))
    state = ir.Value(name="state", shape=ir.Shape([2, "batch", "seq"]))
    first, second, third, last = dims.tries([image, pixels, ids, state], {"seq": 5})
    assert [first.shape(v) for v in (image, pixels, ids, state)] == [
        (1, 3, 64, 64), (1, 3, 64, 64), (1, 5), (2, 1, 5)]  # fmt: skip
    assert first.picked == {"img[2]": 64, "img[3]": 64, "height": 64, "width": 64, "batch": 1}
    assert second.shape(pixels) == (1, 3, 256, 256) and third.shape(image) == (1, 3, 1024, 1024)
    assert third.shape(state) == (2, 1, 5)
    assert last.shape(image) == last.shape(pixels) == (1, 3, 32, 32) and last.shape(ids) == (1, 5)
    assert len(dims.tries([ids], {"seq": 5})) == 1  # nothing to grow: one try


def _embeddings(path, rng):
    """A BERT-like encoder's embeddings: ``input_ids`` index a 100-row table,
    ``token_type_ids`` a 2-row one, ``position_ids`` (cast to int32, plus 2, as RoBERTa offsets
    them) a 20-row one; summed, a hand-written LayerNorm (randomized weight), masked by
    ``attention_mask``; every input (batch, sequence) int64."""
    weights = {
        "word": rng.standard_normal((100, 8)).astype(np.float32),
        "type": rng.standard_normal((2, 8)).astype(np.float32),
        "pos": rng.standard_normal((20, 8)).astype(np.float32),
        "two": np.array(2, np.int32),
        "eps": np.array(1e-5, np.float32),
        "g": rng.uniform(0.5, 1.5, 8).astype(np.float32),
        "axes": np.array([2], np.int64),
    }
    nodes = [
        ("Gather", ["word", "input_ids"], ["e1"], {}),
        ("Gather", ["type", "token_type_ids"], ["e2"], {}),
        ("Cast", ["position_ids"], ["p32"], {"to": ir.DataType.INT32}),
        ("Add", ["p32", "two"], ["p2"], {}),
        ("Gather", ["pos", "p2"], ["e3"], {}),
        ("Add", ["e1", "e2"], ["e12"], {}),
        ("Add", ["e12", "e3"], ["e"], {}),
        ("ReduceMean", ["e", "axes"], ["mu"], {}),
        ("Sub", ["e", "mu"], ["d"], {}),
        ("Mul", ["d", "d"], ["d2"], {}),
        ("ReduceMean", ["d2", "axes"], ["var"], {}),
        ("Add", ["var", "eps"], ["ve"], {}),
        ("Sqrt", ["ve"], ["sd"], {}),
        ("Div", ["d", "sd"], ["n"], {}),
        ("Mul", ["n", "g"], ["ng"], {}),
        ("Cast", ["attention_mask"], ["mf"], {"to": ir.DataType.FLOAT}),
        ("Unsqueeze", ["mf", "axes"], ["m3"], {}),
        ("Mul", ["ng", "m3"], ["y"], {}),
    ]
    axes = ["batch", "sequence"]
    names = ("input_ids", "token_type_ids", "position_ids", "attention_mask")
    inputs = {name: (ir.DataType.INT64, axes) for name in names}
    model = make_model(nodes, inputs, {"y": (F, [*axes, 8])}, weights, opset=18)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.save_model(model, path, external_data=False)
    return path


def test_token_ids_are_drawn_within_the_tables_they_index(tmp_path, out_dir, rng):
    """With no --dim and no --input-shape the BERT-like embeddings run: every input set (the
    example too) draws ``token_type_ids`` in [0, 2) and ``position_ids`` in [0, 18): ids up
    to 99 in the example ended the run with exit 2 (``idx=63 must be within [-2, 1]``)."""
    path = _embeddings(tmp_path / "in" / "bert.onnx", rng)
    model = ir.load(path)
    assert inputs.id_ranges(model) == {"input_ids": 100, "token_type_ids": 2, "position_ids": 18}
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    assert code == EXIT_OK
    assert report["inputs"]["token_type_ids"]["shape"] == [1, 16]
    sizing = inputs.onnx_input_specs(model, [], str(path))
    example = inputs.example_arrays(sizing.specs, inputs.id_ranges(model))
    assert example["token_type_ids"].max() == 1 and example["position_ids"].max() < 18


def _front_end(path, rng, kernel=400, state=False):
    """:func:`tests.support.graphs.stft_front_end` saved at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files.save_model(stft_front_end(rng, kernel, state=state), path, external_data=False)
    return path


def test_a_window_longer_than_the_size_picked_is_tried_larger(tmp_path, out_dir, rng, capsys):
    """A Conv 400 samples wide over a symbolic ``samples`` axis refuses 16 and 256 samples: the
    run goes on at 4096 (exit 0), the report's note (printed) says the size taken and those
    refused, and nothing is on stderr; the state that shares the ``batch`` axis gets the same
    batch of 1."""
    path = _front_end(tmp_path / "in" / "vad.onnx", rng, state=True)
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    out, err = capsys.readouterr()
    assert code == EXIT_OK and not err.strip(), err
    assert report["inputs"]["wave"]["shape"] == [1, 4096]
    assert report["inputs"]["state"]["shape"] == [2, 1, 8]
    said = "batch=1, samples=4096 (the model refused samples=16, 256)"
    assert said in _picked(report) and said in " ".join(out.split())  # wrapped to the terminal


def test_an_image_the_model_takes_at_32_high_only_is_tried_smaller(tmp_path, out_dir, rng, capsys):
    """A text recognizer's height pooled away by 32 and squeezed (PaddleOCR v2's: an image 32
    high, no other): 64, 256 and 1024 refused, the last try, half the first, runs (exit 0), and
    the note says the sizes refused."""
    weights = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}
    nodes = [
        ("Conv", ["img", "w"], ["c"], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
        ("AveragePool", ["c"], ["p"], {"kernel_shape": [32, 1], "strides": [32, 1]}),
        ("Squeeze", ["p", "axis"], ["y"], {}),
    ]
    weights["axis"] = np.array([2], np.int64)
    shapes = {"img": (F, [1, 3, "height", "width"])}, {"y": (F, [1, 4, "width"])}
    path = tmp_path / "in" / "rec.onnx"
    path.parent.mkdir()
    ir.save(make_model(nodes, *shapes, weights, opset=13), path)
    code, report = _run([str(path), "-o", str(out_dir / "m.onnx")], tmp_path)
    out, err = capsys.readouterr()
    assert code == EXIT_OK and not err.strip(), err
    assert report["inputs"]["img"]["shape"] == [1, 3, 32, 32]
    said = "height=32, width=32 (the model refused height=64, 256, 1024; width=64, 256, 1024)"
    assert said in _picked(report), _picked(report)


def test_dim_overrides_the_sizes_picked(tmp_path, out_dir, rng):
    path = _front_end(tmp_path / "in" / "vad.onnx", rng)
    argv = [str(path), "-o", str(out_dir / "m.onnx"), "--dim", "samples=800"]
    code, report = _run(argv, tmp_path)
    assert code == EXIT_OK and report["inputs"]["wave"]["shape"] == [1, 800]
    assert "samples" not in _picked(report)


def test_when_no_size_tried_runs_the_error_says_what_was_tried(tmp_path, out_dir, rng, capsys):
    """A window of 8000 samples: no size tried runs; one line says which and how to give one,
    and blames no file (the model is fine: it runs at 8000)."""
    path = _front_end(tmp_path / "in" / "vad.onnx", rng, kernel=8000)
    out = ["-o", str(out_dir / "m.onnx")]
    code, _ = _run([str(path), *out], tmp_path)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and "tried samples=16, 256, 4096" in line, line
    assert "--dim samples=SIZE" in line and "re-export" not in line, line
    code, _ = _run([str(path), *out, "--dim", "samples=8000"], tmp_path)
    assert code == EXIT_OK
