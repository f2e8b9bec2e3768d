"""Timing statistics: summaries, bootstrap intervals, paired ratios, interleaving. No timed
assertions: fake samples and call-order checks only."""

from __future__ import annotations

import time

import numpy as np
import pytest

from normexport.latency.measure import (
    Timing,
    bootstrap_ci,
    counterbalanced,
    paired_ratio,
    rotating,
    time_interleaved,
)


def test_from_samples_summarizes_in_ms():
    samples = [5.0, 1.0, 3.0, 2.0, 4.0]
    t = Timing.from_samples(samples)
    assert (t.median_ms, t.min_ms, t.max_ms, t.runs) == (3.0, 1.0, 5.0, 5)
    assert t.p90_ms == pytest.approx(np.percentile(samples, 90))
    assert t.ci_low_ms <= t.median_ms <= t.ci_high_ms
    assert t.samples_ms == tuple(samples)  # round order kept


def test_to_dict_has_spread_and_no_samples():
    d = Timing.from_samples([1.0, 2.0, 3.0]).to_dict()
    keys = {"median_ms", "p90_ms", "min_ms", "runs", "max_ms", "ci_low_ms", "ci_high_ms", "bound"}
    assert set(d) == keys


def test_timing_positional_form_still_works():
    # The pipeline's report builds Timing(median, p90, min, runs).
    assert Timing(1.0, 2.0, 0.5, 10).to_dict()["runs"] == 10


def test_bootstrap_ci_is_deterministic_and_brackets_the_median():
    rng = np.random.default_rng(1)
    s = rng.lognormal(size=200)
    assert bootstrap_ci(s, seed=3) == bootstrap_ci(s, seed=3)
    low, high = bootstrap_ci(s)
    assert low <= np.median(s) <= high
    assert bootstrap_ci(np.full(50, 2.0)) == (2.0, 2.0)


def test_paired_ratio_is_the_median_of_per_round_ratios():
    a = Timing.from_samples([2.0, 4.0, 6.0, 100.0])
    b = Timing.from_samples([1.0, 2.0, 3.0, 50.0])  # the machine slowed down in round 4
    r = paired_ratio(a, b)
    assert (r.median, r.ci_low, r.ci_high, r.runs) == (2.0, 2.0, 2.0, 4)
    assert r.significant
    assert r.to_dict()["significant"] is True
    same = paired_ratio(b, b)
    assert same.median == 1.0 and not same.significant


def test_paired_ratio_refuses_timings_from_different_runs():
    with pytest.raises(ValueError, match="same time_interleaved"):
        paired_ratio(Timing.from_samples([1.0, 2.0]), Timing.from_samples([1.0]))
    with pytest.raises(ValueError):
        paired_ratio(Timing(1.0, 1.0, 1.0, 1), Timing(1.0, 1.0, 1.0, 1))


def _orders(seed: int, rounds: int = 40) -> list[list[str]]:
    """The rounds' orders of time_interleaved over four variants, after one warm-up round."""
    calls = []
    variants = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    result = time_interleaved(
        variants, warmup=1, min_runs=rounds, max_runs=rounds, budget_s=0.0, seed=seed
    )
    assert all(t.runs == rounds and len(t.samples_ms) == rounds for t in result.values())
    assert calls[:4] == list("abcd")  # the warm-up round
    return [calls[i : i + 4] for i in range(4, len(calls), 4)]


def test_time_interleaved_pairs_rounds_in_random_orders():
    orders = _orders(seed=0)
    assert all(sorted(order) == list("abcd") for order in orders)  # each variant once a round
    assert orders == _orders(seed=0)  # seeded
    assert orders != _orders(seed=1)
    # No variant always runs after the same other one (a rotation would keep its predecessor).
    before = {name: {o[o.index(name) - 1] for o in orders if o[0] != name} for name in "abcd"}
    assert all(len(previous) == 3 for previous in before.values())


def test_counterbalanced_opens_in_abba_order():
    opened = []

    def opener(name):
        def open_one():
            opened.append(name)
            return f"{name}{opened.count(name)}"

        return open_one

    copies = counterbalanced({n: opener(n) for n in "abc"}, 3)
    assert opened == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert copies == {"a": ["a1", "a2", "a3"], "b": ["b1", "b2", "b3"], "c": ["c1", "c2", "c3"]}
    assert counterbalanced({"a": lambda: 0}, 1) == {"a": [0]}
    with pytest.raises(ValueError, match="at least 1"):
        counterbalanced({"a": lambda: 0}, 0)


def test_rotating_calls_each_copy_in_turn():
    calls = []
    call = rotating([lambda: calls.append(0), lambda: calls.append(1), lambda: calls.append(2)])
    for _ in range(7):
        call()
    assert calls == [0, 1, 2, 0, 1, 2, 0]


#: (budget_s, max_runs, the bound that decides, the rounds): two calls of 2 ms a round.
BOUNDS = [(0.0, 50, "min_runs", 3), (1e9, 7, "max_runs", 7), (0.08, 50, "budget", None)]


@pytest.mark.parametrize(("budget_s", "max_runs", "bound", "runs"), BOUNDS)
def test_each_timing_says_which_bound_decided_its_runs(budget_s, max_runs, bound, runs):
    """The budget decides the rounds between ``min_runs`` and ``max_runs``; where one of those
    does, the timing says so (``--budget 5`` with 20 rounds at least timed past it, unsaid)."""

    def call():
        time.sleep(0.002)

    variants = {"a": call, "b": call}
    result = time_interleaved(variants, warmup=1, min_runs=3, max_runs=max_runs, budget_s=budget_s)
    assert {t.bound for t in result.values()} == {bound}
    assert runs is None or all(t.runs == runs for t in result.values())
    assert result["a"].to_dict()["bound"] == bound
