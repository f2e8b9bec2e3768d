"""``normexport bench`` on an exported PyTorch model: its variants, IO-binding runs, the floor,
the sweep and the CLI: structure only (keys, ratios, provider labels, files written). No timed
assertions. The one-op tests of variants, sessions and autotune are in ``test_variants.py``."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto
from rich.console import Console
from torch import nn

from normexport import cli, runtime
from normexport.arguments import options_from_args
from normexport.bench import command, variants
from normexport.bench.bench_options import BENCH_BUDGET_S, BenchOptions, sweep_points
from normexport.bench.fixed import fixed_axes, fixed_line
from normexport.bench.measure import EAGER, bench_model, resize_inputs
from normexport.bench.render import render, write_chart
from normexport.bench.results import BenchResult
from normexport.errors import EXIT_OK, EXIT_USAGE, UsageError
from normexport.io.export import export_module
from normexport.latency.measure import runner
from tests.support.graphs import make_model

pytestmark = pytest.mark.slow  # exports PyTorch models

HIDDEN = 16


class ResidualLayerNorm(nn.Module):
    """Two blocks ``h = h + LayerNorm(h)``, the LayerNorm written by hand."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(1 + 0.5 * torch.randn(2, HIDDEN))
        self.b = nn.Parameter(0.1 * torch.randn(2, HIDDEN))

    def forward(self, h):
        for i in range(2):
            mean = h.mean(-1, keepdim=True)
            var = ((h - mean) ** 2).mean(-1, keepdim=True)
            h = h + (h - mean) / torch.sqrt(var + 1e-5) * self.w[i] + self.b[i]
        return h


def raw_export(dynamic: bool = True) -> tuple[ir.Model, dict[str, np.ndarray], nn.Module]:
    module = ResidualLayerNorm().eval()
    x = np.random.default_rng(0).standard_normal((2, 4, HIDDEN)).astype(np.float32)
    axes = {"h": {0: "batch", 1: "sequence"}} if dynamic else None
    exported = export_module(module, [torch.from_numpy(x)], input_names=["h"], dynamic_axes=axes)
    return exported.model, {"h": x}, module


@pytest.fixture(scope="module")
def small_result() -> BenchResult:
    raw, example, module = raw_export()
    opts = BenchOptions(batches=[1, 3], seqs=[None], budget_s=0.2)
    return bench_model(raw, example, opts, module=module)


@pytest.fixture(scope="module")
def small_bench(small_result) -> dict:
    """The result's JSON form, as ``--json`` writes it."""
    return json.loads(json.dumps(small_result.to_dict()))


# --- runtime ---------------------------------------------------------------------------------


def test_bound_run_matches_plain_run_and_keeps_outputs():
    raw, example, _ = raw_export()
    session = runtime.make_session(raw, "cpu", spinning=False)
    plain = runtime.run(session, example)
    run_once, outputs = runner(session, example, io_binding=True)
    run_once()
    np.testing.assert_array_equal(outputs()[0], plain[0])
    run_plain, outputs_plain = runner(session, example, io_binding=False)
    np.testing.assert_array_equal(outputs_plain()[0], plain[0])


# --- inputs and arguments ------------------------------------------------------------------


def test_resize_inputs_repeats_the_example_cyclically():
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    image = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    out = resize_inputs({"ids": ids, "image": image}, batch=3, seq=5)
    np.testing.assert_array_equal(out["ids"], [[0, 1, 2, 0, 1], [3, 4, 5, 3, 4], [0, 1, 2, 0, 1]])
    assert out["image"].shape == (3, 5, 2, 2)  # axis 1 of every input of rank >= 2
    assert resize_inputs({"v": np.arange(4)}, batch=2, seq=7)["v"].tolist() == [0, 1]
    assert resize_inputs({"ids": ids}, None, None)["ids"].shape == (2, 3)


def test_parser_and_size_errors():
    args = command.build_parser().parse_args(["m.pt", "--batch", "1,8", "--seq", "16", "--debug"])
    assert (args.batch, args.seq, args.io_binding, args.debug) == ("1,8", "16", None, True)
    assert command._sizes("1,8,64", "--batch") == [1, 8, 64]
    assert command._sizes(None, "--seq") == [None]
    for bad in ("1,x", "0,2"):
        with pytest.raises(UsageError, match="--batch"):
            command._sizes(bad, "--batch")


def test_shared_flags_fill_the_shared_options():
    """--provider and --budget are the main command's flags (same dest, same Options field);
    bench keeps its own default budget."""
    argv = ["m.pt", "--provider", "cpu", "--target", "onnx", "--opset", "18"]
    opts = options_from_args(command.build_parser().parse_args(argv))
    assert (opts.provider, opts.target, opts.opset) == ("cpu", "onnx", 18)
    assert opts.budget_s == BENCH_BUDGET_S == BenchOptions().budget_s
    args = command.build_parser().parse_args(["m.pt", "--budget", "3"])
    assert options_from_args(args).budget_s == 3.0


def test_sweep_points_grid_and_cross():
    assert sweep_points([1, 8], [16, 128]) == [(1, 16), (8, 16), (1, 128), (8, 128)]
    assert sweep_points([1, 8, 64], [16, 128, 512], "cross") == [
        (1, 16), (8, 16), (64, 16), (1, 128), (1, 512)
    ]  # fmt: skip
    assert sweep_points([1, 8], [None], "cross") == [(1, None), (8, None)]
    with pytest.raises(ValueError, match="sweep"):
        sweep_points([1], [None], "diagonal")


# --- variants --------------------------------------------------------------------------------


def test_build_variants_builds_all_and_records_a_broken_one(monkeypatch, tmp_path):
    raw, _, _ = raw_export()

    def broken(raw, out, provider, policy):
        raise RuntimeError("optimizer exploded")

    monkeypatch.setitem(variants._BUILDERS, "onnxscript_ort", broken)
    built = variants.build_variants(raw, "cpu", tmp_path)
    assert list(built) == list(variants.VARIANTS)
    for name, variant in built.items():  # files in the folder given, never the raw's copies
        assert variant.model is None or variant.model.parent == tmp_path, name
    assert built["onnxscript_ort"].model is None
    assert built["onnxscript_ort"].error == "RuntimeError: optimizer exploded"
    assert built["normexport"].norm_ops == {"LayerNormalization": 2}
    assert built["normexport"].details == {"layernorm_fused": 2}  # fusion counts, zeros left out
    assert built["ort_raw"].norm_ops == {}
    assert built["ort_offline"].to_dict()["session_optimization"] == "ORT_DISABLE_ALL"
    assert built["normexport"].to_dict()["session_optimization"] == "ORT_ENABLE_ALL"
    with pytest.raises(ValueError, match="unknown variant"):
        variants.build_variants(raw, "cpu", tmp_path, only=["nope"])


# --- bench_model -----------------------------------------------------------------------------


def test_bench_model_structure(small_result, small_bench):
    assert small_result.provider == small_bench["provider"]
    assert [p.batch for p in small_result.points] == [1, 3]
    r = small_bench
    assert r["provider"] == "CPUExecutionProvider" == r["machine"]["provider"]
    assert "gpu" not in r["machine"]  # a CPU run never names a GPU
    assert set(r["variants"]) == set(variants.VARIANTS)
    assert r["variants"]["normexport"]["ort_ran_norm_ops"] is not None
    assert [p["inputs"]["h"] for p in r["points"]] == [[1, 4, HIDDEN], [3, 4, HIDDEN]]
    for p in r["points"]:
        assert set(p["latency_ms"]) == {EAGER, *variants.VARIANTS}
        assert p["errors"] == {}
        assert p["reference"] == EAGER
        assert set(p["ratio_to_normexport"]) == {EAGER, *variants.VARIANTS} - {"normexport"}
        assert set(p["ratio_to_eager"]) == set(variants.VARIANTS)
        assert all(d < 1e-4 for d in p["max_abs_diff"].values())
        vs = p["normexport_vs_best"]
        assert vs["best_other"] in variants.VARIANTS and vs["best_other"] != "normexport"
        assert vs["within_spread"] == (vs["ratio"]["ci_low"] <= 1.0)
        for t in p["latency_ms"].values():
            assert t["min_ms"] <= t["median_ms"] <= t["p90_ms"] <= t["max_ms"]
            assert t["ci_low_ms"] <= t["median_ms"] <= t["ci_high_ms"]
        for ratio in p["ratio_to_normexport"].values():
            assert ratio["ci_low"] <= ratio["median"] <= ratio["ci_high"]


def test_best_other_is_the_fastest_other_optimizer(small_bench):
    for p in small_bench["points"]:
        others = {
            k: t["median_ms"]
            for k, t in p["latency_ms"].items()
            if k in variants.VARIANTS and k != "normexport"
        }
        assert p["normexport_vs_best"]["best_other"] == min(others, key=others.get)


def test_floor_compares_the_fused_norm_with_one_elementwise_op(small_bench):
    floor = small_bench["floor"]
    assert floor["op"] == "LayerNormalization"
    assert floor["shape"] == [1, 4, HIDDEN]
    assert floor["provider"] == "CPUExecutionProvider"
    assert {"norm_ms", "elementwise_ms", "norm_over_floor"} <= set(floor)


def test_a_variant_that_fails_to_run_is_recorded_not_fatal():
    raw, example, module = raw_export(dynamic=False)  # batch fixed at 2
    opts = BenchOptions(batches=[3], floor=False, budget_s=0.1)
    r = bench_model(raw, example, opts, module=module)
    p = r.to_dict()["points"][0]
    assert set(p["errors"]) == set(variants.VARIANTS)  # ORT refuses batch 3
    assert set(p["latency_ms"]) == {EAGER}  # eager still timed
    assert p["ratio_to_normexport"] == {} and p["normexport_vs_best"] is None


# --- CLI -------------------------------------------------------------------------------------


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "stack.pt"
    torch.save(ResidualLayerNorm().eval(), path)
    return path


def test_cli_bench_writes_json_and_chart(tmp_path, model_file, capsys, monkeypatch):
    monkeypatch.setattr(
        runtime,
        "resolve_provider",
        lambda requested: ("cpu", "CUDA was not available (the CUDA provider did not load): "
                           "ran on CPU"),
    )  # fmt: skip
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code = cli.main(
        ["bench", str(model_file), "--trust-pickle", "--input-shape", f"2,4,{HIDDEN}"]
        + ["--batch", "1,2", "--seq", "4,8", "--budget", "0.4", "--variants", "ort_raw,normexport"]
        + ["--json", str(out_json), "--chart", str(out_png)]
    )
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert out.count("CUDA was not available") == 1
    r = json.loads(out_json.read_text())
    assert r["provider"] == "CPUExecutionProvider"
    assert r["provider_note"].startswith("CUDA was not available")
    assert [(p["batch"], p["seq"]) for p in r["points"]] == [(1, 4), (2, 4), (1, 8), (2, 8)]
    assert set(r["variants"]) == {"ort_raw", "normexport"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_cross_sweep_with_few_runs(tmp_path, model_file):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code = cli.main(
        ["bench", str(model_file), "--trust-pickle", "--input-shape", f"2,4,{HIDDEN}"]
        + ["--batch", "1,2", "--seq", "4,8", "--sweep", "cross", "--min-runs", "3"]
        + ["--budget", "0.1", "--variants", "ort_raw,normexport", "--no-eager", "--no-floor"]
        + ["--json", str(out_json), "--chart", str(out_png)]
    )
    assert code == 0
    r = json.loads(out_json.read_text())
    assert [(p["batch"], p["seq"]) for p in r["points"]] == [(1, 4), (2, 4), (1, 8)]
    shapes = [next(iter(p["inputs"].values())) for p in r["points"]]
    assert shapes == [[1, 4, HIDDEN], [2, 4, HIDDEN], [1, 8, HIDDEN]]
    assert all(t["runs"] >= 3 for p in r["points"] for t in p["latency_ms"].values())
    assert r["settings"]["sweep"] == "cross" and r["settings"]["min_runs"] == 3
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_usage_errors(model_file, capsys, monkeypatch):
    base = ["bench", str(model_file), "--trust-pickle", "--input-shape", f"2,4,{HIDDEN}"]
    assert cli.main([*base, "--provider", "cpu", "--cuda-graph"]) == EXIT_USAGE
    assert "--cuda-graph needs the CUDA provider, not --provider cpu" in capsys.readouterr().err
    assert cli.main([*base, "--variants", "bogus"]) == EXIT_USAGE
    assert "--variants" in capsys.readouterr().err
    assert cli.main([*base, "--min-runs", "1"]) == EXIT_USAGE
    assert "--min-runs 1: give at least 3" in capsys.readouterr().err
    assert cli.main([*base, "--chart", "typo/b.png"]) == EXIT_USAGE  # before any timing
    assert "--chart typo/b.png: the folder typo does not exist" in capsys.readouterr().err
    # bench's own budget, checked by the shared check_options
    assert cli.main([*base, "--provider", "cpu", "--budget", "0"]) == EXIT_USAGE
    assert "--budget 0.0: give a number of seconds > 0" in capsys.readouterr().err
    # one CUDA-graph check, on the provider resolved: auto without CUDA is refused too
    monkeypatch.setattr(runtime, "resolve_provider", lambda requested: ("cpu", "no CUDA here"))
    assert cli.main([*base, "--cuda-graph"]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert "no CUDA here" in out
    assert "--cuda-graph needs the CUDA provider, and it is not in use here" in err


def test_a_floor_that_fails_is_recorded_not_fatal(monkeypatch):
    from normexport.bench import measure

    def broken(*args, **kwargs):
        raise RuntimeError("floor exploded")

    monkeypatch.setattr(measure, "norm_floor", broken)
    raw, example, _ = raw_export()
    opts = BenchOptions(batches=[2], only=["normexport"], budget_s=0.1, min_runs=3)
    r = bench_model(raw, example, opts)
    assert r.floor is None and r.floor_error == "RuntimeError: floor exploded"
    assert r.to_dict()["floor"] == {"error": "RuntimeError: floor exploded"}
    assert set(r.points[0].timings) == {"normexport"}


def test_chart_leaves_pyplot_and_the_backend_alone(small_result, tmp_path, monkeypatch):
    import matplotlib
    import matplotlib.pyplot as plt

    def switched(*args, **kwargs):
        pytest.fail("the chart switched matplotlib's backend")

    monkeypatch.setattr(matplotlib, "use", switched)
    monkeypatch.setattr(plt, "switch_backend", switched)
    before = plt.get_fignums()
    write_chart(small_result, tmp_path / "c.png")
    assert plt.get_fignums() == before  # no pyplot figure made (or left open)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_baseline_runs_beside_and_is_no_optimizer():
    raw, example, _ = raw_export()
    opts = BenchOptions(
        batches=[2], only=["ort_raw", "normexport"], with_cpu=True, floor=False, budget_s=0.1,
        min_runs=3,
    )  # fmt: skip
    r = bench_model(raw, example, opts).to_dict()
    assert r["variants"]["normexport@cpu"]["provider"] == "cpu"
    assert r["variants"]["normexport"]["provider"] is None
    point = r["points"][0]
    assert set(point["latency_ms"]) == {"ort_raw", "normexport", "ort_raw@cpu", "normexport@cpu"}
    assert point["max_abs_diff"]["normexport@cpu"] < 1e-5  # the same model, on CPU
    assert point["normexport_vs_best"]["best_other"] == "ort_raw"  # a baseline, not an optimizer


# --- a sweep over an axis the model fixes ------------------------------------------------------


def _identity(shape) -> ir.Model:
    """``h`` of ``shape`` (numbers or axis names) through one Identity."""
    h = (TensorProto.FLOAT, shape)
    return make_model([("Identity", ["h"], ["y"], {})], {"h": h}, {"y": h})


def test_fixed_axes_are_the_swept_ones_an_input_has_as_another_number():
    raw = _identity((2, 4, HIDDEN))
    assert fixed_axes(raw, ["h"], [2], [4]) == []  # the sizes it has: nothing to say
    assert fixed_axes(raw, ["h"], [None], [None]) == []
    assert fixed_axes(raw, ["other"], [1, 3], [None]) == []  # not fed by the sweep
    both = fixed_axes(raw, ["h"], [1, 2], [4, 8])
    assert [(f.word, f.flag, f.axis, f.input, f.size) for f in both] == [
        ("batch", "--batch", 0, "h", 2), ("sequence", "--seq", 1, "h", 4)
    ]  # fmt: skip
    assert fixed_axes(_identity(("batch", "sequence", HIDDEN)), ["h"], [1, 3], [8, 16]) == []
    asked = {"--batch": "1,2", "--seq": "4,8"}
    line = fixed_line(both, "m.onnx", "onnx", None, asked)
    assert line.startswith("m.onnx fixes batch to 2 (input 'h', axis 0) and sequence to 4")
    assert "not --batch 1,2 --seq 4,8" in line and "those axes symbolic" in line
    batch = both[:1]
    assert "dynamic_shapes" in fixed_line(batch, "m.pt2", "exported_program", "batch", asked)
    pickled = fixed_line(batch, "m.pt", "pickled_module", "sequence", asked)
    assert pickled.endswith("export it with --dynamic batch,sequence")
    assert "code specializes" in fixed_line(batch, "m.pt", "pickled_module", "batch", asked)


def _bench_fixed(path, extra: list[str], capsys, tmp_path) -> tuple[str, dict]:
    """``normexport bench`` on a model whose axes are fixed: its stdout and its JSON."""
    out_json = tmp_path / "fixed.json"
    code = cli.main(
        ["bench", str(path), "--provider", "cpu", "--budget", "0.1", "--min-runs", "3"]
        + ["--variants", "ort_raw,normexport", "--no-floor", "--json", str(out_json), *extra]
    )
    out = capsys.readouterr().out
    assert code == EXIT_OK
    return out, json.loads(out_json.read_text())


def _assert_own_size_only(out: str, result: dict, line: str) -> None:
    """One line, before any timing, then the model's own size timed, never an empty table."""
    lines = out.splitlines()
    said = [i for i, text in enumerate(lines) if "fixes" in text]
    assert len(said) == 1 and lines[said[0]].startswith(line), out
    assert said[0] < next(i for i, text in enumerate(lines) if "ms per call" in text)
    assert "invalid dimensions" not in out and result["sweep_note"] == lines[said[0]]
    (point,) = result["points"]
    assert point["inputs"] == {"h": [2, 4, HIDDEN]} and point["errors"] == {}
    assert {"ort_raw", "normexport"} <= set(point["latency_ms"])


def test_bench_on_a_torch_export_program_times_its_own_batch_and_says_so(tmp_path, capsys):
    """A ``torch.export.save`` archive is specialized to its example's batch: no export makes
    it dynamic, so bench times batch 2 and says which flag would not help and what would."""
    path = tmp_path / "stack.pt2"
    x = torch.from_numpy(raw_export()[1]["h"])
    torch.export.save(torch.export.export(ResidualLayerNorm().eval(), (x,)), path)
    out, result = _bench_fixed(path, ["--batch", "1,3"], capsys, tmp_path)
    _assert_own_size_only(out, result, f"{path} fixes batch to 2 (input 'h', axis 0)")
    assert "dynamic_shapes" in result["sweep_note"]
    assert "pytorch_eager" in result["points"][0]["latency_ms"]  # eager runs at its own size


def test_bench_on_an_onnx_file_with_fixed_axes_times_its_own_size_and_says_so(tmp_path, capsys):
    path = tmp_path / "fixed.onnx"
    ir.save(raw_export(dynamic=False)[0], path)
    out, result = _bench_fixed(path, ["--batch", "1,3", "--seq", "4,8"], capsys, tmp_path)
    _assert_own_size_only(out, result, f"{path} fixes batch to 2 (input 'h', axis 0) and seq")


def test_a_point_where_nothing_ran_is_no_empty_table():
    raw, example, _ = raw_export(dynamic=False)  # batch fixed at 2
    opts = BenchOptions(batches=[3], only=["ort_raw"], floor=False, budget_s=0.1, min_runs=3)
    console = Console(record=True, width=200)
    render(bench_model(raw, example, opts), console)
    out = console.export_text()
    assert "h [3, 4, 16]: nothing ran" in out and "┏" not in out
    assert "ort_raw: InvalidArgument" in out
