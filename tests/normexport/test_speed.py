"""The latency verdict: the published model is never slower than the raw one beyond the spread
of an A/A control timed in the same run; the rewrites that make it slower are found and undone.

The rule is tested on made-up timings. The pipeline runs on a small ONNX file built node by
node (a hand-written LayerNorm, a MatMul, a BatchNormalization, random weights and statistics)
with real ONNX Runtime sessions, real builds and real timings; the rewrite made slower on
purpose (:func:`models.broken.slowed`: the fused LayerNormalization's input carried through a
Loop of 2000 Identity steps, exact) costs about a millisecond a run on a graph that otherwise
takes a tenth of one, a slowdown of some tenfold that no busy machine hides. Nothing asserts a
speed of the machine's: only that such a slowdown is found, and what the run did about it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

import normexport
from fusion import Code
from models.broken import slowed
from normexport import cli
from normexport.latency.measure import Timing
from normexport.latency.verdict import (
    MAX_MARGIN,
    MIN_RUNS,
    NOT_TIMED,
    Comparison,
    another,
    compare,
    rejection,
    undecided,
)
from normexport.pipeline import timing
from tests.support.graphs import make_model

#: Rows, features, channels: a graph of about a tenth of a millisecond, whose sessions differ by
#: about a percent (two sessions of a 12-microsecond graph differed by up to 20%).
ROWS, D, C = 64, 256, 256


def _layernorm_matmul_bn(path: Path, rng: np.random.Generator) -> Path:
    """x (ROWS, D) -> a hand-written LayerNorm -> MatMul (D, C) -> BatchNormalization: one
    rewrite of FuseLayerNorm, one of FoldBatchNorm."""
    weights = {
        "axes": np.array([-1], np.int64),
        "two": np.array(2.0, np.float32),
        "eps": np.array(1e-5, np.float32),
        "gamma": rng.uniform(0.5, 1.5, D).astype(np.float32),
        "beta": rng.standard_normal(D).astype(np.float32),
        "w": rng.standard_normal((D, C)).astype(np.float32),
        "scale": rng.uniform(0.5, 1.5, C).astype(np.float32),
        "bias": rng.standard_normal(C).astype(np.float32),
        "mean": rng.standard_normal(C).astype(np.float32),
        "var": rng.uniform(0.5, 2.0, C).astype(np.float32),
    }
    nodes = [
        ("ReduceMean", ["x", "axes"], ["mu"], {}),
        ("Sub", ["x", "mu"], ["xc"], {}),
        ("Pow", ["xc", "two"], ["sq"], {}),
        ("ReduceMean", ["sq", "axes"], ["var_x"], {}),
        ("Add", ["var_x", "eps"], ["ve"], {}),
        ("Sqrt", ["ve"], ["sd"], {}),
        ("Div", ["xc", "sd"], ["normed"], {}),
        ("Mul", ["normed", "gamma"], ["scaled"], {}),
        ("Add", ["scaled", "beta"], ["ln"], {}),
        ("MatMul", ["ln", "w"], ["h"], {}),
        ("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["y"], {}),
    ]
    float32 = TensorProto.FLOAT
    model = make_model(nodes, {"x": (float32, [ROWS, D])}, {"y": (float32, [ROWS, C])}, weights)
    path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, path)
    return path


def _timings(*per_round: np.ndarray) -> list[Timing]:
    return [Timing.from_samples(s) for s in per_round]


def test_slower_only_beyond_the_controls_spread():
    """Slower: the ratio's whole interval above 1 + the A/A control's deviation from 1."""
    rng = np.random.default_rng(0)
    base = 1.0 + 0.2 * rng.random(200)  # the machine's drift, shared by every call of a round
    raw = _timings(base, base * (1 + 0.01 * rng.standard_normal(200)))
    _, _, same = compare(raw, _timings(base * 1.001, base * 0.999))
    assert not same.slower and rejection(same) is None
    _, model_time, twice = compare(raw, _timings(2 * base, 2 * base))
    assert twice.slower and twice.ratio.ci_low == pytest.approx(2, rel=0.05)
    assert model_time.median_ms == pytest.approx(2 * np.median(base), rel=1e-9)
    why = rejection(twice)
    assert why.code == Code.SLOWER_HERE and "95% interval" in why.message
    # the raw model's own two sessions differ by 10%: a model 5% slower is within that
    uneven = _timings(base, 1.1 * base)  # their mean: 1.05 * base
    _, _, within = compare(uneven, _timings(1.05 * 1.05 * base, 1.05 * 1.05 * base))
    assert within.ratio.median == pytest.approx(1.05)
    assert within.margin == pytest.approx(0.1, abs=1e-6) and not within.slower
    with pytest.raises(ValueError, match="two sessions"):
        compare(raw[:1], raw)


def _comparison(ratio: float, runs: int, noise: float, seed: int = 0) -> Comparison:
    """A made-up timing: the model ``ratio`` times the raw model's time over ``runs`` rounds,
    every call off by up to ``noise`` (relative, uniform), so the A/A controls' margin grows
    with it."""
    rng = np.random.default_rng(seed)
    base = 1.0 + 0.2 * rng.random(runs)

    def calls(scale: float) -> Timing:
        return Timing.from_samples(scale * base * (1 + noise * rng.uniform(-1, 1, runs)))

    return compare([calls(1.0), calls(1.0)], [calls(ratio), calls(ratio)])[2]


def test_slower_only_on_agreeing_timings_of_enough_rounds_on_a_machine_that_can_tell():
    """The brief's loaded run: one timing of 13 rounds calling the model 1.07x slower, its
    controls tight. It undoes nothing alone: another timing of MIN_RUNS rounds is asked for,
    then a third (the first has too few rounds to count); one that disagrees or is too busy
    leaves the speed unchecked (the model kept as the stages made it)."""
    burst = _comparison(1.07, 13, 0.005)
    assert burst.slower and burst.margin < 0.05 and burst.ratio.runs < MIN_RUNS
    assert another([burst]) and undecided([burst]) is None
    slower = _comparison(1.5, MIN_RUNS, 0.01, seed=1)
    assert slower.slower and another([burst, slower])  # the 13 rounds do not count
    assert not another([burst, slower, slower]) and undecided([burst, slower, slower]) is None
    quiet = _comparison(1.0, MIN_RUNS, 0.01, seed=2)
    assert not quiet.slower and not another([burst, quiet]) and not another([quiet])
    assert undecided([quiet]) is None  # not slower: kept as optimized, checked
    why = undecided([burst, quiet])
    assert why.startswith("the timings disagree") and "slower: 1.07x" in why
    assert "not slower: 0.999x" in why and "13 rounds" in why
    busy = _comparison(1.3, MIN_RUNS, 0.9, seed=3)  # sessions of one model 2x apart
    assert busy.margin > MAX_MARGIN and not busy.slower
    assert busy.busy is not None and quiet.busy is None
    assert not another([burst, busy]) and not another([busy])
    assert undecided([busy]).startswith("the machine was too busy to tell (A/A controls")
    assert undecided([burst, busy]) == undecided([busy])
    clear = _comparison(8.0, MIN_RUNS, 0.9, seed=4)  # slower beyond even that margin
    assert clear.margin > MAX_MARGIN and clear.slower and clear.busy is None
    assert another([clear]) and not another([clear, clear]) and undecided([clear, clear]) is None
    with pytest.raises(ValueError, match="at least one"):
        undecided([])


def test_a_load_burst_in_the_first_timings_undoes_nothing(tmp_path, out_dir, rng, capsys):
    """The timings the pipeline takes, with the first two of the model as optimized replaced by
    the brief's loaded one (1.07x over 13 rounds, A/A controls within ±0.03; the rest real): the
    third, in fresh sessions, disagrees, so the very file a run without timing writes is
    published, the speed unchecked. (Trusting the two, the search undid every rewrite: every
    model it built was timed, really, not slower.)"""
    model = _layernorm_matmul_bn(tmp_path / "in" / "m.onnx", rng)
    # one intra-op thread, as test_a_rewrite_made_slower_is_undone says why
    plain = normexport.optimize(model, output=out_dir / "a.onnx", benchmark=False, threads=1)
    real, bursts = timing.timed_against_raw, []

    def loaded(job, ref, path, *args, **kwargs):
        latency, comparison = real(job, ref, path, *args, **kwargs)
        if path.name == "b.onnx" and len(bursts) < 2:
            bursts.append(_comparison(1.07, 13, 0.005))
            return latency, bursts[-1]
        return latency, comparison

    args = [str(model), "-o", str(out_dir / "b.onnx"), "--provider", "cpu", "--budget", "0.5"]
    args += ["--threads", "1"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timing, "timed_against_raw", loaded)
        assert cli.main([*args, "--report", str(tmp_path / "r.json")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    speed = json.loads((tmp_path / "r.json").read_text())["speed"]
    assert (out_dir / "b.onnx").read_bytes() == plain.output.read_bytes(), speed
    # the third disagrees, or (a real timing on a loaded machine calling it slower too) a later
    # one: CI's other pytest worker once made the third 1.07x as well, the fourth 0.85x
    timings = [speed["as_optimized"], *speed["again"]]
    assert len(bursts) == 2 and speed["models_timed"] == len(timings) >= 3, speed
    assert not speed["checked"] and speed["undone"] == [] and speed["published"] is None
    assert all(t["slower"] for t in timings[:-1]) and not timings[-1]["slower"], speed
    assert timings[-1]["ratio"]["runs"] >= MIN_RUNS
    assert speed["unchecked"].startswith("the timings disagree")
    assert "speed unchecked: the timings disagree" in text
    assert "published as the stages made it" in text


def _spin(stop) -> None:
    """A busy process: spins on a core until ``stop`` is set."""
    while not stop.is_set():
        pass


@contextlib.contextmanager
def _busy_machine(workers: int = 2):
    """``workers`` processes spinning beside the caller (2: every core of a 2-core machine)."""
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    spinning = [context.Process(target=_spin, args=(stop,), daemon=True) for _ in range(workers)]
    for process in spinning:
        process.start()
    try:
        yield
    finally:
        stop.set()
        for process in spinning:
            process.join(5)


def test_a_busy_machine_publishes_the_model_a_quiet_one_does(tmp_path, out_dir, rng):
    """Two processes spinning on the cores while the model is timed (a short budget: few
    rounds, the loaded case): the very file a run without timing writes, nothing undone,
    whether the verdict could tell (not slower) or not (unchecked, and why)."""
    model = _layernorm_matmul_bn(tmp_path / "in" / "m.onnx", rng)
    plain = normexport.optimize(model, output=out_dir / "a.onnx", benchmark=False)
    args = [str(model), "-o", str(out_dir / "b.onnx"), "--provider", "cpu", "--budget", "0.3"]
    with _busy_machine():
        assert cli.main([*args, "--report", str(tmp_path / "r.json")]) == 0
    speed = json.loads((tmp_path / "r.json").read_text())["speed"]
    assert (out_dir / "b.onnx").read_bytes() == plain.output.read_bytes(), speed
    assert speed["undone"] == [] and speed["head_to_head"] is None
    assert speed["checked"] or speed["unchecked"].startswith("the "), speed


def test_a_rewrite_made_slower_is_undone(tmp_path, out_dir, rng, capsys):
    """The fused LayerNormalization made some ten times slower (exactly): the verdict finds
    it, undoes it (``slower_here`` with the ratio and its interval) and publishes the model
    without it, not slower, parity judged anew. (The BatchNorm fold is kept but for a timing
    that calls it slower too, a measured call: that the search isolates the one responsible is
    tested exactly on the stand-in of tests/normexport/test_rollback.py.)"""
    model = _layernorm_matmul_bn(tmp_path / "in" / "m.onnx", rng)
    out, report_path = out_dir / "m.onnx", tmp_path / "r.json"
    args = [str(model), "-o", str(out), "--report", str(report_path), "--provider", "cpu"]
    # one intra-op thread: under `pytest -n 2` on 2 cores, another worker beside two threads
    # made the A/A controls ±0.32 wide and the search too busy to tell (CI, 2026-12-07)
    args += ["--threads", "1"]
    # a budget the search cannot run out of on a busy machine (it would undo both, safely, or
    # stop before the one responsible; its builds count, and under `pytest -n auto` on 2 cores
    # 20 s ran out once): the timings stop at 500 rounds, a few seconds here
    with slowed("layernorm_fused"):
        assert cli.main([*args, "--budget", "60"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    report = json.loads(report_path.read_text())
    speed = report["speed"]
    assert speed["checked"] and speed["as_optimized"]["slower"], speed
    undone = [(u["kind"], u["code"]) for u in speed["undone"]]
    assert ("layernorm_fused", "slower_here") in undone, speed
    assert {code for _, code in undone} == {"slower_here"}
    assert not speed["published"]["slower"] and speed["kept_slower"] is None
    refused = [r for r in report["fusions"]["refused"] if r["code"] == "slower_here"]
    assert len(refused) == len(undone) and "layernorm" in [r["family"] for r in refused]
    assert all("the raw model's time (95% interval" in r["detail"] for r in refused)
    assert report["fusions"]["layernorm_fused"] == 0
    ops = [node.op_type for node in ir.load(out).graph]
    assert "Loop" not in ops and "LayerNormalization" not in ops
    stages = [s["name"] for s in report["cost"]["stages"]]
    assert stages.index("latency") < stages.index("parity")  # the published model is judged
    assert report["parity"]["passed"] and "slower here" in text and "layernorm_fused at" in text


def test_a_model_nothing_made_slower_is_published_unchanged(tmp_path, out_dir, rng, capsys):
    """Timed and not slower: the very file a run without timing writes, nothing undone."""
    model = _layernorm_matmul_bn(tmp_path / "in" / "m.onnx", rng)
    # one intra-op thread, as test_a_rewrite_made_slower_is_undone says why
    plain = normexport.optimize(model, output=out_dir / "a.onnx", benchmark=False, threads=1)
    args = [str(model), "-o", str(out_dir / "b.onnx"), "--provider", "cpu", "--threads", "1"]
    assert cli.main([*args, "--report", str(tmp_path / "r.json"), "--budget", "0.5"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    report = json.loads((tmp_path / "r.json").read_text())
    assert (out_dir / "b.onnx").read_bytes() == plain.output.read_bytes()
    speed = report["speed"]
    assert speed["checked"] and not speed["as_optimized"]["slower"] and not speed["undone"]
    assert speed["models_timed"] == 1 and speed["published"] == speed["as_optimized"]
    assert "slower_here" not in [r["code"] for r in report["fusions"]["refused"]]
    assert report["fusions"]["layernorm_fused"] == report["fusions"]["batchnorm_folded"] == 1
    assert "not slower than the raw model, kept as optimized" in text


def test_no_benchmark_says_the_speed_is_unchecked(tmp_path, rng, capsys):
    model = _layernorm_matmul_bn(tmp_path / "in" / "m.onnx", rng)
    args = [str(model), "-o", str(tmp_path / "m.onnx"), "--report", str(tmp_path / "r.json")]
    assert cli.main([*args, "--provider", "cpu", "--no-benchmark"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    speed = json.loads((tmp_path / "r.json").read_text())["speed"]
    assert speed == {
        "checked": False,
        "unchecked": NOT_TIMED,
        "as_optimized": None,
        "again": [],
        "published": None,
        "undone": [],
        "head_to_head": None,
        "models_timed": 0,
        "kept_slower": None,
    }
    assert f"speed unchecked: {NOT_TIMED}" in text
