"""What the optimized model is judged against: the oracle's choice, the raw model, PyTorch
float32, each run once per input set however many candidates are compared with them.

For ONNX input the oracle is the input graph in float64 (:func:`normexport.verdict.oracle.
onnx_float64`), else the input file as written (tolerance only). For a PyTorch model it is the
model in float64, else the raw export in float64, else PyTorch float32, with every reason in
the notes (:mod:`normexport.verdict.oracle`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from normexport import runtime
from normexport.io.eager import Eager
from normexport.io.load import LoadedModel
from normexport.precision import rounded_feeds
from normexport.verdict import oracle as oracle_mod
from normexport.verdict import parity as parity_mod
from normexport.verdict.parity import ParityResult, check_parity

Run = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]


class Judge:
    """Judges candidate runs by :func:`normexport.verdict.parity.check_parity` against one run's
    references, built on first use (:func:`references`) and kept for every later candidate.

    Args:
        loaded: the model as loaded (its PyTorch module, where it has one, is a reference).
        raw_path: the raw model on file: the input file, or the raw export.
        raw_session: an ONNX Runtime session of ``raw_path`` with graph optimizations off, or
            None to open one on first use.
        sets: input set name -> feeds (graph input name -> array).
        feed_names: the graph's inputs, in the PyTorch model's ``forward()`` order.
        work: a scratch folder for the float64 copies.
        provider: ``"cpu"`` or ``"cuda"``.
        atol, rtol, strict: the tolerances and ``--strict``, as in ``check_parity``.
    """

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        raw_path: Path,
        raw_session: Any,
        sets: dict[str, dict[str, np.ndarray]],
        feed_names: list[str],
        work: Path,
        provider: str,
        atol: float,
        rtol: float,
        strict: bool,
    ):
        self.loaded, self.raw_path, self.raw_session = loaded, raw_path, raw_session
        self.sets, self.feed_names, self.work, self.provider = sets, feed_names, work, provider
        self.atol, self.rtol, self.strict = atol, rtol, strict
        self._references: dict | None = None

    def __call__(
        self, candidate: Run, output_names: list[str], precision: str = "fp32"
    ) -> ParityResult:
        """The verdict on ``candidate`` (feeds -> outputs named ``output_names``) by the rule
        for ``precision`` (``"fp32"``, ``"fp16"``, ``"bf16"``).

        Raises:
            ValueError: the candidate returns other outputs (count or shapes) than the
                references.
        """
        if self._references is None:
            self._references = references(self)
        return check_parity(
            candidate,
            sets=self.sets,
            output_names=output_names,
            atol=self.atol,
            rtol=self.rtol,
            max_rel_l2=parity_mod.HALF_MAX_REL_L2.get(precision),
            strict=self.strict,
            **(self._references | _rounding(precision)),
        )


def _rounding(precision: str) -> dict:
    """The half-precision parity rule's input rounding for ``precision`` as
    :func:`check_parity`'s ``round_inputs`` (fp32: none; the references' own, the float32
    rule's one-ulp move, stands)."""
    if precision == "fp32":
        return {}
    return {"round_inputs": functools.partial(rounded_feeds, precision=precision)}


def references(judge: Judge) -> dict:
    """:func:`check_parity`'s reference arguments: the oracle (``reference``), the raw model
    where it is not the oracle itself, PyTorch float32 where it is not, the notes, and which
    float32 run the export check judges (``judge_export``; None for ONNX input). Each model is
    run once per input set however many candidates are compared with it
    (:func:`normexport.verdict.parity.remembered`), the oracle on inputs moved by one ulp too (the
    float32 rule's ``round_inputs``, :func:`normexport.verdict.parity.ulp_perturbed`)."""
    raw_session = judge.raw_session or runtime.make_session(
        judge.raw_path, judge.provider, optimization_level=runtime.AS_WRITTEN, spinning=False
    )
    raw = parity_mod.remembered(lambda feeds: runtime.run(raw_session, feeds))
    example = judge.sets["example"]
    if judge.loaded.module is None:
        found = oracle_mod.onnx_float64(judge.raw_path, raw, example, judge.work, "the input graph")
        if found.run is None:  # compared with the input file itself, tolerance only
            notes = [*found.notes, "the reference is the input file as written, in float32"]
            return dict(reference=raw, reference_kind="onnx", oracle_kind="onnx", notes=notes)
        return {
            "reference": parity_mod.remembered(found.run),
            "reference_kind": "onnx",
            "raw": raw,
            "oracle_kind": found.kind,
            "notes": found.notes,
            "round_inputs": parity_mod.remembered(parity_mod.ulp_perturbed),
        }
    eager = Eager(judge.loaded.module)
    pytorch = parity_mod.remembered(lambda feeds: eager([feeds[n] for n in judge.feed_names]))
    found = _pytorch_oracle(judge, raw)
    return {
        "reference": parity_mod.remembered(found.run) if found.run else pytorch,
        "reference_kind": "pytorch",
        "raw": raw,
        "pytorch": pytorch if found.run else None,
        "oracle_kind": found.kind,
        "notes": found.notes,
        # the oracle from the raw export judges PyTorch float32, any other the raw export
        "judge_export": "pytorch" if found.kind.startswith("onnx") else "raw",
        "round_inputs": parity_mod.remembered(parity_mod.ulp_perturbed),
    }


def _pytorch_oracle(judge: Judge, raw: Run) -> oracle_mod.Oracle:
    """The PyTorch model in float64; where that cannot run, the raw export in float64; where
    neither can, None (PyTorch float32 is the reference), with every reason in the notes."""
    example = judge.sets["example"]
    found = oracle_mod.pytorch_float64(judge.loaded, example, judge.feed_names)
    if found.run is not None:
        return found
    export = oracle_mod.onnx_float64(judge.raw_path, raw, example, judge.work, "the raw export")
    notes = [*found.notes, *export.notes]
    if export.run is None:
        notes.append("the reference is PyTorch float32")
        return oracle_mod.Oracle(None, "pytorch_float32", notes)
    return oracle_mod.Oracle(export.run, export.kind, notes)
