"""How far is close enough: the parity verdict's tolerances and factors, and
:func:`closeness`, the one definition of "close enough" (``atol + rtol * max|ref|``, no NaN/Inf
where the reference is finite) for the verdict and for every other comparison (autotune's
candidates, the tests).

The rule that uses these numbers is in :mod:`normexport.verdict.parity`.
"""

from __future__ import annotations

import dataclasses

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
#: Relative L2 error per output allowed to an int8 model (``--precision int8`` and
#: ``int8-dynamic``): a signal-to-quantization-noise ratio of 20 dB. One tensor rounded to 8
#: bits over its calibrated range keeps some 30 to 40 dB on activations whose range is a few
#: standard deviations wide (6.02 dB a bit, less the crest factor); errors of dozens of
#: layers add up to 20 to 30 dB at the output, while a layer whose range an outlier sets, or a
#: norm's statistics in int8, leave errors of order 0.3 to 1 (docs/parity.md#int8).
INT8_MAX_REL_L2 = 1e-1
#: The share of samples whose top-1 class an int8 model keeps, on class-score outputs (2-D,
#: ``(samples, classes)``), per input set. MLPerf Inference's closed division asks an int8
#: model for 99% of the float32 model's accuracy; the share of top-1 classes unchanged is
#: stricter than that (a flip between two wrong classes costs no accuracy), and on the random
#: inputs normexport generates the oracle's top two classes are often near ties that any
#: rounding flips (1 sample in 64 at 2% relative L2 error, tests/normexport/test_int8.py), so
#: 95% (docs/parity.md#int8).
INT8_MIN_TOP1 = 0.95
#: The reduced-precision rule's bound by ``--precision`` value (float32 models: none).
HALF_MAX_REL_L2 = {
    "fp16": FP16_MAX_REL_L2,
    "bf16": BF16_MAX_REL_L2,
    "int8": INT8_MAX_REL_L2,
    "int8-dynamic": INT8_MAX_REL_L2,
}
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
    (:func:`normexport.verdict.parity.compare`).

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


def error_metrics(got, ref) -> tuple[float, float, float, int, float]:
    """What the parity verdict measures of ``got`` against ``ref`` (arrays of one shape, any
    real dtype, in float64): ``(max abs err, rel L2 err, max |ref|, NaN/Inf where ref is finite,
    spread of ref)``; the errors over the elements where ``ref`` is finite, as
    :func:`closeness` measures them, the relative L2 error ``||got - ref||_2 / ||ref||_2`` (0
    when both are zero, ``inf`` over a zero ``ref``), the spread ``max - min`` of the finite
    ``ref``.

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


def top1_agreement(got, ref) -> float | None:
    """The share of rows of ``(samples, classes)`` class scores whose largest score is at the
    same class in ``got`` as in ``ref``; None where ``ref`` is not 2-D with at least two
    classes (not class scores).

    Raises:
        ValueError: the shapes differ.
    """
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} vs reference {ref.shape}")
    if ref.ndim != 2 or ref.shape[1] < 2 or ref.shape[0] == 0:
        return None
    return float(np.mean(np.argmax(got, axis=1) == np.argmax(ref, axis=1)))
