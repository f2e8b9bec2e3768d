"""The Python API, ``normexport.optimize``, and the one mapping from flags to Options.

The tests on an .onnx file built with onnx.helper run the whole pipeline without exporting
anything (a second or two); the nn.Module test exports, so it is slow.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import fusion
import normexport
from normexport.arguments import Options, add_flags, make_options, options, options_from_args
from normexport.cli import build_explain_parser, build_parser
from normexport.errors import InputFileError, OutputPathError, UsageError
from normexport.precision.int8 import INT8_PRECISIONS
from normexport.report.save import chart

ROOT = Path(__file__).resolve().parents[2]


def _matmul_bn_onnx(path: Path) -> Path:
    """x (2, 4) -> MatMul (4, 3) -> BatchNormalization over 3 channels, random statistics."""
    rng = np.random.default_rng(0)
    stats = {
        "scale": rng.uniform(0.5, 2.0, 3),
        "bias": rng.standard_normal(3),
        "mean": rng.standard_normal(3),
        "var": rng.uniform(0.5, 2.0, 3),
    }
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")]
    inits += [numpy_helper.from_array(v.astype(np.float32), k) for k, v in stats.items()]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node(
                "BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["y"], name="bn"
            ),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def test_import_is_light():
    code = (
        "import sys, normexport; print(sorted({'torch', 'onnx', 'onnxruntime'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_onnx_file_report_fields_and_files(tmp_path, out_dir):
    model = _matmul_bn_onnx(tmp_path / "m.onnx")
    out, json_path = out_dir / "m.opt.onnx", tmp_path / "r.json"
    report = normexport.optimize(
        model, output=out, report=json_path, benchmark=False, provider="cpu"
    )
    assert isinstance(report, normexport.Report)
    assert report.passed and report.parity.oracle == "onnx_float64"
    assert report.kind == "onnx" and report.exporter == "none" and report.exporter_fallback is None
    assert report.fusions.counts["batchnorm_folded"] == 1
    assert report.norm_ops.before == {"BatchNormalization": 1} and report.norm_ops.after == {}
    assert report.output == out and report.files_written == [out] and out.is_file()
    assert report.inputs["x"].shape == [2, 4] and report.latency is None
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(report.to_dict()))
    assert not json_path.with_suffix(".png").exists()  # no latency, no chart


def test_a_missing_output_folder_is_made_only_when_asked(tmp_path):
    """``make_dirs``: without it a missing folder is refused before any work and none is
    made (a typo makes no folders); with it the folders of the model and report are made."""
    model = _matmul_bn_onnx(tmp_path / "m.onnx")
    out, json_path = tmp_path / "a" / "b" / "m.onnx", tmp_path / "r" / "r.json"
    with pytest.raises(OutputPathError, match="the folder .*a/b does not exist.*--make-dirs"):
        normexport.optimize(model, output=out, benchmark=False, provider="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    report = normexport.optimize(
        model, output=out, report=json_path, make_dirs=True, benchmark=False, provider="cpu"
    )
    assert report.passed and out.is_file() and json_path.is_file()


def test_chart_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    """The chart is drawn on a Figure of its own: the backend the caller chose stays."""
    model = _matmul_bn_onnx(tmp_path / "m.onnx")
    code = (
        "import sys, matplotlib; matplotlib.use('pdf'); import normexport\n"
        "normexport.optimize(sys.argv[1], output=sys.argv[2], report=sys.argv[3], "
        "provider='cpu', budget_s=0.2)\n"
        "print(matplotlib.get_backend())"
    )
    files = [str(model), str(tmp_path / "o.onnx"), str(tmp_path / "r.json")]
    out = subprocess.run(
        [sys.executable, "-c", code, *files], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "pdf"
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG")


def test_every_report_key_is_documented(tmp_path):
    """docs/report.md names every key the JSON has (for a run without timing)."""
    report = normexport.optimize(
        _matmul_bn_onnx(tmp_path / "m.onnx"), benchmark=False, provider="cpu"
    )
    documented = set(re.findall(r"`([a-z_0-9]+)`", (ROOT / "docs" / "report.md").read_text()))

    def keys(value, variable=False):
        if isinstance(value, dict):
            for k, v in value.items():
                if not variable:
                    yield k
                # per-output / per-set / per-variant maps: their keys are names, not schema
                yield from keys(
                    v,
                    k in ("inputs", "outputs", "sets", "before", "after", "raw_export_max_abs_err"),
                )
        elif isinstance(value, list):
            for v in value:
                yield from keys(v)

    assert set(keys(report.to_dict())) - documented == set()


def test_errors_are_the_clis(tmp_path):
    with pytest.raises(InputFileError, match="no such file"):
        normexport.optimize(tmp_path / "missing.onnx")
    with pytest.raises(UsageError, match="--atol"):
        normexport.optimize(_matmul_bn_onnx(tmp_path / "m.onnx"), atol=float("nan"))


def test_argument_errors_need_no_model():
    with pytest.raises(UsageError, match="model file path or a torch.nn.Module"):
        normexport.optimize(42)

    class Net:
        def forward(self, x):
            return x

    with pytest.raises(UsageError, match="give output="):
        normexport.optimize(Net())


def test_flags_fill_options_by_name():
    args = build_parser().parse_args(
        ["m.pt", "--no-benchmark", "--budget", "3", "--atol", "1e-3", "--input-shape", "1,3"]
    )
    assert options_from_args(args) == make_options(
        model=Path("m.pt"), benchmark=False, budget_s=3.0, atol=1e-3, input_shape=["1,3"]
    )
    assert options_from_args(build_parser().parse_args(["m.pt"])) == Options(model=Path("m.pt"))
    explain = options_from_args(build_explain_parser().parse_args(["m.pt", "--opset", "18"]))
    assert explain == Options(model=Path("m.pt"), opset=18)


def test_the_flags_are_made_from_the_fields():
    """Each option is one name, declared once: the Options field declares its flag (its
    ``dest`` the field's name, its default the field's; the module and its example arguments
    are the API's only, ``--explain`` and ``--debug`` the CLI's), and every group of flags is
    the main command's."""
    flagged = [f for f in dataclasses.fields(Options) if "flag" in f.metadata]
    actions = {a.dest: a for a in build_parser()._actions}
    assert {f.name for f in flagged} == set(Options.__dataclass_fields__) - {
        "module",
        "args",
        "kwargs",
    }
    assert set(actions) - {"help", "debug", "explain"} == {f.name for f in flagged}
    assert {f.metadata["flag"].group for f in flagged} == set(options.FLAG_GROUPS)
    for field in flagged:
        if field.default not in (dataclasses.MISSING, ()):  # the append flags' None: the field's
            assert actions[field.name].default == field.default, field.name
    bench = argparse.ArgumentParser()
    add_flags(bench, "timing", budget_s=20.0)
    assert bench.parse_args([]).budget_s == 20.0 and "(default 20)" in bench.format_help()
    with pytest.raises(ValueError, match="no flag"):
        add_flags(argparse.ArgumentParser(), "timing", threads=2)
    with pytest.raises(ValueError, match="no group"):
        add_flags(argparse.ArgumentParser(), "timings")


def test_the_api_keywords_are_the_options_fields():
    """``normexport.optimize`` keeps its explicit keywords (help() and editors show them): each
    is a field of Options (the module is ``model``), and its default is the field's, or None
    (which :func:`make_options` reads as the field's)."""
    fields = {f.name: f for f in dataclasses.fields(Options)}
    keywords = inspect.signature(normexport.optimize).parameters
    assert set(keywords) == set(fields) - {"module"}
    for name, keyword in keywords.items():
        field = fields[name]
        default = field.default
        if field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        if name != "model":
            assert keyword.default is None or keyword.default == default, name


def test_the_options_name_the_targets_fusion_has():
    """The CLI checks ``--target`` before ``fusion`` is imported, from its own list."""
    assert options.TARGETS == fusion.TARGETS


def test_the_options_name_the_int8_precisions_the_quantizer_has():
    """``--precision``'s values that quantize are :mod:`normexport.precision.int8`'s, which
    the verdict reads (below the options' layer); half precision is the others but fp32."""
    by_conversion = {
        c: [p for p, to in options.PRECISIONS.items() if to == c] for c in (None, "half", "int8")
    }
    assert by_conversion == {
        None: ["fp32"],
        "half": ["fp16", "bf16"],
        "int8": list(INT8_PRECISIONS),
    }
    assert make_options(model="m.pt", precision="int8-dynamic").conversion == "int8"


def test_the_cli_and_the_api_build_the_same_typed_options():
    """Parsed where they enter: shapes, sizes, dynamic axes and constructor arguments."""
    flags = ["m.pt", "--input-shape", "ids=2x6:int64", "--dim", "seq=16", "--dynamic", "batch"]
    flags += ["--model-class", "pkg.mod:Net", "--model-kwargs", '{"width": 4}']
    typed = options_from_args(build_parser().parse_args(flags))
    assert typed == make_options(
        model="m.pt",
        input_shape=["ids=2x6:int64"],
        dim={"seq": 16},
        dynamic="batch",
        model_class="pkg.mod:Net",
        model_kwargs={"width": 4},
    )
    assert typed.input_shape[0].shape == (2, 6) and typed.input_shape[0].dtype == np.int64
    assert typed.dim == {"seq": 16} and typed.model_kwargs == {"width": 4}
    assert typed.dynamic.axes(["ids", "mask"]) == {"ids": {0: "batch"}, "mask": {0: "batch"}}
    assert make_options(model="m.pt", input_shape=[(1, 3)]).input_shape[0].shape == (1, 3)
    with pytest.raises(UsageError, match="--dim"):
        make_options(model="m.pt", dim={"seq": 0})
    with pytest.raises(UsageError, match="no input named 'x'"):
        make_options(model="m.pt", dynamic="x:0").dynamic.axes(["ids"])


@pytest.mark.slow
def test_module_is_exported_optimized_and_written(tmp_path):
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    net.train()
    out = tmp_path / "net.onnx"
    report = normexport.optimize(net, output=out, input_shape=[(1, 3, 8, 8)], budget_s=0.5)
    assert report.passed and report.kind == "nn_module"
    assert report.fusions.counts["batchnorm_folded"] == 1 and out.is_file()
    assert report.parity.oracle == "pytorch_float64"
    assert set(report.latency.timings) == {"pytorch_eager", "ort_raw", "ort_optimized"}
    assert net.training  # given back as it came
    # the chart: ONNX Runtime's two models on a scale of their own, eager beside, medians written
    ort, eager = chart(report).axes
    assert len(ort.patches) == 2 and len(eager.patches) == 1
    labels = [t.get_text() for t in ort.texts]
    medians = [report.latency.timings[n].median_ms for n in ("ort_raw", "ort_optimized")]
    assert labels == [f"{m:.3g} ms" for m in medians], labels
