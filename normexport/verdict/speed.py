"""The latency verdict: the published model is not slower than the raw model beyond the spread
of an A/A control timed in the same run.

A timing (the main job's, :func:`normexport.pipeline.timing.timed_against_raw`) runs, in every round
and in a random order (:func:`normexport.runtime.latency.time_interleaved`), two ``ORT_ENABLE_ALL``
sessions of the raw model and two of the candidate, opened raw, candidate, candidate, raw
(:func:`normexport.runtime.latency.counterbalanced`; where two of each do not fit in memory, and on
CUDA, one session of each, called twice a round). A model's time in a round is the mean of its two
calls.

The rule (:class:`Comparison`): the candidate is **slower** where the lower bound of the 95%
bootstrap interval of the median per-round ratio candidate / raw
(:func:`normexport.runtime.latency.paired_ratio`) is above ``1 + m``, ``m`` the A/A controls'
deviation from 1: the larger of ``|1 - lo|`` and ``|hi - 1|`` of the 95% intervals of each
model's second session over its first, timed in the same rounds, the larger of the two
models'. Slower, so, only where the whole interval lies beyond what two sessions of one model
differ by on this machine now. Both models' controls, not the raw model's alone: sessions of
one file differ persistently (a 12-microsecond graph's by up to 20%), and one pair is a small
sample of that; two sessions of one small graph, timed as two models 80 times (both ways), were
called slower 4 times by the raw model's control alone, never by both.

Where the model as the stages made it is slower, in its first timing and in a second one as
long (:func:`normexport.pipeline.timing.judged`: a search started on noise would undo rewrites
that are not slower), the rewrites responsible are found by the
parity rollback's group testing (:func:`normexport.verdict.rollback.roll_back`, this timing as
its check, :func:`rejection`), each test a model built again from the raw one without some
rewrites, and left out (code ``slower_here``, the ratio of a model where it was the only
suspect left). What that costs, in timings of ``--budget / SEARCH_SLICES`` seconds each (at
least 20 rounds), after the first timing (``--budget`` seconds, the report's latency): the model
with no rewrite (1); the passes with rewrites, ``P`` of them, by halving (about
``2 * log2(P) + 1`` per slower pass); within a slower pass of ``n`` rewrites, about
``2 * log2(n) + 1`` more, where the search's time so far and that many more tests at its mean
time fit in ``--budget`` (else the pass is undone whole); the model kept (1), and a round more
where it is still slower. 40 rewrites in 4 passes, one slower among a pass's 16: 1 + 5 + 9 + 1
= 16 timings, half a second each at the default budget of 10 s (builds aside: a large model's
search stops at the passes sooner). Where not even the passes can be searched within the
budget, every rewrite is undone: the model with none was timed not slower.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fusion import Code
from normexport.runtime.latency import Ratio, Timing, paired_ratio
from normexport.verdict.rollback import Rejection, Undone

#: Each timing of the search after the first takes ``--budget`` / this many seconds.
SEARCH_SLICES = 20
#: :attr:`Speed.unchecked` with ``--no-benchmark``.
NOT_TIMED = "--no-benchmark: nothing was timed"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One model timed against the raw model, with the A/A control (see the module docstring).

    Attributes:
        ratio: the model's time over the raw model's, per round (> 1: slower), with its 95%
            bootstrap interval.
        raw_control, model_control: the A/A controls: each model's second session's time over
            its first's, in the same rounds.
    """

    ratio: Ratio
    raw_control: Ratio
    model_control: Ratio

    @property
    def margin(self) -> float:
        """The A/A controls' deviation from 1: the largest of ``|1 - lo|`` and ``|hi - 1|``
        of the two."""
        controls = (self.raw_control, self.model_control)
        return max(max(abs(1.0 - c.ci_low), abs(c.ci_high - 1.0)) for c in controls)

    @property
    def slower(self) -> bool:
        """The rule: the ratio's lower bound above ``1 + margin``."""
        return self.ratio.ci_low > 1.0 + self.margin

    def message(self) -> str:
        """The ratio with its interval and the control's margin, in words."""
        r = self.ratio
        return (
            f"{r.median:.3g}x the raw model's time (95% interval {r.ci_low:.3g}x-{r.ci_high:.3g}x"
            f"; A/A controls within ±{self.margin:.3g})"
        )

    def to_dict(self) -> dict:
        """JSON form: ``ratio``, ``raw_control`` and ``model_control`` (each ``median``,
        ``ci_low``, ``ci_high``, ``runs``, ``significant``), ``margin``, ``slower``."""
        return {
            "ratio": self.ratio.to_dict(),
            "raw_control": self.raw_control.to_dict(),
            "model_control": self.model_control.to_dict(),
            "margin": self.margin,
            "slower": self.slower,
        }


def compare(raw: Sequence[Timing], model: Sequence[Timing]) -> tuple[Timing, Timing, Comparison]:
    """The raw model's and the model's timings, each the per-round mean of its two sessions
    (ms), and their :class:`Comparison`.

    Args:
        raw, model: the two sessions' timings of each (ms), all from one
            :func:`~normexport.runtime.latency.time_interleaved` call.

    Raises:
        ValueError: not two timings of each, or not from one call (different run counts).
    """
    if len(raw) != 2 or len(model) != 2:
        raise ValueError("compare needs the timings of two sessions of each model")
    raw_time, model_time = pooled(raw), pooled(model)
    comparison = Comparison(
        paired_ratio(model_time, raw_time),
        paired_ratio(raw[1], raw[0]),
        paired_ratio(model[1], model[0]),
    )
    return raw_time, model_time, comparison


def pooled(sessions: Sequence[Timing]) -> Timing:
    """One model's timing from its sessions' (all from one
    :func:`~normexport.runtime.latency.time_interleaved` call): each round's mean, ms.

    Raises:
        ValueError: the timings hold different numbers of runs (not one call).
    """
    return Timing.from_samples(np.mean([t.samples_ms for t in sessions], axis=0))


def rejection(comparison: Comparison | None) -> Rejection | None:
    """``slower_here`` with the comparison's message where the model is slower, else None (as
    where it could not be compared)."""
    if comparison is None or not comparison.slower:
        return None
    return Rejection(Code.SLOWER_HERE, comparison.message())


@dataclasses.dataclass
class Speed:
    """The latency verdict on the published model (the report's ``speed``).

    Attributes:
        unchecked: why the speed was not checked (``--no-benchmark``, the memory plan's reason,
            the two models timed one at a time), or None.
        as_optimized: the model as the stages before made it, against the raw model (the first
            timing); None where unchecked.
        published: the published model against the raw model: ``as_optimized`` where nothing
            was undone, else the search's last timing (of the model kept).
        undone: the rewrites left out as slower here, in pass order.
        models_timed: timings the verdict took (the first one included).
        kept_slower: why a model found slower was published as it is (the half-precision
            conversion or autotune's form, which the search cannot rebuild; or no rewrite to
            blame: the model with none was as slow), or None.
    """

    unchecked: str | None = None
    as_optimized: Comparison | None = None
    published: Comparison | None = None
    undone: list[Undone] = dataclasses.field(default_factory=list)
    models_timed: int = 0
    kept_slower: str | None = None

    def to_dict(self) -> dict:
        """JSON form (``docs/report.md``, ``speed``)."""
        return {
            "checked": self.unchecked is None,
            "unchecked": self.unchecked,
            "as_optimized": self.as_optimized.to_dict() if self.as_optimized else None,
            "published": self.published.to_dict() if self.published else None,
            "undone": [
                {**dataclasses.asdict(u.rewrite), **dataclasses.asdict(u.rejection)}
                for u in self.undone
            ],
            "models_timed": self.models_timed,
            "kept_slower": self.kept_slower,
        }
