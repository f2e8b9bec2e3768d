"""The parity verdict's result types: :class:`OutputError` (one output on one input set) and
:class:`ParityResult` (all of them, the verdict), whose ``to_dict`` is the report's ``parity``.

How the errors are measured and judged: :mod:`normexport.verdict.parity`.
"""

from __future__ import annotations

import dataclasses

from normexport.verdict.tolerance import NOISE_WARN_FACTOR


@dataclasses.dataclass
class OutputError:
    """Errors of one output on one input set, against the oracle (the rule that judges them:
    :mod:`normexport.verdict.parity`).

    Attributes:
        max_abs_err, rel_l2_err, nonfinite_mismatch: of the optimized model.
        max_abs_ref: ``max |oracle|``.
        passed: the verdict.
        raw_max_abs_err, raw_rel_l2_err: of the raw model (None where none was run).
        pytorch_max_abs_err: of PyTorch float32 (None where it is not run, or is the oracle).
        weak: the oracle varies by no more than ``atol`` here (all zeros or constant), or the
            half-precision allowance reaches 1.
        rounding_rel_l2_err: the oracle's relative L2 change when the inputs are rounded to the
            half type (None: a float32 model).
        export_passed: whether the raw export agrees with PyTorch float32 here; None where no
            export is judged (ONNX input, a probe on cut models).
        noise_ratio: ``max_abs_err`` over the raw model's, floored; None for a half-precision
            model or where the raw model is the reference itself.
        warned: the output passes, and its noise ratio is above :data:`NOISE_WARN_FACTOR`.
        ulp_sensitivity: float32 rule: the oracle's max abs change when each float input moves
            by one ulp (:func:`normexport.verdict.parity.ulp_perturbed`), part of the noise
            ratio's floor, measured only where it could decide the warning; None elsewhere,
            where the model has no float input, or for half precision.
        top1_agreement: int8: the share of samples whose top-1 class is the oracle's, on an
            output of class scores (:func:`normexport.verdict.tolerance.top1_agreement`);
            None elsewhere.
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
    top1_agreement: float | None = None


@dataclasses.dataclass
class BlockVerdict:
    """One block of a verdict taken block by block (:mod:`normexport.verdict.block_parity`): the
    optimized model's block against the oracle's, on each input set, on the float values the
    block hands on.

    Attributes:
        block: the block (:class:`normexport.verdict.blocks.Block`) as a dict: index, inputs,
            outputs, nodes, weight bytes, how many of the reference's blocks it spans.
        seconds: wall time of the optimized model's block (s): opening its session and its runs.
        local: input set -> errors of the block fed the oracle's values at its inputs (the
            error this block makes), judged with the raw model's block fed alike as the noise.
        chained: input set -> errors of the block fed its own previous blocks' outputs (the
            error accumulated so far), judged with the raw model's chain as the noise.
    """

    block: dict
    seconds: float
    local: dict[str, list[OutputError]]
    chained: dict[str, list[OutputError]]

    def failures(self) -> list[tuple[str, OutputError]]:
        """(where, error) of every value that failed, ``where`` naming the input set, the block
        and how it was fed."""
        index = self.block["index"]
        return [
            (f"{probe}, block {index} ({how})", e)
            for how, found in (("fed the oracle's inputs", self.local), ("chained", self.chained))
            for probe, errors in found.items()
            for e in errors
            if not e.passed
        ]

    def worst_local(self) -> OutputError | None:
        """The local entry with the largest relative L2 error (None: no float value)."""
        entries = [e for errors in self.local.values() for e in errors]
        return max(entries, key=lambda e: e.rel_l2_err, default=None)

    def to_dict(self) -> dict:
        """JSON form: the block, its time, whether it passed, its worst local entry and its
        worst chained one (by relative L2 error)."""
        chained = [e for errors in self.chained.values() for e in errors]
        worst = max(chained, key=lambda e: e.rel_l2_err, default=None)
        local = self.worst_local()
        return {
            **self.block,
            "seconds": self.seconds,
            "passed": not self.failures(),
            "worst_local": dataclasses.asdict(local) if local else None,
            "worst_chained": dataclasses.asdict(worst) if worst else None,
        }


@dataclasses.dataclass
class Deployed:
    """The published model judged as a user opens it: ONNX Runtime's default session
    (``ORT_ENABLE_ALL``: its own fusions on), its outputs against the oracle by the same rule
    (docs/parity.md#judged-as-deployed).

    Attributes:
        passed: the default session loads and runs the published model, and every output passes
            the rule on every input set.
        message: what it found, one line (the worst output, or why it failed).
        sets: the input sets it ran on.
        found: what the default session did to the model before normexport repaired it (None:
            nothing was repaired).
        repairs: the exact rewrites made for ONNX Runtime (:func:`fusion.ort_forms.
            avoid_ort_misfusions`): the ONNX Runtime issue each avoids -> nodes rewritten (in
            the raw model and the output together; tried, where none was kept).
        repaired: the model they were kept in: ``"raw"`` (the raw model, before the passes: the
            reference, the passes, the latency and the output all start from it) or
            ``"output"`` (the published output); None where none was kept.
    """

    passed: bool
    message: str
    sets: list[str]
    found: str | None = None
    repairs: dict[str, int] = dataclasses.field(default_factory=dict)
    repaired: str | None = None


@dataclasses.dataclass
class ParityResult:
    """The parity verdict over all input sets.

    Attributes:
        reference: where the reference comes from: ``"pytorch"`` or ``"onnx"``.
        atol, rtol: the tolerances used.
        probes: input set name -> list of :class:`OutputError`, one per output.
        oracle: what the errors are measured against, e.g. ``"pytorch_float64"``,
            ``"pytorch_float32"``, ``"onnx_float64"``, ``"onnx"`` (default: ``reference``).
        noise_factor: see :data:`normexport.verdict.tolerance.NOISE_FACTOR` (None: no raw model,
            tolerance only).
        notes: why the oracle is not float64, where it is not.
        max_rel_l2: the half-precision rule's bound on relative L2 error (None: float32 rule).
        strict: a noise-ratio warning (:meth:`warnings`) fails the verdict (``--strict``).
        blocks: where the verdict was taken block by block, each block's; else None.
        deployed: the published model judged as deployed (:class:`Deployed`); None where
            that was not checked.
        oracle_float32: the nodes a float64 oracle of an ONNX graph runs in float32, by op
            type: ``op_type``, ``domain``, ``nodes`` (their names), ``why``.
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
    blocks: list[BlockVerdict] | None = None
    deployed: Deployed | None = None
    oracle_float32: list[dict] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """The verdict: every output passed the optimizer's rule on every input set, the
        export was judged nowhere to differ from PyTorch, the model runs alike as deployed
        (:attr:`deployed`, where checked), and with :attr:`strict` nothing was warned of."""
        return (
            (self.deployed is None or self.deployed.passed)
            and not self.failures()
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
        """(input set, error) for every output that failed the optimizer's rule, and (where,
        error) for every value of a block that did (:meth:`BlockVerdict.failures`)."""
        found = self._where(lambda e: not e.passed)
        return found + [f for block in self.blocks or () for f in block.failures()]

    def worst_block(self) -> BlockVerdict | None:
        """The block whose optimized model strays furthest from the oracle's when fed the
        oracle's inputs (the largest relative L2 error); None where there are no blocks."""
        found = [b for b in self.blocks or () if b.worst_local() is not None]
        return max(found, key=lambda b: b.worst_local().rel_l2_err, default=None)

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
            "oracle_float32": list(self.oracle_float32),
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
            "blocks": [b.to_dict() for b in self.blocks] if self.blocks is not None else None,
            "worst_block": self.worst_block().block["index"] if self.worst_block() else None,
            "deployed": dataclasses.asdict(self.deployed) if self.deployed else None,
        }
