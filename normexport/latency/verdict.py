"""The latency verdict: the published model is not slower than the raw model beyond the spread
of an A/A control timed in the same run.

:class:`Comparison` holds one model timed against the raw model with both models' A/A controls
and applies the rule (:attr:`Comparison.slower`, :attr:`Comparison.busy`); :func:`compare` makes
one from the timings of :func:`normexport.latency.measure.time_interleaved`; :func:`another`
and :func:`undecided` judge a model on several independent timings of it (at least
:data:`AGREEING` of :data:`MIN_RUNS` rounds before anything is undone); :func:`rejection` turns
one into the check of the rollback's search (:func:`normexport.verdict.rollback.roll_back`,
driven by :func:`normexport.pipeline.timing.judged`); :class:`Speed` is the report's ``speed``.
The sessions, the rule and its reasons, the search and what it costs:
docs/benchmarks.md#the-latency-verdict-never-a-slower-model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fusion import Code
from normexport.latency.measure import Ratio, Timing, paired_ratio
from normexport.verdict.rollback import Rejection, Undone

#: Each timing of the search after the first takes ``--budget`` / this many seconds.
SEARCH_SLICES = 20
#: :attr:`Speed.unchecked` with ``--no-benchmark``.
NOT_TIMED = "--no-benchmark: nothing was timed"
#: The fewest paired rounds of a timing that may count towards undoing a rewrite (a timing with
#: fewer may keep one); the timings taken to confirm one and the search's take at least these.
MIN_RUNS = 30
#: The widest A/A controls' margin (:attr:`Comparison.margin`) at which a timing tells anything:
#: beyond it the machine is too busy, and the speed is unchecked.
MAX_MARGIN = 0.25
#: Independent timings (fresh sessions, fresh rounds), each of :data:`MIN_RUNS` rounds at least,
#: that must all call the model slower before the search for the rewrites responsible starts.
AGREEING = 2


#: Whose time an int8 model's is over: it is timed against the float32 optimized model
#: (docs/precision.md#int8).
FLOAT32_OPTIMIZED = "the float32 optimized model's time"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One model timed against the raw model, with the A/A controls
    (docs/benchmarks.md#the-latency-verdict-never-a-slower-model).

    Attributes:
        ratio: the model's time over the raw model's, per round (> 1: slower), with its 95%
            bootstrap interval.
        raw_control, model_control: the A/A controls: each model's second session's time over
            its first's, in the same rounds.
        against: whose time the model's is over, in words (the raw model's, unless
            :func:`compare` was told otherwise).
    """

    ratio: Ratio
    raw_control: Ratio
    model_control: Ratio
    against: str = "the raw model's time"

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

    @property
    def faster(self) -> bool:
        """The mirror of :attr:`slower`: the ratio's upper bound below ``1 - margin`` (an int8
        model is published only where it is faster than float32: docs/precision.md#int8)."""
        return self.ratio.ci_high < 1.0 - self.margin

    @property
    def busy(self) -> str | None:
        """Why this timing cannot tell that the model is not slower, in words: the A/A
        controls' margin over :data:`MAX_MARGIN` and the model not :attr:`slower` beyond it;
        else None (a ratio above even so wide a margin is evidence all the same: a rewrite
        that makes the model 8x slower is undone on a busy machine too)."""
        if self.margin <= MAX_MARGIN or self.slower:
            return None
        return f"A/A controls within ±{self.margin:.3g}, beyond ±{MAX_MARGIN:g}"

    def message(self) -> str:
        """The ratio with its interval and the control's margin, in words."""
        r = self.ratio
        return (
            f"{r.median:.3g}x {self.against} (95% interval {r.ci_low:.3g}x-{r.ci_high:.3g}x"
            f", {r.runs} rounds; A/A controls within ±{self.margin:.3g})"
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


def compare(
    raw: Sequence[Timing], model: Sequence[Timing], against: str = "the raw model's time"
) -> tuple[Timing, Timing, Comparison]:
    """The raw model's and the model's timings, each the per-round mean of its two sessions
    (ms), and their :class:`Comparison`.

    Args:
        raw, model: the two sessions' timings of each (ms), all from one
            :func:`~normexport.latency.measure.time_interleaved` call.
        against: whose time ``raw``'s is, in words (:attr:`Comparison.against`).

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
        against,
    )
    return raw_time, model_time, comparison


def pooled(sessions: Sequence[Timing]) -> Timing:
    """One model's timing from its sessions' (all from one
    :func:`~normexport.latency.measure.time_interleaved` call): each round's mean, ms.

    Raises:
        ValueError: the timings hold different numbers of runs (not one call).
    """
    return Timing.from_samples(np.mean([t.samples_ms for t in sessions], axis=0))


def another(comparisons: Sequence[Comparison]) -> bool:
    """Whether the model needs one more timing (of :data:`MIN_RUNS` rounds at least) to be
    judged: every timing so far calls it slower, none is :attr:`~Comparison.busy`, and fewer
    than :data:`AGREEING` hold :data:`MIN_RUNS` rounds."""
    enough = sum(c.ratio.runs >= MIN_RUNS for c in comparisons)
    return all(c.slower and c.busy is None for c in comparisons) and enough < AGREEING


def undecided(comparisons: Sequence[Comparison]) -> str | None:
    """Why independent timings of one model (in the order taken) cannot judge it, in words:
    one of them :attr:`~Comparison.busy` (the machine too busy to tell), or they disagree (one
    slower, another not); else None (all slower: undo; or the first not slower: keep).

    Raises:
        ValueError: no timing.
    """
    if not comparisons:
        raise ValueError("undecided needs at least one timing")
    busy = next((c for c in comparisons if c.busy is not None), None)
    if busy is not None:
        return f"the machine was too busy to tell ({busy.busy}): {busy.message()}"
    if len({c.slower for c in comparisons}) > 1:
        said = "; ".join(
            f"{'slower' if c.slower else 'not slower'}: {c.message()}" for c in comparisons
        )
        return f"the timings disagree (fresh sessions, fresh rounds): {said}"
    return None


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
            the two models timed one at a time, the machine too busy to tell or its timings in
            disagreement: :func:`undecided`), or None; the model is then published as the stages
            made it.
        as_optimized: the model as the stages before made it, against the raw model (the first
            timing); None where nothing was timed or the models were timed apart.
        again: its further timings (fresh sessions, fresh rounds), taken where the first called
            it slower (:func:`another`); empty where the first did not.
        published: the published model against the raw model: the last timing of the model as
            optimized where nothing was undone, else the search's last timing (of the model
            kept); None where unchecked.
        undone: the rewrites left out as slower here, in pass order.
        head_to_head: where the search undid rewrites, the model as optimized timed against the
            model without them (fresh sessions; its "raw model" the latter): they are undone only
            where it calls the model as optimized slower; else None.
        models_timed: timings the verdict took (the first one included).
        kept_slower: why a model found slower was published as it is (the half-precision
            conversion or autotune's form, which the search cannot rebuild; or no rewrite to
            blame: the model with none was as slow), or None.
    """

    unchecked: str | None = None
    as_optimized: Comparison | None = None
    again: list[Comparison] = dataclasses.field(default_factory=list)
    published: Comparison | None = None
    undone: list[Undone] = dataclasses.field(default_factory=list)
    head_to_head: Comparison | None = None
    models_timed: int = 0
    kept_slower: str | None = None

    def to_dict(self) -> dict:
        """JSON form (``docs/report.md``, ``speed``)."""
        return {
            "checked": self.unchecked is None,
            "unchecked": self.unchecked,
            "as_optimized": self.as_optimized.to_dict() if self.as_optimized else None,
            "again": [c.to_dict() for c in self.again],
            "published": self.published.to_dict() if self.published else None,
            "undone": [
                {**dataclasses.asdict(u.rewrite), **dataclasses.asdict(u.rejection)}
                for u in self.undone
            ],
            "head_to_head": self.head_to_head.to_dict() if self.head_to_head else None,
            "models_timed": self.models_timed,
            "kept_slower": self.kept_slower,
        }
