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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

#: Default tolerances (float32 models). Folding BN and fusing norms reorders float32 sums, which
#: moves results by a few ulps times the depth of the model; a wrong fold moves them by O(1).
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-3
#: How much further from the oracle than the raw export the optimized model may be (where it
#: is also beyond the tolerance) before it fails: float32 rounding in another order moves
#: results by a small multiple of the export's own error; a wrong rewrite by orders of magnitude.
NOISE_FACTOR = 4.0
#: Relative L2 error per output allowed to a float16 model: float16 keeps 11 significant bits
#: (unit roundoff 2**-11, about 4.9e-4); rounding every weight and activation, through a
#: network of a few dozen layers, leaves errors of a few times 1e-3; a lost eps, a clamped
#: weight or an overflow leaves errors of order 1.
FP16_MAX_REL_L2 = 1e-2
#: The same for a bfloat16 model: bfloat16 keeps 8 significant bits (unit roundoff 2**-8, about
#: 3.9e-3, eight times float16's); the float16 bound scaled alike (about twenty unit roundoffs).
#: A lost eps still leaves errors of order 1.
BF16_MAX_REL_L2 = 8e-2
#: The half-precision rule's bound by ``--precision`` value (float32 models: none).
HALF_MAX_REL_L2 = {"fp16": FP16_MAX_REL_L2, "bf16": BF16_MAX_REL_L2}
#: The raw model's error, as the noise ratio's denominator, is at least this many unit
#: roundoffs of the output's type (float32: 2**-24) times ``max|oracle|``: rounding the
#: output's last ops alone moves it that far.
NOISE_FLOOR_ROUNDOFFS = 4
#: Above this noise ratio (the optimized model's max abs error over the raw model's, floored)
#: an output that passes is warned of, and fails with ``--strict``. An exact rewrite's error is
#: another sample of the model's float32 rounding noise: over the gallery, the demo models and
#: the peer files the largest ratio of an exact rewrite was under half this, and one weight
#: channel scaled by 1.001 gave twice this or more on every demo model
#: (``benchmarks/results/noise_ratio.json``, ``benchmarks/results/verdict.json``).
NOISE_WARN_FACTOR = 8.0


@dataclasses.dataclass
class OutputError:
    """Errors of one output on one input set, against the oracle.

    Attributes:
        max_abs_err, rel_l2_err, nonfinite_mismatch: of the optimized model.
        max_abs_ref: ``max |oracle|``.
        passed: the verdict (see the module docstring).
        raw_max_abs_err, raw_rel_l2_err: of the raw model (None where none was run).
        pytorch_max_abs_err: of PyTorch float32 (None where it is not run, or is the oracle).
        weak: the oracle varies by no more than ``atol`` here (all zeros or constant), or the
            half-precision allowance reaches 1.
        rounding_rel_l2_err: the oracle's relative L2 change when the inputs are rounded to the
            half type (None: a float32 model).
        export_passed: whether the raw export agrees with PyTorch float32 here (see the module
            docstring); None where no export is judged (ONNX input, a probe on cut models).
        noise_ratio: ``max_abs_err`` over the raw model's, floored (see the module docstring);
            None for a half-precision model or where the raw model is the reference itself.
        warned: the output passes, and its noise ratio is above :data:`NOISE_WARN_FACTOR`.
        ulp_sensitivity: float32 rule: the oracle's max abs change when each float input moves
            by one ulp (:func:`ulp_perturbed`), part of the noise ratio's floor; None where the
            model has no float input, or for half precision.
    """

    output: str
    max_abs_err: float
    rel_l2_err: float
    max_abs_ref: float
    nonfinite_mismatch: int
    passed: bool
    raw_max_abs_err: float | None = None
    raw_rel_l2_err: float | None = None
    pytorch_max_abs_err: float | None = None
    weak: bool = False
    rounding_rel_l2_err: float | None = None
    export_passed: bool | None = None
    noise_ratio: float | None = None
    warned: bool = False
    ulp_sensitivity: float | None = None


@dataclasses.dataclass
class ParityResult:
    """The parity verdict over all input sets.

    Attributes:
        reference: where the reference comes from: ``"pytorch"`` or ``"onnx"``.
        atol, rtol: the tolerances used.
        probes: input set name -> list of :class:`OutputError`, one per output.
        oracle: what the errors are measured against, e.g. ``"pytorch_float64"``,
            ``"pytorch_float32"``, ``"onnx_float64"``, ``"onnx"`` (default: ``reference``).
        noise_factor: see :data:`NOISE_FACTOR` (None: no raw model, tolerance only).
        notes: why the oracle is not float64, where it is not.
        max_rel_l2: the half-precision rule's bound on relative L2 error (None: float32 rule).
        strict: a noise-ratio warning (:meth:`warnings`) fails the verdict (``--strict``).
    """

    reference: str
    atol: float
    rtol: float
    probes: dict[str, list[OutputError]]
    oracle: str | None = None
    noise_factor: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    max_rel_l2: float | None = None
    strict: bool = False

    @property
    def passed(self) -> bool:
        """The verdict: every output passed the optimizer's rule on every input set, the
        export was judged nowhere to differ from PyTorch, and with :attr:`strict` nothing was
        warned of."""
        return (
            not self.failures()
            and not self.export_failures()
            and not (self.strict and self.warnings())
        )

    def add(self, other: ParityResult) -> None:
        """Take in another verdict's input sets (a probe run on other models, e.g. cut ones):
        its entries and its notes."""
        self.probes.update(other.probes)
        self.notes.extend(other.notes)

    def worst(self) -> dict[str, OutputError]:
        """Per output, the entry with the largest max abs error over all input sets."""
        worst: dict[str, OutputError] = {}
        for errors in self.probes.values():
            for e in errors:
                if e.output not in worst or (not e.passed, e.max_abs_err) > (
                    not worst[e.output].passed,
                    worst[e.output].max_abs_err,
                ):
                    worst[e.output] = e
        return worst

    def _where(self, test) -> list[tuple[str, OutputError]]:
        return [(p, e) for p, errors in self.probes.items() for e in errors if test(e)]

    def failures(self) -> list[tuple[str, OutputError]]:
        """(input set, error) for every output that failed the optimizer's rule."""
        return self._where(lambda e: not e.passed)

    def export_failures(self) -> list[tuple[str, OutputError]]:
        """(input set, error) for every output where the raw export differs from PyTorch."""
        return self._where(lambda e: e.export_passed is False)

    def warnings(self) -> list[tuple[str, OutputError]]:
        """(input set, error) for every output that passed with a noise ratio above
        :data:`NOISE_WARN_FACTOR`."""
        return self._where(lambda e: e.warned)

    def weak_checks(self) -> list[tuple[str, str]]:
        """(input set, output) for every check whose oracle is all zeros or constant."""
        return [(p, e.output) for p, e in self._where(lambda e: e.weak)]

    def raw_worst(self) -> dict[str, float] | None:
        """Per output, the raw model's largest max abs error over all input sets."""
        if self.noise_factor is None:
            return None
        worst: dict[str, float] = {}
        for errors in self.probes.values():
            for e in errors:
                if e.raw_max_abs_err is not None:
                    worst[e.output] = max(worst.get(e.output, 0.0), e.raw_max_abs_err)
        return worst

    def to_dict(self) -> dict:
        """JSON-ready form: the verdict, the worst entry per output (``outputs``), every
        input set's entries (``sets``), the failures, the export's failures, the warnings and
        the weak checks."""

        def entries(found):
            return [{"probe": p, **dataclasses.asdict(e)} for p, e in found]

        return {
            "passed": self.passed,
            "reference": self.reference,
            "oracle": self.oracle or self.reference,
            "oracle_notes": list(self.notes),
            "atol": self.atol,
            "rtol": self.rtol,
            "noise_factor": self.noise_factor,
            "max_rel_l2": self.max_rel_l2,
            "noise_warn_factor": NOISE_WARN_FACTOR,
            "strict": self.strict,
            "probes": list(self.probes),
            "outputs": {k: dataclasses.asdict(v) for k, v in self.worst().items()},
            "sets": {p: [dataclasses.asdict(e) for e in errs] for p, errs in self.probes.items()},
            "failures": entries(self.failures()),
            "export_failures": entries(self.export_failures()),
            "warnings": entries(self.warnings()),
            "weak_checks": [{"probe": p, "output": o} for p, o in self.weak_checks()],
            "raw_export_max_abs_err": self.raw_worst(),
        }


@dataclasses.dataclass(frozen=True)
class Closeness:
    """How close an array is to a reference: the one definition of "close enough".

    Attributes:
        max_abs_err: ``max |got - ref|`` over the elements where ``ref`` is finite; ``inf``
            where ``got`` is NaN or Inf at such an element (0 for empty arrays).
        max_abs_ref: ``max |ref|`` over its finite elements.
        nonfinite_mismatch: elements where ``ref`` is finite and ``got`` is NaN or Inf.
        tolerance: ``atol + rtol * max_abs_ref``.
    """

    max_abs_err: float
    max_abs_ref: float
    nonfinite_mismatch: int
    tolerance: float

    @property
    def within(self) -> bool:
        """No NaN/Inf where the reference is finite, and ``max_abs_err <= tolerance``."""
        return self.nonfinite_mismatch == 0 and self.max_abs_err <= self.tolerance

    def describe(self) -> str:
        """One line for an assertion or a report, e.g. ``max abs err 0.5 > 0.0004``."""
        line = f"max abs err {self.max_abs_err:.3g} {'<=' if self.within else '>'} tolerance "
        line += f"{self.tolerance:.3g} (max |ref| {self.max_abs_ref:.3g})"
        if self.nonfinite_mismatch:
            line += f", {self.nonfinite_mismatch} NaN/Inf where the reference is finite"
        return line


def closeness(
    got: np.ndarray, ref: np.ndarray, *, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL
) -> Closeness:
    """Compare ``got`` with ``ref`` elementwise in float64: is it within
    ``atol + rtol * max|ref|``, with no NaN/Inf where ``ref`` is finite?

    Elements where ``ref`` itself is NaN or Inf are not compared. This is what "close enough"
    means wherever outputs are compared; the parity verdict adds the raw export's noise on top
    (:func:`compare`).

    Args:
        got, ref: arrays of the same shape, any real dtype.
        atol: absolute tolerance (units of the output).
        rtol: relative tolerance, times the reference's largest finite magnitude.

    Raises:
        ValueError: the shapes differ.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} vs reference {ref.shape}")
    finite = np.isfinite(ref)
    mismatch = int(np.count_nonzero(finite & ~np.isfinite(got)))
    diff = _abs_diff(got, ref, finite)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_ref = float(np.abs(np.where(finite, ref, 0.0)).max()) if ref.size else 0.0
    return Closeness(max_abs, max_ref, mismatch, atol + rtol * max_ref)


def _abs_diff(got: np.ndarray, ref: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """``|got - ref|`` where ``ref`` is finite (0 elsewhere), NaN made ``inf``."""
    diff = np.abs(np.where(finite, got - ref, 0.0))
    return np.where(np.isnan(diff), np.inf, diff)


def _errors(got, ref) -> tuple[float, float, float, int, float]:
    """``(max abs err, rel L2 err, max |ref|, NaN/Inf where ref is finite, spread of ref)``.

    Raises:
        ValueError: the shapes differ.
    """
    close = closeness(got, ref, atol=0.0, rtol=0.0)
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    finite = np.isfinite(ref)
    spread = float(np.ptp(ref[finite])) if finite.any() else 0.0
    ref_norm = float(np.linalg.norm(np.where(finite, ref, 0.0)))
    max_abs = close.max_abs_err
    err_norm = (
        float(np.linalg.norm(_abs_diff(got, ref, finite))) if np.isfinite(max_abs) else float("inf")
    )
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    return max_abs, rel_l2, close.max_abs_ref, close.nonfinite_mismatch, spread


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
        max_abs, rel_l2, max_ref, mismatch, spread = _errors(got, ref)
        raw_err = _errors(raw, ref) if raw is not None else None
        torch_err = _errors(pytorch, ref)[0] if pytorch is not None else None
        moved = _errors(rounded, ref) if rounded is not None else None
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


def remembered(model: Model) -> Model:
    """``model``, run once per feeds mapping (by identity): the oracle and the raw model give
    the same outputs on an input set however many candidates are compared with them (the
    optimized model, then that model without a rewrite, ...). Keeps each feeds mapping it saw,
    so that no other mapping can take its identity."""
    seen: dict[int, tuple[Mapping, Sequence[np.ndarray]]] = {}

    def run(feeds):
        hit = seen.get(id(feeds))
        if hit is None or hit[0] is not feeds:
            hit = seen[id(feeds)] = (feeds, model(feeds))
        return hit[1]

    return run


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
