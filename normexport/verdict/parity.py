"""Numerical parity: did the optimizer keep the function the model computes?

Three models are run on every input set and compared, per output, with an *oracle*:

- the **optimized** model (normexport's output);
- the **raw** model: the unoptimized export (or, for ``.onnx`` input, the input file);
- PyTorch **float32** eager, where the model is PyTorch.

The oracle is the most exact run there is: the PyTorch model in float64 (or, for ``.onnx``
input, the input graph in float64); where that cannot be built, the float32 reference, and the
result says which. Metrics against the oracle:

- max abs error: ``max |y - r|`` over the elements where the oracle is finite;
- relative L2 error: ``||y - r||_2 / ||r||_2`` (0 when both are zero).

The verdict judges what normexport did, not float32 itself. An output fails on an input set when

- it has NaN or Inf where the oracle is finite (a lost eps on a constant input), or
- ``max_abs_err > atol + rtol * max|oracle|`` **and** ``max_abs_err > NOISE_FACTOR *`` the raw
  model's own max abs error against the oracle.

The second clause is the point: on ill-conditioned inputs (a constant image through stacked
norms, inputs of magnitude 1e3 through BatchNorm'd attention) float32 itself is far from the
exact answer, the raw export is as far, and an optimized model that is no further than the
export's own rounding noise did nothing wrong. A wrong fold is orders of magnitude beyond that
noise, so it still fails. Without a raw model the rule is the tolerance alone.

A half-precision model (``--precision fp16`` or ``bf16``) is judged by another rule, since the
raw export is float32 and its noise says nothing of half-precision rounding: an output fails
where it has NaN or Inf where the oracle is finite, or where its relative L2 error exceeds the
allowance and its max abs error exceeds ``atol`` (outputs near zero). The allowance is the sum of

- ``max_rel_l2`` (:data:`HALF_MAX_REL_L2`): the half type's rounding through a
  well-conditioned network;
- the raw float32 model's own relative L2 error (where float32 itself is far from the oracle, as
  ``nn.RMSNorm``'s dtype-dependent eps on tiny inputs, float16 is not blamed for it);
- ``noise_factor`` times the input's *rounding error*: the relative L2 distance between the
  oracle on the inputs and the oracle on the inputs rounded to the half type. It is what
  rounding one tensor costs at the output, so it measures how much this input's function
  amplifies half-precision rounding (a sigmoid output near 0 turns a small logit error into a
  large relative one); a half-precision model rounds every tensor, and a small multiple of it is
  its own noise. A clamped weight, a lost eps or an overflow leaves errors of order 1, beyond it.

Where the allowance reaches 1 (an output of zeros would pass) the check is reported weak.

**The export is judged too.** For a PyTorch model, the raw export is the ONNX graph that
normexport made of the model, and nothing in the rule above would see it compute another
function (a data-dependent branch the TorchScript tracer fixed on one side passes it, the
optimized model being exactly as far off as the raw export). So, per output and input set, the
two float32 runs of the model, PyTorch eager and the raw export, must agree through the oracle:
the one the oracle was not made from must be within ``atol + rtol * max|oracle|`` of it, or
within ``noise_factor`` times the other's own error (where float32 itself is far from the
oracle, as on ill-conditioned inputs, both are). With the PyTorch model in float64 as the
oracle that is the raw export's error; with the raw export in float64 as the oracle, PyTorch
float32's; with PyTorch float32 as the reference, the raw export within the tolerance. An
output that fails it fails the verdict, and names the export, not the optimizer. Where the
oracle is constant within ``atol`` (a weak check: a constant image through stacked norms, where
both float32 runs normalize their own rounding noise, 2.9e-3 and 5.1e-5 from an oracle of
3e-11 in ``tests/normexport/test_verdict.py``) the export is not judged.

**A sharper check beside the verdict.** The tolerance is wide (1e-3 of the output's scale)
where float32 rounding is 1e-7 of it, so a rewrite that changes the function a little (one
channel scaled by 1.001) passes it. Each float32 output therefore also gets its *noise ratio*:
its max abs error over the raw model's. An exact rewrite reorders float32 operations and its
error is another sample of the same rounding noise, within a small multiple of the raw
model's; where the ratio passes :data:`NOISE_WARN_FACTOR` on an output that passes, the result
warns (``--strict``: fails). The raw model's error can be smaller than the rounding any other
exact kernel makes (it may get an output exact by luck, or compute it in the oracle's order), so
it is floored at the larger of :data:`NOISE_FLOOR_ROUNDOFFS` unit roundoffs of the output's type
times ``max|oracle|`` (the rounding of the output itself) and the oracle's change when every
float input moves by one ulp (:func:`ulp_perturbed`: how much this input amplifies one
rounding; a constant row through a norm turns rounding noise into output, where ONNX Runtime's
InstanceNormalization kernel and the decomposed ops it replaces differ by 20 times what the
raw model was off). The factor and the floor were set on measurements: see
:data:`NOISE_WARN_FACTOR`.

"Close enough" (``atol + rtol * max|ref|``, no NaN/Inf where the reference is finite) is
:func:`closeness`, the one definition for the verdict and for every other comparison (autotune's
candidates, the tests).

A check is *weak* where the oracle's output varies by no more than ``atol`` (all zeros, or
constant): any constant near it would pass, so the result says so.

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
    NOISE_FACTOR,
    NOISE_FLOOR_ROUNDOFFS,
    NOISE_WARN_FACTOR,
    Closeness,
    closeness,
    error_metrics,
)

__all__ = [
    "BF16_MAX_REL_L2",
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "EXPORT_JUDGED",
    "FP16_MAX_REL_L2",
    "HALF_MAX_REL_L2",
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
#: is the raw export in float64). See the module docstring.
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
) -> OutputError:
    """Compare one output ``got`` with the oracle ``ref`` (same shape; any float dtype) and
    judge it (see the module docstring); ``raw`` and ``pytorch`` are the raw model's and
    PyTorch float32's outputs, where there are. With ``max_rel_l2`` the half-precision rule
    judges instead, ``rounded`` being the oracle's output on the inputs rounded to the half
    type (None: no rounding allowance). ``judge_export`` (:data:`EXPORT_JUDGED`) also judges
    the export by that float32 run.

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
    half = max_rel_l2 is not None
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
    return OutputError(name, *found, rounding, export, ratio, warned, sensitivity)


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
) -> ParityResult:
    """Run the models on every input set and compare each output with the oracle.

    Args:
        candidate, reference: input feeds -> outputs: the optimized ONNX model, and the
            oracle (float64 where it can be built, else PyTorch eager float32 or the
            unoptimized ONNX model).
        sets: input set name -> feeds (see :func:`normexport.io.inputs.input_sets`).
        output_names, reference_kind: the candidate's output names, and ``"pytorch"`` or
            ``"onnx"``, for the report.
        atol, rtol: tolerances, see the module docstring.
        raw: the unoptimized model; with it the verdict allows the export's own noise.
        pytorch: PyTorch float32, compared with the oracle (the export check, the report).
        oracle_kind, notes: what ``reference`` is (e.g. ``"pytorch_float64"``), and why.
        noise_factor: see :data:`NOISE_FACTOR`.
        max_rel_l2: judge by the half-precision rule with this bound (None: float32 rule).
        round_inputs: feeds -> the feeds rounded to the half type (the oracle is run on them
            too, for the half-precision rule's rounding allowance); for the float32 rule the
            feeds moved by one ulp (the noise ratio's floor), :func:`ulp_perturbed` by default
            where there is a raw model.
        judge_export: judge the export too, by this float32 run (:data:`EXPORT_JUDGED`).
        strict: a noise-ratio warning fails the verdict.

    Raises:
        ValueError: the models return different numbers of outputs or shapes.
    """
    rule = {"noise_factor": noise_factor, "max_rel_l2": max_rel_l2, "judge_export": judge_export}
    if round_inputs is None and max_rel_l2 is None and raw is not None:  # the noise floor's
        round_inputs = ulp_perturbed
    rounded = _on_rounded(reference, round_inputs) if round_inputs is not None else None
    probes = {}
    for set_name, feeds in sets.items():
        progress.step(f"input set {set_name}")
        got, ref, *others = _outputs(feeds, candidate, reference, raw, pytorch, rounded)
        probes[set_name] = [
            compare(n, g, r, atol, rtol, raw=w, pytorch=t, rounded=h, **rule)
            for n, g, r, w, t, h in zip(output_names, got, ref, *others, strict=True)
        ]
    noise = noise_factor if (raw is not None or round_inputs is not None) else None
    found = (reference_kind, atol, rtol, probes, oracle_kind, noise, list(notes), max_rel_l2)
    return ParityResult(*found, strict=strict)


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
