"""Numerical parity: does the optimized model compute what the reference computes?

Per output and per input set, two metrics against the reference (PyTorch float32, or the
unoptimized ONNX model for ``.onnx`` input):

- max abs error: ``max |y - r|`` over the elements where the reference is finite;
- relative L2 error: ``||y - r||_2 / ||r||_2`` (0 when both are zero).

An output passes when ``max_abs_err <= atol + rtol * max|r|`` (the tolerance scales with the
output's magnitude, so an output of 1e5 is not held to 1e-4) and the optimized model has no NaN
or Inf where the reference has none. NaN where the reference has none always fails: that is
what a lost eps looks like on a constant input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

#: Default tolerances (float32 models). Folding BN and fusing norms reorders float32 sums, which
#: moves results by a few ulps times the depth of the model; a wrong fold moves them by O(1).
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-3


@dataclasses.dataclass
class OutputError:
    """Errors of one output on one input set."""

    output: str
    max_abs_err: float
    rel_l2_err: float
    max_abs_ref: float
    nonfinite_mismatch: int
    passed: bool


@dataclasses.dataclass
class ParityResult:
    """The parity verdict over all input sets.

    Attributes:
        passed: every output passed on every input set.
        reference: what the model was compared with: ``"pytorch"`` or ``"onnx"``.
        atol, rtol: the tolerances used.
        probes: input set name -> list of :class:`OutputError`, one per output.
    """

    passed: bool
    reference: str
    atol: float
    rtol: float
    probes: dict[str, list[OutputError]]

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

    def failures(self) -> list[tuple[str, OutputError]]:
        """(input set, error) for every output that failed."""
        return [(p, e) for p, errors in self.probes.items() for e in errors if not e.passed]

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "passed": self.passed,
            "reference": self.reference,
            "atol": self.atol,
            "rtol": self.rtol,
            "probes": list(self.probes),
            "outputs": {k: dataclasses.asdict(v) for k, v in self.worst().items()},
            "failures": [{"probe": p, **dataclasses.asdict(e)} for p, e in self.failures()],
        }


def compare(name: str, got: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> OutputError:
    """Compare one output ``got`` with its reference ``ref`` (same shape; any float dtype).

    Raises:
        ValueError: the shapes differ.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"output {name!r}: shape {got.shape} vs reference {ref.shape}")
    finite = np.isfinite(ref)
    mismatch = int(np.count_nonzero(finite & ~np.isfinite(got)))
    diff = np.abs(np.where(finite, got - ref, 0.0))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_abs = float(diff.max()) if diff.size else 0.0
    ref_f = np.where(finite, ref, 0.0)
    max_ref = float(np.abs(ref_f).max()) if ref.size else 0.0
    ref_norm = float(np.linalg.norm(ref_f))
    err_norm = float(np.linalg.norm(diff)) if np.isfinite(max_abs) else float("inf")
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    passed = mismatch == 0 and max_abs <= atol + rtol * max_ref
    return OutputError(name, max_abs, rel_l2, max_ref, mismatch, passed)


def check_parity(
    candidate: Callable[[Mapping[str, np.ndarray]], Sequence[np.ndarray]],
    reference: Callable[[Mapping[str, np.ndarray]], Sequence[np.ndarray]],
    sets: Mapping[str, Mapping[str, np.ndarray]],
    output_names: Sequence[str],
    *,
    reference_kind: str,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> ParityResult:
    """Run ``candidate`` and ``reference`` on every input set and compare each output.

    Args:
        candidate: input feeds -> outputs (the optimized ONNX model).
        reference: input feeds -> outputs (PyTorch eager, or the unoptimized ONNX model).
        sets: input set name -> feeds (see :func:`normexport.inputs.input_sets`).
        output_names: the candidate's output names, for the report.
        reference_kind: ``"pytorch"`` or ``"onnx"``, recorded in the result.
        atol, rtol: tolerances, see the module docstring.

    Raises:
        ValueError: the two return different numbers of outputs or shapes.
    """
    probes = {}
    for set_name, feeds in sets.items():
        got, ref = list(candidate(feeds)), list(reference(feeds))
        if len(got) != len(ref):
            raise ValueError(f"{len(got)} outputs vs {len(ref)} from the reference")
        triples = zip(output_names, got, ref, strict=True)
        probes[set_name] = [compare(n, g, r, atol, rtol) for n, g, r in triples]
    passed = all(e.passed for errors in probes.values() for e in errors)
    return ParityResult(passed, reference_kind, atol, rtol, probes)
