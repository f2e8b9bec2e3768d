"""Latency of several variants of one model, timed interleaved in one process.

Each round runs every variant once, in a rotated order, so that drift of a shared, noisy machine
(frequency, other tenants) lands on all variants alike. After a warm-up, rounds continue until
``budget_s`` is spent (at least ``min_runs``, at most ``max_runs``). Medians and p90 are quoted;
compare variants by their ratio, never by absolute numbers from different runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import numpy as np


@dataclasses.dataclass
class Timing:
    """Latency of one variant, in milliseconds per call."""

    median_ms: float
    p90_ms: float
    min_ms: float
    runs: int

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return dataclasses.asdict(self)


def time_interleaved(
    variants: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 5,
    min_runs: int = 20,
    max_runs: int = 500,
    budget_s: float = 10.0,
) -> dict[str, Timing]:
    """Time each zero-argument callable in ``variants``, interleaved.

    Args:
        variants: name -> callable that runs the model once (synchronized: it returns when the
            result is ready).
        warmup: untimed rounds first (lazy initialization, caches, allocator).
        min_runs, max_runs: bounds on the number of timed rounds.
        budget_s: wall-clock seconds to aim for across all timed rounds.

    Returns:
        name -> :class:`Timing`.
    """
    names = list(variants)
    start = time.perf_counter()
    for _ in range(warmup):
        for name in names:
            variants[name]()
    per_round = (time.perf_counter() - start) / max(warmup, 1)
    runs = int(min(max_runs, max(min_runs, budget_s / max(per_round, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(runs):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {
        name: Timing(float(np.median(s)), float(np.percentile(s, 90)), float(np.min(s)), len(s))
        for name, s in samples.items()
    }
