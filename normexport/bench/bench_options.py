"""What ``normexport bench`` times, where and for how long: :class:`BenchOptions`, and the
(batch, sequence) points of a sweep."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

#: ``--budget``'s default for ``normexport bench``, seconds: twice the main job's, since bench
#: times every optimizer's variant and eager at every point of a sweep (three by default), where
#: the main job times three models at one size.
BENCH_BUDGET_S = 20.0


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What :func:`normexport.bench.measure.bench_model` times, where and for how long.

    Attributes:
        provider: ``"cpu"`` or ``"cuda"`` (already resolved).
        batches, seqs, sweep: the points, see :func:`sweep_points` (None keeps the example's
            size).
        io_binding, cuda_graph: time with IO binding, with CUDA graph capture and replay
            (docs/benchmarks.md#what-bench-times-and-how).
        target: normexport's target.
        only: variants to build (default: all).
        floor: measure the elementwise floor.
        budget_s: timing seconds over all points.
        min_runs: timed rounds per point at least, whatever the budget.
        with_cpu: also time the raw export and normexport's model on ORT's CPU provider
            (:func:`normexport.bench.measure.cpu_baseline`), interleaved with the rest; for a
            CUDA comparison.
    """

    provider: str = "cpu"
    batches: Sequence[int | None] = (None,)
    seqs: Sequence[int | None] = (None,)
    sweep: str = "grid"
    io_binding: bool = False
    cuda_graph: bool = False
    target: str = "ort"
    only: Sequence[str] | None = None
    floor: bool = True
    budget_s: float = BENCH_BUDGET_S
    min_runs: int = 20
    with_cpu: bool = False

    def settings(self, eager: bool) -> dict[str, Any]:
        """The result's JSON ``settings``: how it was timed, and whether eager ran beside."""
        keys = ("sweep", "min_runs", "with_cpu", "io_binding", "cuda_graph", "target", "budget_s")
        return {k: getattr(self, k) for k in keys} | {"eager": eager}


def sweep_points(
    batches: list[int | None], seqs: list[int | None], sweep: str = "grid"
) -> list[tuple[int | None, int | None]]:
    """The (batch, seq) points of a sweep, in timing order (None: the example's own size).

    ``"grid"``: every pair, batch varying fastest. ``"cross"``: every batch at ``seqs[0]``,
    then every other sequence length at ``batches[0]``; the latency-vs-batch and
    latency-vs-sequence curves for far fewer points than the grid.

    Raises:
        ValueError: ``sweep`` is neither.
    """
    if sweep == "grid":
        return [(b, s) for s in seqs for b in batches]
    if sweep == "cross":
        return [(b, seqs[0]) for b in batches] + [(batches[0], s) for s in seqs[1:]]
    raise ValueError(f"unknown sweep {sweep!r}: 'grid' or 'cross'")
