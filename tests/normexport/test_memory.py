"""Memory: one ONNX Runtime session at a time, the latency stage's plan, what a run reports it
took, and the progress display (docs/memory.md).

The models are small ONNX files built with onnx-ir (with external data, as large models come);
the pipeline runs on them end to end on ONNX Runtime.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from rich.console import Console

import normexport
from normexport import cli, progress, runtime
from normexport.io import files
from normexport.latency import verdict
from normexport.runtime import memory, plan, sessions
from normexport.verdict import parity, tolerance
from tests.support.graphs import make_model

F = ir.DataType.FLOAT


def _rmsnorm_model(path: Path, rng, dtype=np.float32) -> Path:
    """x (2, 8, 64) -> MatMul -> a hand-written RMSNorm (computed in float32) -> MatMul, random
    weights, saved with external data."""
    d = 64
    weights = {
        "w1": rng.standard_normal((d, d)).astype(dtype) / 8,
        "scale": rng.uniform(0.5, 1.5, d).astype(np.float32),
        "w2": rng.standard_normal((d, d)).astype(dtype) / 8,
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-6, np.float32),
    }
    wide, narrow = ir.DataType.FLOAT, ir.DataType.from_numpy(np.dtype(dtype))
    nodes = [
        ("MatMul", ["x", "w1"], ["h"], {}),
        ("Cast", ["h"], ["h32"], {"to": wide}),
        ("Pow", ["h32", "two"], ["sq"], {}),
        ("ReduceMean", ["sq"], ["ms"], {"axes": [-1], "keepdims": 1}),
        ("Add", ["ms", "eps"], ["mse"], {}),
        ("Sqrt", ["mse"], ["rms"], {}),
        ("Div", ["h32", "rms"], ["n"], {}),
        ("Mul", ["n", "scale"], ["ns"], {}),
        ("Cast", ["ns"], ["nh"], {"to": narrow}),
        ("MatMul", ["nh", "w2"], ["y"], {}),
    ]
    model = make_model(nodes, {"x": (narrow, [2, 8, d])}, {"y": (narrow, [2, 8, d])}, weights)
    model.opset_imports[""] = 17
    path.parent.mkdir(exist_ok=True)
    files.save_model(model, path, external_data=True)
    return path


@pytest.fixture
def alive_at_open(monkeypatch):
    """Every session the run makes, and how many others were alive when each was made."""
    alive: weakref.WeakSet = weakref.WeakSet()
    others: list[int] = []
    make = runtime.make_session

    def counted(*args, **kwargs):
        gc.collect()
        others.append(len(alive))
        session = make(*args, **kwargs)
        alive.add(session)
        return session

    monkeypatch.setattr(runtime, "make_session", counted)
    monkeypatch.setattr(sessions, "make_session", counted)  # check_session's, OnDemand's
    return others


@pytest.fixture
def nothing_slower(monkeypatch):
    """The latency verdict finds nothing slower: the sessions are the first timing's only (a
    busy machine may time a model slower, and the search opens sessions of its own:
    tests/normexport/test_speed.py)."""
    monkeypatch.setattr(verdict, "rejection", lambda comparison: None)


def test_parity_holds_one_session_at_a_time(tmp_path, out_dir, rng, alive_at_open):
    """No session is opened while another is alive: the input as written, the float64 oracle,
    the load check and the candidate each run alone (the old run held the input's session
    through the whole run)."""
    model = _rmsnorm_model(tmp_path / "in" / "m.onnx", rng)
    report = normexport.optimize(model, output=out_dir / "m.onnx", benchmark=False)
    assert report.passed and report.fusions.counts["rmsnorm_fused"] == 1
    assert report.parity.oracle == "onnx_float64", report.parity.notes
    assert len(alive_at_open) >= 4 and max(alive_at_open) == 0, alive_at_open


def test_the_report_says_what_each_stage_took(tmp_path, out_dir, rng):
    model = _rmsnorm_model(tmp_path / "in" / "m.onnx", rng)
    report = normexport.optimize(model, output=out_dir / "m.onnx", benchmark=False)
    names = [s.name for s in report.cost.stages]
    assert names == ["load", "reference", "optimize", "parity"]
    assert all(s.wall_s >= 0 and s.peak_rss_bytes > 2**20 for s in report.cost.stages)
    weights = sum(v.const_value.nbytes for v in ir.load(model).graph.initializers.values())
    assert report.cost.weight_bytes == weights
    found = report.to_dict()["cost"]
    assert found["peak_rss_bytes"] == max(s.peak_rss_bytes for s in report.cost.stages)


def test_latency_apart_where_two_sessions_do_not_fit(
    tmp_path, out_dir, rng, monkeypatch, alive_at_open
):
    """With too little memory for both sessions (available memory faked small), the raw model
    and the output are timed one after the other, never both open, and the report says why."""
    model = _rmsnorm_model(tmp_path / "in" / "m.onnx", rng)
    answers = iter([2**40])  # the memory plan, before the run, sees room for everything
    monkeypatch.setattr(memory, "available_bytes", lambda: next(answers, 2**10))
    report = normexport.optimize(model, output=out_dir / "m.onnx", budget_s=0.2)
    assert set(report.latency.timings) == {"ort_raw", "ort_optimized"}
    assert "timed one at a time" in report.latency.apart
    assert report.to_dict()["latency_conditions"]["apart"] == report.latency.apart
    assert max(alive_at_open) == 0, alive_at_open


def test_latency_interleaved_where_they_fit(tmp_path, out_dir, rng, alive_at_open, nothing_slower):
    """Room for two sessions of each: raw, optimized, optimized, raw, all four open at once."""
    model = _rmsnorm_model(tmp_path / "in" / "m.onnx", rng)
    report = normexport.optimize(model, output=out_dir / "m.onnx", budget_s=0.2)
    assert report.latency.apart is None and report.latency.sessions == 2
    assert _opened_together(alive_at_open, 4), alive_at_open  # the four timed together
    assert report.to_dict()["latency_conditions"]["sessions_per_model"] == 2


def _opened_together(alive_at_open: list[int], n: int) -> bool:
    """Whether ``n`` sessions were open at once: one opened with none other alive, the next
    with one, ... (the latency stage's; the deployed check's session opens after it)."""
    return any(alive_at_open[i : i + n] == list(range(n)) for i in range(len(alive_at_open)))


def test_latency_one_session_each_where_two_of_each_do_not_fit(
    tmp_path, out_dir, rng, monkeypatch, alive_at_open, nothing_slower
):
    model = _rmsnorm_model(tmp_path / "in" / "m.onnx", rng)
    fit = memory.copies_that_fit
    monkeypatch.setattr(memory, "copies_that_fit", lambda paths, p, most: fit(paths, p, 1))
    report = normexport.optimize(model, output=out_dir / "m.onnx", budget_s=0.2)
    assert report.latency.apart is None and report.latency.sessions == 1
    assert _opened_together(alive_at_open, 2), alive_at_open  # the two timed together


def test_session_bytes_counts_half_weights_as_float32_on_cpu(tmp_path, rng):
    model = _rmsnorm_model(tmp_path / "m.onnx", rng, dtype=np.float16)
    half, rest = 2 * 64 * 64 * 2, 64 * 4 + 4 + 4
    assert memory.session_bytes(model, "cpu") == 2 * half + rest
    assert memory.session_bytes(model, "cuda") == half + rest


def test_a_float16_model_is_judged_by_the_float16_rule(tmp_path, out_dir, rng):
    """Its float64 oracle keeps its float16 arithmetic: the float16 rule (relative L2) judges
    it, and the report says so."""
    model = _rmsnorm_model(tmp_path / "in" / "m.onnx", rng, dtype=np.float16)
    report = normexport.optimize(model, output=out_dir / "m.onnx", benchmark=False)
    assert report.passed and report.fusions.counts["rmsnorm_fused"] == 1
    assert report.parity.max_rel_l2 == tolerance.FP16_MAX_REL_L2
    assert any("judged by the fp16 rule" in n for n in report.parity.notes)


def test_stages_are_shown_on_a_terminal_only(capsys):
    """On a terminal the stage is drawn (and cleared at the end); elsewhere nothing."""
    for terminal in (True, False):
        console = Console(stderr=True, force_terminal=terminal, width=80)
        with progress.shown(console), progress.recording() as stages, progress.stage("reference"):
            progress.step("input set example")
        assert [s.name for s in stages] == ["reference"]
        err = capsys.readouterr().err
        assert ("reference" in err) is terminal, err


def test_nothing_is_recorded_outside_a_run():
    with progress.stage("load"):
        progress.step("nothing listens")
    with progress.recording() as stages:
        pass
    assert stages == []


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_check_session_maps_the_weights(tmp_path, rng, dtype):
    """The verdict's sessions read their weights from the external data file in place
    (prepacking off): the same outputs as a prepacked session, to float rounding."""
    model = _rmsnorm_model(tmp_path / "m.onnx", rng, dtype=dtype)
    x = {"x": rng.standard_normal((2, 8, 64)).astype(dtype)}
    lean = runtime.run(runtime.check_session(model), x)[0]
    packed = runtime.run(runtime.make_session(model, optimization_level=runtime.AS_WRITTEN), x)
    np.testing.assert_allclose(lean, packed[0], rtol=1e-2 if dtype == np.float16 else 1e-5)


def test_a_recorded_model_runs_and_says_so_once(monkeypatch):
    """Recording runs the model only on feeds it has not seen, and names the step only when
    it runs; the session is freed after each recording."""
    said, calls, closed = [], [], []
    monkeypatch.setattr(progress, "step", said.append)
    recorded = parity.Recorded(lambda f: calls.append(f) or [np.zeros(1)], lambda: closed.append(1))
    first, second = {"x": np.ones(1)}, {"x": np.zeros(1)}
    recorded.record([first], "the oracle")
    recorded.record([first, second], "the oracle again")
    recorded.record([first, second], "nothing to run")
    assert calls == [first, second] and len(closed) == 3
    assert said == ["the oracle", "the oracle again"]


def _constant_of_shape(path: Path, elements: int) -> Path:
    """A valid model whose ConstantOfShape makes ``elements`` float32 zeros from a constant
    shape, then adds ``x`` (shape (1,)): no weights to speak of."""
    nodes = [
        ("ConstantOfShape", ["shape"], ["zeros"], {}),
        ("Add", ["zeros", "x"], ["y"], {}),
    ]
    consts = {"shape": np.array([elements], np.int64)}
    model = make_model(nodes, {"x": (F, [1])}, {"y": (F, [elements])}, consts)
    model.opset_imports[""] = 17
    path.parent.mkdir(parents=True, exist_ok=True)
    files.save_model(model, path, external_data=False)
    return path


def test_the_plan_counts_the_tensors_made_from_constant_shapes(
    tmp_path, out_dir, capsys, monkeypatch
):
    """An 8 GiB ConstantOfShape of a constant shape passed the plan (it counted weights only)
    and grew past 6 GiB before anything said so: the plan names it, exit 2, before any work."""
    big = _constant_of_shape(tmp_path / "in" / "big.onnx", 2**31)
    made, maker = plan.made_tensor(ir.load(big))
    assert made == 2**33 and maker.startswith("ConstantOfShape"), maker
    monkeypatch.setattr(memory, "available_bytes", lambda: 16 * 2**30)  # any machine's answer
    code = cli.main([str(big), "-o", str(out_dir / "m.onnx"), "--no-benchmark"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "ConstantOfShape" in line and "8.00 GiB" in line, line
    small = _constant_of_shape(tmp_path / "in" / "small.onnx", 16)
    assert plan.made_tensor(ir.load(small))[0] == 64


def _conv_model(path: Path, rng, side: int = 128) -> Path:
    """x (1, 8, side, side) -> Conv 3x3 (pads 1) -> Relu -> Conv 3x3 -> a LayerNorm over the
    last axis, hand-written: values of 2 * 8 * side**2 bytes, weights of under 5 KiB."""
    weights = {
        "w1": rng.standard_normal((8, 8, 3, 3)).astype(np.float32) / 8,
        "w2": rng.standard_normal((8, 8, 3, 3)).astype(np.float32) / 8,
        "eps": np.array(1e-5, np.float32),
    }
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [
        ("Conv", ["x", "w1"], ["c1"], conv),
        ("Relu", ["c1"], ["r"], {}),
        ("Conv", ["r", "w2"], ["c2"], conv),
        ("ReduceMean", ["c2"], ["m"], {"axes": [-1], "keepdims": 1}),
        ("Sub", ["c2", "m"], ["d"], {}),
        ("Mul", ["d", "d"], ["sq"], {}),
        ("ReduceMean", ["sq"], ["v"], {"axes": [-1], "keepdims": 1}),
        ("Add", ["v", "eps"], ["ve"], {}),
        ("Sqrt", ["ve"], ["s"], {}),
        ("Div", ["d", "s"], ["y"], {}),
    ]
    shape = [1, 8, side, side]
    model = make_model(nodes, {"x": (F, shape)}, {"y": (F, shape)}, weights, opset=17)
    path.parent.mkdir(exist_ok=True)
    files.save_model(model, path, external_data=False)
    return path


def _conv_plan(path: Path, side: int = 128, sets: int = 8) -> plan.MemoryPlan:
    feeds = {"x": np.zeros((1, 8, side, side), np.float32)}
    return plan.plan(
        ir.load(path), "m", "cpu", latency=False, autotune=False, feeds=feeds, sets=sets
    )


def test_the_plan_counts_the_values_a_run_holds(tmp_path, rng):
    """The activations on the example's shapes: at the second Conv its input, its output and
    its unfolded input (8 * 9 * side**2 float32) are alive at once; the float64 oracle holds
    every float32 value twice over; each input set keeps six copies of the output."""
    side = 128
    found = _conv_plan(_conv_model(tmp_path / "m.onnx", rng, side), side)
    value = 8 * side * side * 4
    assert found.activation_bytes >= 2 * value + 9 * value
    assert found.activation_bytes <= 4 * value + 9 * value
    assert found.oracle_activation_bytes == 2 * found.activation_bytes
    assert found.kept_bytes == plan.KEPT_COPIES * value
    assert found.parity_bytes >= found.oracle_activation_bytes + 8 * found.kept_bytes
    assert plan.plan(ir.load(tmp_path / "m.onnx"), "m", "cpu", latency=False, autotune=False)


def test_a_float64_run_that_does_not_fit_gives_a_float32_oracle(
    tmp_path, out_dir, rng, monkeypatch
):
    """Room for the model's float32 run and not for its float64 oracle's: the oracle is the
    file as written, the plan and the notes say so, and the run still reaches a verdict."""
    path = _conv_model(tmp_path / "in" / "m.onnx", rng)
    need = _conv_plan(path)
    share = (need.activation_bytes + need.oracle_activation_bytes) / 2 + need.working_bytes
    monkeypatch.setattr(memory, "available_bytes", lambda: int(share / memory.SESSIONS_SHARE))
    report = normexport.optimize(path, output=out_dir / "m.onnx", benchmark=False)
    assert not report.memory.float64_oracle and "float64 oracle's run" in report.memory.line
    assert report.parity.oracle == "onnx", report.parity.notes
    assert any("do not fit" in note for note in report.parity.notes)
    assert report.passed and report.fusions.counts["layernorm_fused"] == 1


def test_outputs_that_do_not_fit_run_fewer_input_sets(tmp_path, out_dir, rng, monkeypatch):
    """The references' kept outputs of every input set do not fit: parity runs fewer sets,
    the example first, and the plan says how many."""
    path = _conv_model(tmp_path / "in" / "m.onnx", rng)
    need = _conv_plan(path)
    rest = (plan.MIN_SETS + 1) * need.kept_bytes / plan.KEPT_SHARE
    share = rest + need.oracle_activation_bytes + need.working_bytes
    monkeypatch.setattr(memory, "available_bytes", lambda: int(share / memory.SESSIONS_SHARE))
    report = normexport.optimize(path, output=out_dir / "m.onnx", benchmark=False)
    assert report.memory.input_sets == plan.MIN_SETS + 1, report.memory.line
    assert f"parity runs {plan.MIN_SETS + 1} of the 8 input sets" in report.memory.line
    assert list(report.parity.probes) == ["example", "random_0", "constant"]
    assert report.parity.oracle == "onnx_float64" and report.passed


def test_values_that_do_not_fit_are_exit_2_before_any_work(
    tmp_path, out_dir, rng, monkeypatch, capsys
):
    """A float32 run's values alone do not fit: exit 2, naming the file and the shapes to
    change, before any session opens."""
    path = _conv_model(tmp_path / "in" / "m.onnx", rng)
    need = _conv_plan(path)
    share = need.activation_bytes / 2 + need.working_bytes
    monkeypatch.setattr(memory, "available_bytes", lambda: int(share / memory.SESSIONS_SHARE))
    code = cli.main([str(path), "-o", str(out_dir / "m.onnx"), "--no-benchmark"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "on these input shapes" in line and "--input-shape" in line, line
    assert str(path) in line and not out_dir.joinpath("m.onnx").exists()


def test_counting_the_values_computes_none_of_them(tmp_path):
    """The activations are counted from shapes alone: a 1 GiB ConstantOfShape of a constant
    shape is counted at its size (with the values computed from the weights alone: ONNX
    Runtime runs it before anything that reads the inputs), in a process whose address space
    could not hold it a few times over (ONNX's data propagation, which computes such values,
    took 14 GB at 1e8)."""
    big = _constant_of_shape(tmp_path / "big.onnx", 2**28)
    script = (
        "import resource, sys, numpy as np, onnx_ir as ir\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))\n"
        "from normexport.runtime.activations import estimate\n"
        "found = estimate(ir.load(sys.argv[1]), {'x': np.zeros(1, np.float32)})\n"
        "print(found.peak_bytes, found.weight_values_bytes)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(big)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run, zeros = map(int, done.stdout.split())
    assert zeros == 2**30 and run >= 2**30  # the zeros and their sum with x, alive at once


def test_imports_spared_collects_first_then_skips_what_was_alive_until_it_closes():
    """Garbage made before the block is collected as it opens; what was alive then is in the
    permanent generation inside it (a full collection skips it) and back out after it."""

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    alive = [Node() for _ in range(100)]
    with memory.imports_spared():
        assert gone() is None
        assert gc.get_freeze_count() >= len(alive)
    assert gc.get_freeze_count() == 0
