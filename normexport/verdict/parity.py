"""Numerical parity: did the optimizer keep the function the model computes? The optimized
model, the raw model and PyTorch float32 are compared, per output and input set, with the
oracle (:mod:`normexport.verdict.oracle`). The rule (float32 and half precision), the export's
judgement, the noise ratio and weak checks: docs/parity.md#the-rule and the sections after it.

This module holds the rule (:func:`compare`, :func:`check_parity`); the numbers it uses
(tolerances, factors) and :func:`closeness` are defined in :mod:`normexport.verdict.tolerance`,
the result types in :mod:`normexport.verdict.result`, and all are importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from normexport import progress
from normexport.verdict.result import OutputError, ParityResult
from normexport.verdict.tolerance import (
    BF16_MAX_REL_L2,
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    FP16_MAX_REL_L2,
    HALF_MAX_REL_L2,
    INT8_MAX_REL_L2,
    INT8_MIN_TOP1,
    NOISE_FACTOR,
    NOISE_FLOOR_ROUNDOFFS,
    NOISE_WARN_FACTOR,
    Closeness,
    closeness,
    error_metrics,
    top1_agreement,
)

__all__ = [
    "BF16_MAX_REL_L2",
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "EXPORT_JUDGED",
    "FP16_MAX_REL_L2",
    "HALF_MAX_REL_L2",
    "INT8_MAX_REL_L2",
    "INT8_MIN_TOP1",
    "NOISE_FACTOR",
    "NOISE_FLOOR_ROUNDOFFS",
    "NOISE_WARN_FACTOR",
    "Closeness",
    "Model",
    "OutputError",
    "ParityResult",
    "Recorded",
    "check_parity",
    "closeness",
    "compare",
    "ulp_perturbed",
]

#: Which float32 run of a PyTorch model the export check judges against the oracle: the raw
#: export (the oracle is PyTorch's: float64, or float32 itself) or PyTorch float32 (the oracle
#: is the raw export in float64): docs/parity.md#the-export-is-judged-too.
EXPORT_JUDGED = ("raw", "pytorch")


def compare(
    name: str,
    got: np.ndarray,
    ref: np.ndarray,
    atol: float,
    rtol: float,
    *,
    raw: np.ndarray | None = None,
    pytorch: np.ndarray | None = None,
    noise_factor: float = NOISE_FACTOR,
    max_rel_l2: float | None = None,
    rounded: np.ndarray | None = None,
    judge_export: str | None = None,
    min_top1: float | None = None,
) -> OutputError:
    """Compare one output ``got`` with the oracle ``ref`` (same shape; any float dtype) and
    judge it (docs/parity.md#the-rule); ``raw`` and ``pytorch`` are the raw model's and
    PyTorch float32's outputs, where there are. With ``max_rel_l2`` the half-precision rule
    judges instead, ``rounded`` being the oracle's output on the inputs rounded to the half
    type (None: no rounding allowance). ``judge_export`` (:data:`EXPORT_JUDGED`) also judges
    the export by that float32 run. With ``min_top1`` (int8), an output of class scores
    (:func:`~normexport.verdict.tolerance.top1_agreement`) passes only where at least that
    share of its samples keep the oracle's top-1 class.

    Raises:
        ValueError: the shapes differ, or ``judge_export`` names a run that is not given.
    """
    try:
        max_abs, rel_l2, max_ref, mismatch, spread = error_metrics(got, ref)
        raw_err = error_metrics(raw, ref) if raw is not None else None
        torch_err = error_metrics(pytorch, ref)[0] if pytorch is not None else None
        moved = error_metrics(rounded, ref) if rounded is not None else None
    except ValueError as err:
        raise ValueError(f"output {name!r}: {err}") from None
    half, top1 = max_rel_l2 is not None, None
    rounding = moved[1] if moved is not None and half else None
    sensitivity = moved[0] if moved is not None and not half else None
    tolerance = atol + rtol * max_ref
    weak = spread <= atol
    ratio, raw_max = None, raw_err[0] if raw_err is not None else None
    if half:
        allowed = max_rel_l2 + (raw_err[1] if raw_err is not None else 0.0)
        allowed += noise_factor * (rounding or 0.0)
        passed = mismatch == 0 and (rel_l2 <= allowed or max_abs <= atol)
        weak = weak or allowed >= 1.0
        top1 = top1_agreement(got, ref) if min_top1 is not None else None
        passed = passed and (top1 is None or top1 >= min_top1)
    else:
        passed = _float32_rule(max_abs, mismatch, raw_max, tolerance, noise_factor)
        floor = max(_roundoff(got) * NOISE_FLOOR_ROUNDOFFS * max_ref, sensitivity or 0.0)
        ratio = _noise_ratio(max_abs, raw_max, floor) if raw_max is not None else None
    runs = {"raw": raw_max, "pytorch": torch_err}
    constant = spread <= atol  # both float32 runs compute rounding noise there: not judged
    export = None if constant else _export_agrees(runs, judge_export, tolerance, noise_factor)
    warned = passed and ratio is not None and ratio > NOISE_WARN_FACTOR
    raw_l2 = raw_err[1] if raw_err else None
    found = (max_abs, rel_l2, max_ref, mismatch, passed, raw_max, raw_l2, torch_err, weak)
    return OutputError(name, *found, rounding, export, ratio, warned, sensitivity, top1)


def _float32_rule(
    max_abs: float, mismatch: int, raw_max_abs: float | None, tolerance: float, noise: float
) -> bool:
    """The float32 verdict: no NaN/Inf where the oracle is finite, and within ``tolerance``
    or within ``noise`` times the raw model's max abs error (None: no raw model)."""
    if mismatch:
        return False
    return max_abs <= tolerance or (raw_max_abs is not None and max_abs <= noise * raw_max_abs)


def _export_agrees(
    errors: dict[str, float | None], judged: str | None, tolerance: float, noise_factor: float
) -> bool | None:
    """The export check: ``errors[judged]`` (the max abs error of that float32 run) within
    ``tolerance``, or within ``noise_factor`` times the other run's; None: nothing judged.

    Raises:
        ValueError: ``judged`` names a run with no error (its outputs were not given).
    """
    if judged is None:
        return None
    err = errors.pop(judged, None)
    if err is None:
        raise ValueError(f"judge_export={judged!r}: that run's outputs are not given")
    other = next(iter(errors.values()))
    return err <= tolerance or (other is not None and err <= noise_factor * other)


def _noise_ratio(max_abs: float, raw_max_abs: float, floor: float) -> float:
    """``max_abs`` over ``raw_max_abs`` floored at ``floor`` (0 where both are 0; ``inf`` for
    NaN, or an error over a zero floor)."""
    if max_abs == 0:
        return 0.0
    below = max(raw_max_abs, floor)
    return max_abs / below if below > 0 else float("inf")


def _roundoff(array: np.ndarray) -> float:
    """The unit roundoff of ``array``'s float type (float32 2**-24, float16 2**-11); float32's
    for any other type."""
    dtype = np.asarray(array).dtype
    return float(np.finfo(dtype if dtype.kind == "f" else np.float32).eps) / 2


def ulp_perturbed(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with each element of each float input moved by one ulp of its type, up or down
    (seeded, so every call moves alike); other inputs as they are (the same objects). The
    oracle's change on them is how far one rounding of the input moves the output: where a
    function is ill-conditioned (a constant row normalized, whose centred values are rounding
    noise over ``sqrt(eps)``), exact kernels differ from each other by about that much."""
    rng = np.random.default_rng(0)
    out = {}
    for name, array in feeds.items():
        if array.dtype.kind != "f":
            out[name] = array
            continue
        up = rng.integers(0, 2, size=array.shape).astype(bool)
        out[name] = np.where(up, np.nextafter(array, np.inf), np.nextafter(array, -np.inf))
    return out


Model = Callable[[Mapping[str, np.ndarray]], Sequence[np.ndarray]]


class Recorded:
    """``model``, run once per feeds mapping (by identity): the oracle and the raw model give
    the same outputs on an input set however many candidates are compared with them (the
    optimized model, then that model without a rewrite, ...). Keeps each feeds mapping it saw,
    so that no other mapping can take its identity.

    Args:
        model: feeds -> outputs.
        close: frees what runs ``model`` (an ONNX Runtime session, a PyTorch copy), where it
            holds anything; the outputs stay recorded, and a later miss runs ``model`` again.
    """

    def __init__(self, model: Model, close: Callable[[], None] | None = None):
        self._model, self._close = model, close
        self._seen: dict[int, tuple[Mapping, Sequence[np.ndarray]]] = {}

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> Sequence[np.ndarray]:
        if not self._has(feeds):
            self._seen[id(feeds)] = (feeds, self._model(feeds))
        return self._seen[id(feeds)][1]

    def _has(self, feeds: Mapping[str, np.ndarray]) -> bool:
        """Whether the outputs on this very mapping (its identity) are recorded."""
        return self._seen.get(id(feeds), (None,))[0] is feeds

    def record(self, sets: Iterable[Mapping[str, np.ndarray]], what: str = "") -> None:
        """Run the model on each feeds mapping of ``sets`` it has not seen (saying so on the
        progress display as ``what``, where there is one), then free it."""
        missing = [f for f in sets if not self._has(f)]
        if missing and what:
            progress.step(what)
        for feeds in missing:
            self(feeds)
        self.close()

    def close(self) -> None:
        """Free what runs the model (see ``close`` above)."""
        if self._close is not None:
            self._close()


def check_parity(
    candidate: Model,
    reference: Model,
    sets: Mapping[str, Mapping[str, np.ndarray]],
    output_names: Sequence[str],
    *,
    reference_kind: str,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    raw: Model | None = None,
    pytorch: Model | None = None,
    oracle_kind: str | None = None,
    notes: Sequence[str] = (),
    noise_factor: float = NOISE_FACTOR,
    max_rel_l2: float | None = None,
    round_inputs: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]] | None = None,
    judge_export: str | None = None,
    strict: bool = False,
    oracle_float32: Sequence = (),
    min_top1: float | None = None,
) -> ParityResult:
    """Run the models on every input set and compare each output with the oracle.

    Args:
        candidate, reference: input feeds -> outputs: the optimized ONNX model, and the
            oracle (float64 where it can be built, else PyTorch float32 or the raw ONNX model).
        sets: input set name -> feeds (see :func:`normexport.io.inputs.input_sets`).
        output_names, reference_kind: the candidate's output names; ``"pytorch"``/``"onnx"``.
        atol, rtol, noise_factor: the tolerances and :data:`NOISE_FACTOR` (docs/parity.md).
        raw: the unoptimized model; with it the verdict allows the export's own noise.
        pytorch: PyTorch float32, compared with the oracle (the export check, the report).
        oracle_kind, notes: what ``reference`` is (``"pytorch_float64"``, ...), and why.
        max_rel_l2: the half-precision rule's bound (None: the float32 rule).
        round_inputs: feeds -> the feeds rounded to the half type (for the half rule's rounding
            allowance); for the float32 rule, moved by one ulp (the noise ratio's floor),
            :func:`ulp_perturbed` by default where there is a raw model.
        judge_export: judge the export too, by this float32 run (:data:`EXPORT_JUDGED`).
        strict: a noise-ratio warning fails the verdict.
        oracle_float32: the nodes the float64 oracle runs in float32, by op type
            (:class:`normexport.verdict.float64.Float32Nodes`).
        min_top1: int8's share of samples that keep their top-1 class on class-score outputs
            (:data:`INT8_MIN_TOP1`; None: not judged).

    Raises:
        ValueError: the models return different numbers of outputs or shapes.
    """
    rule = {"noise_factor": noise_factor, "max_rel_l2": max_rel_l2, "judge_export": judge_export}
    rule |= {"min_top1": min_top1}
    rule |= {"atol": atol, "rtol": rtol}
    if round_inputs is None and max_rel_l2 is None and raw is not None:  # the noise floor's
        round_inputs = ulp_perturbed
    rounded = _on_rounded(reference, round_inputs) if round_inputs is not None else None
    models = (candidate, reference, raw, pytorch)
    probes = {
        n: _compared(n, feeds, models, rounded, output_names, rule) for n, feeds in sets.items()
    }
    noise = noise_factor if (raw is not None or round_inputs is not None) else None
    return ParityResult(
        reference=reference_kind,
        atol=atol,
        rtol=rtol,
        probes=probes,
        oracle=oracle_kind,
        noise_factor=noise,
        notes=list(notes),
        max_rel_l2=max_rel_l2,
        strict=strict,
        oracle_float32=[entry.to_dict() for entry in oracle_float32],
    )


def _compared(
    set_name: str,
    feeds: Mapping[str, np.ndarray],
    models: tuple,
    rounded: Callable | None,
    names: Sequence[str],
    rule: dict,
) -> list[OutputError]:
    """Each output of input set ``set_name`` compared with the oracle (:func:`compare`);
    ``models``: the candidate, the reference, and the raw and PyTorch runs (None where there is
    none); ``rounded``: the reference on the rounded inputs (:func:`_on_rounded`), or None.

    The half rule's rounding allowance is run on every set. The float32 rule's one-ulp move only
    raises the noise ratio's floor, so the oracle runs on the moved inputs only where the ratio
    without it is above :data:`NOISE_WARN_FACTOR` on an output that passes
    (:func:`_floor_decides`): elsewhere the ratio is within the warning either way, and the
    outputs keep ``ulp_sensitivity`` None:
    docs/parity.md#a-sharper-check-beside-the-verdict-the-noise-ratio-and---strict."""
    progress.step(f"input set {set_name}")
    got, ref, *others = _outputs(feeds, *models)

    def judged(moved: Sequence | None) -> list[OutputError]:
        moved = list(moved) if moved is not None else [None] * len(got)
        return [
            compare(n, g, r, raw=w, pytorch=t, rounded=h, **rule)
            for n, g, r, w, t, h in zip(names, got, ref, *others, moved, strict=True)
        ]

    if rounded is None:
        return judged(None)
    if rule["max_rel_l2"] is not None:
        return judged(rounded(feeds))
    first = judged(None)
    return judged(rounded(feeds)) if any(map(_floor_decides, first)) else first


def _floor_decides(error: OutputError) -> bool:
    """Whether the oracle's one-ulp sensitivity could change the float32 verdict on this
    output: it passes, and its noise ratio without that floor is above the warning's factor
    (a higher floor only lowers the ratio)."""
    return error.passed and error.noise_ratio is not None and error.noise_ratio > NOISE_WARN_FACTOR


def _on_rounded(reference: Model, round_inputs) -> Callable:
    """``reference`` on the feeds rounded by ``round_inputs``; None where rounding changes no
    feed (integer inputs only)."""

    def run(feeds):
        rounded = round_inputs(feeds)
        return None if all(rounded[k] is feeds[k] for k in feeds) else reference(rounded)

    return run


def _outputs(feeds, candidate: Model, reference: Model, *others) -> list[list]:
    """Each model's outputs on ``feeds``, the candidate's first; ``[None, ...]`` for a model
    that is None or returns None.

    Raises:
        ValueError: the models return different numbers of outputs.
    """
    got, ref = list(candidate(feeds)), list(reference(feeds))
    rest = [m(feeds) if m is not None else None for m in others]
    rest = [list(r) if r is not None else [None] * len(got) for r in rest]
    if any(len(o) != len(got) for o in (ref, *rest)):
        raise ValueError(f"{len(got)} outputs vs {len(ref)} from the reference")
    return [got, ref, *rest]
