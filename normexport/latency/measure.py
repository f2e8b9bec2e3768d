"""Latency of several variants of one model, timed interleaved in one process:
:func:`time_interleaved` (rounds in a random order, each variant's :class:`Timing` with its
bootstrap interval, :func:`bootstrap_ci`), :func:`paired_ratio` (two variants compared round by
round, a :class:`Ratio`), :func:`counterbalanced` and :func:`rotating` (sessions opened in ABBA
order and timed in turn), :class:`BoundRun` and :func:`runner` (one run of a session, with or
without IO binding), :func:`latency_threads`. Why the rounds, the statistics and the sessions
are so: docs/benchmarks.md#how-a-timing-is-made.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import onnxruntime as ort

from normexport.runtime.sessions import CUDA

#: Bootstrap resamples for the confidence intervals.
BOOTSTRAP_RESAMPLES = 2000
#: Two-sided confidence level of the intervals.
CONFIDENCE = 0.95
#: A timed variant whose p90 is more than this many times its median ran on a busy machine.
BUSY_SPREAD = 1.5


@dataclasses.dataclass
class Timing:
    """Latency of one variant, in milliseconds per call.

    Attributes:
        median_ms, p90_ms, min_ms: over the timed runs.
        runs: number of timed runs.
        max_ms: slowest timed run.
        ci_low_ms, ci_high_ms: 95% bootstrap confidence interval of the median.
        bound: what decided the number of runs (:func:`time_interleaved`): ``"budget"``
            (the seconds given), ``"min_runs"`` (the budget held fewer rounds than the least
            asked for: the timing took longer than the budget) or ``"max_runs"``.
        samples_ms: every timed run, in round order (left out of :meth:`to_dict`).
    """

    median_ms: float
    p90_ms: float
    min_ms: float
    runs: int
    max_ms: float = float("nan")
    ci_low_ms: float = float("nan")
    ci_high_ms: float = float("nan")
    bound: str = "budget"
    samples_ms: tuple[float, ...] = dataclasses.field(default=(), repr=False, compare=False)

    @classmethod
    def from_samples(
        cls, samples_ms: Sequence[float], seed: int = 0, bound: str = "budget"
    ) -> Timing:
        """Summarize per-call times (ms, in round order); ``bound``: what decided their
        number."""
        s = np.asarray(samples_ms, dtype=float)
        low, high = bootstrap_ci(s, np.median, seed=seed)
        return cls(
            median_ms=float(np.median(s)),
            p90_ms=float(np.percentile(s, 90)),
            min_ms=float(s.min()),
            runs=len(s),
            max_ms=float(s.max()),
            ci_low_ms=low,
            ci_high_ms=high,
            bound=bound,
            samples_ms=tuple(float(x) for x in s),
        )

    def to_dict(self) -> dict:
        """JSON-ready form (ms), without the raw samples."""
        d = dataclasses.asdict(self)
        del d["samples_ms"]
        return d


@dataclasses.dataclass(frozen=True)
class Ratio:
    """How many times slower one variant is than another (> 1: slower), per-round paired.

    Attributes:
        median: median over rounds of ``time_a / time_b``.
        ci_low, ci_high: 95% bootstrap confidence interval of that median.
        runs: number of paired rounds.
    """

    median: float
    ci_low: float
    ci_high: float
    runs: int

    @property
    def significant(self) -> bool:
        """True when the interval excludes 1: the two differ by more than the spread."""
        return self.ci_low > 1.0 or self.ci_high < 1.0

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return dataclasses.asdict(self) | {"significant": self.significant}


def bootstrap_ci(
    samples: np.ndarray,
    statistic: Callable[..., np.ndarray] = np.median,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of ``statistic`` over 1-D ``samples``.

    ``statistic`` must accept ``axis=1`` (numpy reductions do). Deterministic for a given seed.
    """
    samples = np.asarray(samples, dtype=float)
    rng = np.random.default_rng(seed)
    draws = samples[rng.integers(0, len(samples), size=(resamples, len(samples)))]
    values = statistic(draws, axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def paired_ratio(a: Timing, b: Timing, seed: int = 0) -> Ratio:
    """``a`` relative to ``b`` from their per-round samples (both from one interleaved run).

    Raises:
        ValueError: the two timings do not hold the same number of samples (not one run).
    """
    if len(a.samples_ms) != len(b.samples_ms) or not a.samples_ms:
        raise ValueError("paired_ratio needs two timings from the same time_interleaved call")
    r = np.asarray(a.samples_ms) / np.asarray(b.samples_ms)
    low, high = bootstrap_ci(r, np.median, seed=seed)
    return Ratio(float(np.median(r)), low, high, len(r))


def time_interleaved(
    variants: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 5,
    min_runs: int = 20,
    max_runs: int = 500,
    budget_s: float = 10.0,
    seed: int = 0,
) -> dict[str, Timing]:
    """Time each zero-argument callable in ``variants``, interleaved.

    Args:
        variants: name -> callable that runs the model once (synchronized: it returns when the
            result is ready; for PyTorch on CUDA that means after ``torch.cuda.synchronize()``).
        warmup: untimed rounds first (lazy initialization, caches, allocator, CUDA graph
            capture).
        min_runs, max_runs: bounds on the number of timed rounds.
        budget_s: wall-clock seconds to aim for across all timed rounds.
        seed: of the rounds' orders (a random permutation each).

    Returns:
        name -> :class:`Timing` (its ``bound`` says which of the budget, ``min_runs`` and
        ``max_runs`` decided the rounds); sample ``i`` of every variant comes from round ``i``.
    """
    names = list(variants)
    start = time.perf_counter()
    for _ in range(warmup):
        for name in names:
            variants[name]()
    per_round = (time.perf_counter() - start) / max(warmup, 1)
    by_budget = budget_s / max(per_round, 1e-9)
    runs = int(min(max_runs, max(min_runs, by_budget)))
    bound = "max_runs" if by_budget > max_runs else "min_runs" if by_budget < min_runs else "budget"
    samples: dict[str, list[float]] = {name: [] for name in names}
    rng = np.random.default_rng(seed)
    for _ in range(runs):
        for index in rng.permutation(len(names)):
            name = names[index]
            t0 = time.perf_counter()
            variants[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: Timing.from_samples(s, bound=bound) for name, s in samples.items()}


_T = TypeVar("_T")


def counterbalanced(opens: Mapping[str, Callable[[], _T]], copies: int) -> dict[str, list[_T]]:
    """``copies`` objects of each variant, opened in counterbalanced (ABBA) order: the variants
    in order, then in reverse, and so on, so that with an even ``copies`` each variant's copies
    sit, on average, at the same place in the opening order.

    Args:
        opens: name -> zero-argument callable that opens one copy (a session).
        copies: how many of each, at least 1.

    Returns:
        name -> its copies, in the order they were opened.

    Raises:
        ValueError: ``copies`` is below 1.
    """
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    opened: dict[str, list[_T]] = {name: [] for name in opens}
    for copy in range(copies):
        for name in list(opens)[:: -1 if copy % 2 else 1]:
            opened[name].append(opens[name]())
    return opened


def rotating(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One zero-argument callable that calls each of ``calls`` in turn, one per call: a
    variant timed over its :func:`counterbalanced` copies."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def latency_threads() -> int:
    """The thread count PyTorch and ONNX Runtime both get when timed: the cores this process
    may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class BoundRun:
    """A session run through IO binding, with inputs and outputs resident on its device.

    Calling it runs the session once and returns when the outputs are ready (ORT synchronizes
    the CUDA stream at the end of ``run_with_iobinding``); nothing is copied between host and
    device. :meth:`outputs` copies the latest outputs to numpy arrays.
    """

    def __init__(self, session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]):
        device = "cuda" if session.get_providers()[0] == CUDA else "cpu"
        self._session = session
        self._binding = session.io_binding()
        # Keep the device copies alive: the binding holds their addresses.
        self._inputs = {
            name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), device, 0)
            for name, a in feeds.items()
        }
        for name, value in self._inputs.items():
            self._binding.bind_ortvalue_input(name, value)
        names = [o.name for o in session.get_outputs()]
        for name in names:
            self._binding.bind_output(name, device, 0)
        # The first run allocates the outputs on the device; binding those same buffers keeps
        # their addresses fixed from then on, which CUDA graph replay requires.
        session.run_with_iobinding(self._binding)
        self._outputs = self._binding.get_outputs()
        self._binding.clear_binding_outputs()
        for name, value in zip(names, self._outputs, strict=True):
            self._binding.bind_ortvalue_output(name, value)

    def __call__(self) -> None:
        self._session.run_with_iobinding(self._binding)

    def outputs(self) -> list[np.ndarray]:
        """The latest outputs, copied to host memory."""
        return [v.numpy() for v in self._outputs]


def runner(
    session: ort.InferenceSession, feeds: Mapping[str, np.ndarray], *, io_binding: bool
) -> tuple[Callable[[], object], Callable[[], list[np.ndarray]]]:
    """A zero-argument function that runs ``session`` once, and one that returns its outputs.

    With ``io_binding`` the run is :class:`BoundRun` (no host-device copies timed); without, it
    is :func:`run` on host arrays, what a plain ``session.run`` user pays.
    """
    if io_binding:
        bound = BoundRun(session, feeds)
        return bound, bound.outputs
    feeds = dict(feeds)
    return (lambda: session.run(None, feeds)), (lambda: session.run(None, feeds))
