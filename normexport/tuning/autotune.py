"""Pick, among exact forms of one model, the one that runs fastest on the user's provider: a
:class:`Candidate` is a model and the session settings it needs; :func:`candidates` builds them
from :func:`normexport.tuning.forms.exact_forms`, and :func:`autotune` checks each against the
default's outputs, times them interleaved (:func:`normexport.latency.measure.time_interleaved`)
and returns an :class:`AutotuneResult`. Why, which candidates, and the rule that keeps one:
docs/benchmarks.md#how-autotune-chooses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx_ir as ir

from fusion.base import Op
from fusion.registry import ORT_SKIP_FUSED_NORMS
from normexport import runtime
from normexport.latency.measure import Ratio, Timing, paired_ratio, runner, time_interleaved
from normexport.tuning import forms
from normexport.verdict.parity import closeness

#: ORT graph transformer that fuses Add + LayerNormalization into SkipLayerNormalization.
SKIP_FUSION = "SkipLayerNormFusion"
#: Name prefix of the candidates built without attention fusion.
ATTENTION_UNFUSED = "attention_unfused"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One exact form: the model and the ORT session settings it must run under.

    Attributes:
        model: the .onnx file (or, for a small model built in code, serialized ONNX).
        disabled_optimizers: ORT graph transformers the session must leave out.
    """

    model: Path | bytes
    disabled_optimizers: tuple[str, ...] = ()


@dataclasses.dataclass
class AutotuneResult:
    """What :func:`autotune` measured and chose.

    Attributes:
        best: name of the chosen candidate.
        default: name of the candidate kept unless another is significantly faster.
        provider: ORT provider name the timings were taken on.
        timings: name -> :class:`Timing` (ms) of every candidate that ran.
        ratio_to_default: name -> :class:`Ratio`, per-round paired (< 1: faster).
        max_abs_diff: name -> max |output - default's output|.
        rejected: name -> why it was not considered (failed to load or run, or inexact).
        io_binding: whether the runs used IO binding.
    """

    best: str
    default: str
    provider: str
    timings: dict[str, Timing]
    ratio_to_default: dict[str, Ratio]
    max_abs_diff: dict[str, float]
    rejected: dict[str, str]
    io_binding: bool
    candidates: dict[str, Candidate] = dataclasses.field(repr=False, default_factory=dict)

    @property
    def model(self) -> Path | bytes:
        """The chosen model's file (as the candidate gave it)."""
        return self.candidates[self.best].model

    @property
    def disabled_optimizers(self) -> tuple[str, ...]:
        """ORT transformers the chosen model's deployment session must disable."""
        return self.candidates[self.best].disabled_optimizers

    def to_dict(self) -> dict:
        """JSON-ready form (timings in ms)."""
        return {
            "best": self.best,
            "default": self.default,
            "provider": self.provider,
            "io_binding": self.io_binding,
            "disabled_optimizers": list(self.disabled_optimizers),
            "timings_ms": {k: t.to_dict() for k, t in self.timings.items()},
            "ratio_to_default": {k: r.to_dict() for k, r in self.ratio_to_default.items()},
            "max_abs_diff": self.max_abs_diff,
            "rejected": self.rejected,
        }


def _has_add_into_norm(model: Path) -> bool:
    """True when an Add feeds a norm that SkipLayerNormFusion rewrites
    (:data:`fusion.registry.ORT_SKIP_FUSED_NORMS`)."""
    graph = ir.load(model).graph
    for node in graph:
        if Op(node.op_type, node.domain) in ORT_SKIP_FUSED_NORMS:
            producer = node.inputs[0].producer() if node.inputs[0] is not None else None
            if producer is not None and producer.op_type == "Add":
                return True
    return False


def candidates(
    model: Path,
    *,
    target: str = "ort",
    attention_unfused: Path | None = None,
) -> dict[str, Candidate]:
    """The exact forms of the model file ``model`` (:func:`normexport.tuning.forms.exact_forms`,
    written beside it) as candidates;
    each form with an Add feeding a norm also as ``FORM+no_skip_fusion``, run with ORT's
    SkipLayerNormFusion disabled. The first entry, ``as_built``, is the default.

    ``attention_unfused``: the file of the same model optimized with ``attention=False``
    (:func:`fusion.optimize`); its forms join as ``attention_unfused`` and
    ``attention_unfused+FORM`` (why: docs/benchmarks.md#how-autotune-chooses)."""
    sources = {"": model}
    if attention_unfused is not None:
        sources[ATTENTION_UNFUSED] = attention_unfused
    out = {}
    for prefix, source in sources.items():
        for form, data in forms.exact_forms(source, target=target).items():
            name = form if not prefix else prefix if form == "as_built" else f"{prefix}+{form}"
            out[name] = Candidate(data)
            if _has_add_into_norm(data):
                out[f"{name}+no_skip_fusion"] = Candidate(data, (SKIP_FUSION,))
    return out


def _agrees(got: list[np.ndarray], ref: list[np.ndarray], atol: float, rtol: float) -> float | None:
    """max |got - ref| if every output is within :func:`~normexport.verdict.parity.closeness`'s
    ``atol + rtol * max|ref|`` with no new NaN/Inf, else None (also for a shape mismatch)."""
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        if g.shape != r.shape:
            return None
        c = closeness(g, r, atol=atol, rtol=rtol)
        if not c.within:
            return None
        worst = max(worst, c.max_abs_err)
    return worst


def autotune(
    cands: Mapping[str, Candidate | Path | bytes],
    feeds: Mapping[str, np.ndarray],
    provider: str = "cpu",
    *,
    default: str | None = None,
    io_binding: bool | None = None,
    budget_s: float = 5.0,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> AutotuneResult:
    """Time the candidates on ``provider`` and return the fastest that is exact.

    Args:
        cands: name -> :class:`Candidate` (or a model file, run with default settings), e.g.
            from :func:`candidates`.
        feeds: inputs by graph input name (the user's example inputs).
        provider: ``"cpu"`` or ``"cuda"``, as resolved by
            :func:`normexport.runtime.resolve_provider`.
        default: the candidate to keep unless another is faster beyond the spread (default: the
            first).
        io_binding: run through IO binding (default: on for CUDA).
        budget_s: seconds of timed runs.
        atol, rtol: how far a candidate's outputs may be from the default's.

    Returns:
        :class:`AutotuneResult`.

    Raises:
        ValueError: no candidates, or the default fails to run.
    """
    if not cands:
        raise ValueError("autotune needs at least one candidate")
    cands = {k: v if isinstance(v, Candidate) else Candidate(v) for k, v in cands.items()}
    default = default or next(iter(cands))
    io_binding = provider == "cuda" if io_binding is None else io_binding
    runners, outputs, rejected = _runners(cands, feeds, provider, default, io_binding)
    diffs = {}
    for name in list(runners):
        diff = _agrees(outputs[name], outputs[default], atol, rtol)
        if diff is None:
            rejected[name] = "outputs differ from the default's beyond the tolerance"
            del runners[name]
        else:
            diffs[name] = diff
    timings = time_interleaved(runners, budget_s=budget_s)
    ratios = {k: paired_ratio(t, timings[default]) for k, t in timings.items() if k != default}
    return AutotuneResult(
        best=_choose(timings, ratios, default),
        default=default,
        provider=runtime.PROVIDERS[provider][0],
        timings=timings,
        ratio_to_default=ratios,
        max_abs_diff=diffs,
        rejected=rejected,
        io_binding=io_binding,
        candidates=dict(cands),
    )


def _choose(timings: dict[str, Timing], ratios: dict[str, Ratio], default: str) -> str:
    """The fastest candidate if it beats ``default`` beyond the spread (the 95% interval of its
    paired ratio lies below 1), else ``default``."""
    fastest = min(timings, key=lambda k: timings[k].median_ms)
    return fastest if fastest != default and ratios[fastest].ci_high < 1.0 else default


def _runners(
    cands: dict[str, Candidate],
    feeds: Mapping[str, np.ndarray],
    provider: str,
    default: str,
    io_binding: bool,
) -> tuple[dict, dict, dict[str, str]]:
    """A session per candidate: (name -> run once, name -> its outputs, name -> why it was
    rejected) for the candidates that load and run.

    Raises:
        ValueError: the default candidate does not run.
    """
    runners, outputs, rejected = {}, {}, {}
    for name, cand in cands.items():
        try:
            session = runtime.make_session(
                cand.model, provider, spinning=False, disabled_optimizers=cand.disabled_optimizers
            )
            runners[name], get = runner(session, feeds, io_binding=io_binding)
            outputs[name] = get()
        except Exception as err:  # a form ORT cannot load here is simply not a candidate
            if name == default:
                raise ValueError(f"the default candidate {name!r} does not run: {err}") from err
            rejected[name] = f"{type(err).__name__}: {err}"
    return runners, outputs, rejected
