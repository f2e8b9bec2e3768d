"""The command line, in process: every input kind, every exit code, the report's contents."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import signal

import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper, save
from torch import nn

import fusion
from normexport import cli, errors
from normexport.errors import UsageError
from normexport.io import files
from normexport.io.export import export_module


class ConvBNNet(nn.Module):
    """Conv -> BN -> ReLU -> Conv -> BN, then a hand-written LayerNorm over the last axis."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 4, 3, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.w = nn.Parameter(torch.randn(6))
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        mean = y.mean(-1, keepdim=True)
        var = ((y - mean) ** 2).mean(-1, keepdim=True)
        return (y - mean) / torch.sqrt(var + 1e-5) * self.w + self.b


def make_net() -> ConvBNNet:
    torch.manual_seed(0)
    net = ConvBNNet()
    for bn in (net.bn1, net.bn2):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return net.eval()


SHAPE = "2,3,8,8"
FAST = ["--budget", "0.2"]


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def pickled(tmp_path):
    path = tmp_path / "net.pt"
    torch.save(make_net(), path)
    return path


def test_pickled_module_needs_trust(capsys, pickled):
    code, _, err = run_cli(capsys, pickled, "--input-shape", SHAPE)
    assert code == 2
    assert "--trust-pickle" in err and "Traceback" not in err
    assert not files.default_output(pickled).exists()


@pytest.mark.slow
def test_pickled_module_end_to_end(capsys, pickled, tmp_path, out_dir):
    before = digest(pickled)
    report_path = out_dir / "report.json"
    code, out, _ = run_cli(
        capsys, pickled, "--trust-pickle", "--input-shape", SHAPE, "--report", report_path, *FAST
    )
    assert code == 0, out
    assert digest(pickled) == before  # the input is never touched
    report = json.loads(report_path.read_text())
    assert report["kind"] == "pickled_module"
    assert report["fusions"]["batchnorm_folded"] == 2
    assert report["fusions"]["layernorm_fused"] == 1
    assert report["norm_ops"]["after"] == {"LayerNormalization": 1}
    assert report["parity"]["passed"] and report["parity"]["reference"] == "pytorch"
    assert {"constant", "zeros", "tiny_1e-4", "huge_1e3"} <= set(report["parity"]["probes"])
    assert set(report["latency_ms"]) == {"pytorch_eager", "ort_raw", "ort_optimized"}
    assert report["provider"] in ("CPUExecutionProvider", "CUDAExecutionProvider")
    assert report_path.with_suffix(".png").stat().st_size > 1000
    cost = report["cost"]  # the run's time from the process's start counts the imports too
    assert cost["process_s"] >= cost["wall_s"] > 0, cost
    assert "since the process started" in out
    written = ir.load(files.default_output(pickled))
    assert "BatchNormalization" not in fusion.norm_ops(written)
    assert "parity passed" in out


@pytest.mark.slow
def test_state_dict_needs_model_class(capsys, tmp_path):
    from models.resnet import ResNetSmall

    path = tmp_path / "weights.pt"
    torch.save(ResNetSmall().state_dict(), path)
    code, _, err = run_cli(capsys, path, "--input-shape", "1,3,32,32")
    assert code == 2 and "--model-class" in err
    code, _, err = run_cli(
        capsys, path, "--input-shape", "1,3,32,32", "--model-class", "models.resnet:Nope"
    )
    assert code == 2 and "models.resnet:Nope" in err
    code, out, _ = run_cli(
        capsys,
        path,
        "--input-shape",
        "1,3,32,32",
        "--model-class",
        "models.resnet:ResNetSmall",
        "--no-benchmark",
    )
    assert code == 0, out


@pytest.mark.slow
def test_torchscript_archive(capsys, tmp_path):
    path = tmp_path / "scripted.pt"
    net = make_net()
    torch.jit.save(torch.jit.trace(net, torch.randn(2, 3, 8, 8)), path)
    out_path = tmp_path / "custom.onnx"
    code, out, _ = run_cli(capsys, path, "--input-shape", SHAPE, "-o", out_path, "--no-benchmark")
    assert code == 0, out
    assert out_path.exists()


@pytest.mark.slow
def test_exported_program_carries_its_inputs(capsys, tmp_path):
    path = tmp_path / "program.pt2"
    torch.export.save(torch.export.export(make_net(), (torch.randn(2, 3, 8, 8),)), path)
    report_path = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, path, "--no-benchmark", "--report", report_path)
    assert code == 0, out
    report = json.loads(report_path.read_text())
    assert report["kind"] == "exported_program"
    assert report["fusions"]["batchnorm_folded"] == 2


@pytest.mark.slow
def test_onnx_input_is_checked_against_unoptimized_onnx(capsys, tmp_path):
    exported = export_module(make_net(), [torch.randn(2, 3, 8, 8)], input_names=["x"])
    path = tmp_path / "net.onnx"
    ir.save(exported.model, path)
    before = digest(path)
    report_path = tmp_path / "r.json"
    code, out, _ = run_cli(capsys, path, "--report", report_path, *FAST)
    assert code == 0, out
    assert "(onnx, as given, target ort)" in out  # not "exporter none"
    report = json.loads(report_path.read_text())
    assert report["parity"]["reference"] == "onnx"
    assert set(report["latency_ms"]) == {"ort_raw", "ort_optimized"}
    assert digest(path) == before
    assert (tmp_path / "net.opt.onnx").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["missing.pt"], "no such file"),
        (["garbage.bin"], "not a torch.save file"),
        (["garbage.dat"], "not a model file"),
        (["net.pt", "--trust-pickle"], "--input-shape"),
        (["net.pt", "--trust-pickle", "--input-shape", "1;3"], "--input-shape"),
        (["net.pt", "--trust-pickle", "--input-shape", SHAPE, "--dynamic", "x:zz"], "--dynamic"),
        (["net.pt", "--trust-pickle", "--input-shape", SHAPE, "-o", "net.pt"], "never overwrites"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    torch.save(make_net(), tmp_path / "net.pt")
    (tmp_path / "garbage.bin").write_bytes(b"\x00not a model\x01" * 10)
    (tmp_path / "garbage.dat").write_bytes(b"\x00not a model\x01" * 10)
    code, _, err = run_cli(capsys, *argv, "--no-benchmark")
    assert code == 2
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="no such file"):
        cli.main([str(tmp_path / "missing.pt"), "--debug"])


@pytest.mark.slow
def test_wrong_model_fails_parity_and_exits_1(capsys, pickled, monkeypatch, tmp_path):
    """A deliberately broken optimizer: the parity check must catch it."""
    real_optimize = fusion.optimize

    def broken_optimize(model, *args, **kwargs):
        report = real_optimize(model, *args, **kwargs)
        conv = next(n for n in model.graph if n.op_type == "Conv")
        weight = conv.inputs[1].const_value
        conv.inputs[1].const_value = ir.tensor(weight.numpy() * 1.01, name=weight.name)
        return report

    monkeypatch.setattr(fusion, "optimize", broken_optimize)
    report_path = tmp_path / "r.json"
    code, out, _ = run_cli(
        capsys,
        pickled,
        "--trust-pickle",
        "--input-shape",
        SHAPE,
        "--no-benchmark",
        "--report",
        report_path,
    )
    assert code == 1
    assert files.default_output(pickled).exists()  # still written
    report = json.loads(report_path.read_text())
    assert not report["parity"]["passed"] and report["parity"]["failures"]
    assert "diverges" in out


class LookAlike(nn.Module):
    """A LayerNorm next to an RMSNorm look-alike with eps outside the root (not an RMSNorm)."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + 1e-5)
        return y / (torch.sqrt((y * y).mean(-1, keepdim=True)) + 1e-6)


@pytest.mark.slow
def test_explain_lists_fused_and_left_alone_with_reasons(capsys, tmp_path):
    exported = export_module(LookAlike(), [torch.randn(2, 8)], input_names=["x"])
    path = tmp_path / "lookalike.onnx"
    ir.save(exported.model, path)
    code, out, _ = run_cli(capsys, "explain", path)
    assert code == 0
    assert "LayerNormalization" in out and "fused: 1" in out
    assert "eps outside the square root" in " ".join(out.split())
    assert "left alone: 1" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lookalike.onnx"]  # writes nothing


@pytest.mark.slow
def test_main_command_explain_flag(capsys, pickled):
    code, out, _ = run_cli(
        capsys, pickled, "--trust-pickle", "--input-shape", SHAPE, "--no-benchmark", "--explain"
    )
    assert code == 0
    assert "What became of each norm" in out
    assert "folded into Conv" in " ".join(out.split())


def test_explain_usage_error_exits_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, "explain", tmp_path / "nope.onnx")
    assert code == 2 and "no such file" in err


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("net.pt", "net.opt.onnx"),
        ("ch_ppocr_mobile_v2.0_cls_infer.onnx", "ch_ppocr_mobile_v2.0_cls_infer.opt.onnx"),
        ("model.opt.onnx", "model.opt.opt.onnx"),
    ],
)
def test_default_output_is_beside_the_input(tmp_path, name, expected):
    assert files.default_output(tmp_path / name) == tmp_path / expected


class Residual(nn.Module):
    """x + linear(x), then LayerNorm: the Add + LayerNormalization that ORT turns into Skip."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(x + self.linear(x))


@pytest.mark.slow
def test_autotune_records_candidates_and_keeps_parity(capsys, tmp_path):
    path = tmp_path / "residual.pt"
    torch.save(Residual().eval(), path)
    report_path = tmp_path / "r.json"
    code, out, _ = run_cli(
        capsys, path, "--trust-pickle", "--input-shape", "2,16,32", "--autotune",
        "--no-benchmark", "--budget", "0.4", "--report", report_path,
    )  # fmt: skip
    assert code == 0, out
    tuned = json.loads(report_path.read_text())["autotune"]
    assert tuned["best"] in tuned["timings_ms"] and tuned["default"] in tuned["timings_ms"]
    assert len(tuned["timings_ms"]) >= 2  # the default and at least one alternative form
    assert "autotune on CPUExecutionProvider" in out
    if tuned["disabled_optimizers"]:
        assert "disabled_optimizers" in out


@pytest.mark.slow
def test_autotune_choice_becomes_the_output(capsys, tmp_path, out_dir, monkeypatch):
    """Where autotune keeps another form than the default, that form is what is written (with
    its own external data) and what parity judges."""
    from normexport.tuning import autotune

    real = autotune.autotune

    def prefer_no_skip_fusion(cands, *args, **kwargs):
        result = real(cands, *args, **kwargs)
        other = next(n for n in result.timings if n.endswith("+no_skip_fusion"))
        return dataclasses.replace(result, best=other)

    monkeypatch.setattr(autotune, "autotune", prefer_no_skip_fusion)
    path = tmp_path / "residual.pt"
    torch.save(Residual().eval(), path)
    out_path = out_dir / "residual.opt.onnx"
    report_path = tmp_path / "r.json"
    code, out, _ = run_cli(
        capsys, path, "--trust-pickle", "--input-shape", "2,16,32", "--autotune", "-o", out_path,
        "--no-benchmark", "--budget", "0.2", "--report", report_path,
    )  # fmt: skip
    assert code == 0, out
    report = json.loads(report_path.read_text())
    assert report["autotune"]["best"].endswith("+no_skip_fusion")
    assert report["autotune"]["disabled_optimizers"] == [autotune.SKIP_FUSION]
    assert report["parity"]["passed"]
    assert sorted(p.name for p in out_path.parent.iterdir()) == ["residual.opt.onnx"]
    ops = [n.op_type for n in ir.load(out_path).graph]
    assert "LayerNormalization" in ops and "SkipLayerNormalization" not in ops


# --- subcommands and exit codes --------------------------------------------------------------


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert stopped.value.code == 0
    assert out.startswith("usage: normexport [explain | bench] MODEL [options]")
    for name, line in cli.SUBCOMMANDS.items():
        assert f"normexport {name} MODEL" in out and line in out
    assert "--input-shape" in out and "--autotune" in out  # the main command's own flags


@pytest.mark.parametrize("name", list(cli.SUBCOMMANDS))
def test_each_subcommand_has_its_own_help(capsys, name):
    with pytest.raises(SystemExit) as stopped:
        cli.main([name, "--help"])
    out = capsys.readouterr().out
    assert stopped.value.code == 0 and out.startswith(f"usage: normexport {name} ")
    assert "--debug" in out and "--provider" in out and "--autotune" not in out


def test_a_model_named_like_a_subcommand_is_the_main_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "./bench", "--no-benchmark")
    assert code == 2 and "bench: no such file" in err


def test_exit_codes_are_the_documented_numbers():
    assert (errors.EXIT_OK, errors.EXIT_PARITY_FAILED, errors.EXIT_USAGE, errors.EXIT_BUG) == (
        0, 1, 2, 3
    )  # fmt: skip
    assert errors.exit_status(UsageError("--x 1: no")) == (2, "normexport: error: --x 1: no")
    assert errors.exit_status(errors.InputFileError("m.pt: damaged"))[0] == 2
    assert errors.exit_status(errors.Interrupted(signal.SIGTERM))[0] == 143
    assert errors.exit_status(KeyboardInterrupt())[0] == 130
    assert errors.exit_status(RuntimeError("boom"))[0] == 3


def test_in_a_log_the_stages_are_lines_and_the_tables_whole(capsys, tmp_path, out_dir, monkeypatch):
    """Where the output is no terminal (a pipe, a CI log: capsys here) each stage prints a line
    as it starts and as it ends (time, memory), before the report, and the tables are drawn
    wide enough that no header or number is cut (rich's 80 columns cut them to ``optimi…``)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    model = tmp_path / "in" / "m.onnx"
    model.parent.mkdir()
    torch.onnx.export(make_net().eval(), (torch.randn(2, 3, 8, 8),), model, dynamo=False)
    code, out, _ = run_cli(capsys, model, "-o", out_dir / "m.onnx", "--no-benchmark")
    assert code == 0, out
    lines = out.splitlines()
    assert lines.index("stage load: started") < lines.index("parity passed")
    assert any(line.startswith("stage parity: ") and " s" in line for line in lines), out
    assert "…" not in out and "optimized" in out, out


def test_a_weak_check_is_said_without_a_doubled_quote(capsys, tmp_path):
    """An output whose reference is constant: 'the reference is constant (within atol) for
    output 'y'' (it said "output 'y''s reference", a doubled quote)."""
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "zero"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [zero],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, tmp_path / "m.onnx")
    code, out, _ = run_cli(capsys, tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--no-benchmark")
    text = " ".join(out.split())
    assert code == 0 and "the reference is constant (within atol) for output 'y'" in text, out
    assert "''" not in text
