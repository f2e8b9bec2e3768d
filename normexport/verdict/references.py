"""What the optimized model is judged against: the oracle's choice, the raw model, PyTorch
float32, each run once per input set however many candidates are compared with them.

For ONNX input the oracle is the input graph in float64 (:func:`normexport.verdict.oracle.
onnx_float64`), else the input file as written (tolerance only). For a PyTorch model it is the
model in float64, else the raw export in float64, else PyTorch float32, with every reason in
the notes (:mod:`normexport.verdict.oracle`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from normexport import progress
from normexport.io.eager import Eager
from normexport.io.load import LoadedModel
from normexport.precision import rounded_feeds
from normexport.precision.int8 import INT8_PRECISIONS
from normexport.runtime.memory import give_back
from normexport.verdict import block_parity
from normexport.verdict.oracle import Oracle, onnx_float64, pytorch_float64
from normexport.verdict.parity import (
    HALF_MAX_REL_L2,
    INT8_MIN_TOP1,
    ParityResult,
    Recorded,
    check_parity,
    ulp_perturbed,
)

Run = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]

#: The oracle's note where the memory plan has no room for a float64 run.
NO_ROOM = "no float64 oracle: its run's activations do not fit in memory (the memory plan)"


#: ``open(model, folder)``: opens the candidate model as it runs (its ONNX Runtime session):
#: its file (``folder`` None), or one block of it as a serialized graph whose tensors lie in
#: the external data file in ``folder``; returns how to run it and its output names. Called
#: once per verdict (once per block), after the references have run and been freed.
Candidate = Callable[[Path | bytes, Path | None], tuple[Run, Sequence[str]]]


class Judge:
    """Judges candidate runs by :func:`normexport.verdict.parity.check_parity` against one run's
    references (:func:`references`), with one model's weights in memory at a time: each
    reference runs on every input set it will be asked for (and is freed) before the candidate
    opens, and its outputs are kept for every later candidate (docs/memory.md).

    Args:
        loaded: the model as loaded (its PyTorch module, where it has one, is a reference).
        raw: the raw model (the input file, or the raw export) run as written: a
            :class:`~normexport.verdict.parity.Recorded` whose ``close`` frees its session.
        raw_path: its file.
        sets: input set name -> feeds (graph input name -> array).
        feed_names: the graph's inputs, in the PyTorch model's ``forward()`` order.
        work: a scratch folder for the float64 copies.
        provider: ``"cpu"`` or ``"cuda"``.
        atol, rtol, strict: the tolerances and ``--strict``, as in ``check_parity``.
        rule: the precision whose rule judges a candidate unless another is asked for: the
            raw model's own (``"fp16"`` for a float16 model, whose float64 oracle keeps its
            float16 arithmetic: any rewrite moves its rounding by float16's noise).
        block_bytes: take the verdict block by block, each block holding at most this many
            bytes of weights and of values computed from them alone
            (:mod:`normexport.verdict.block_parity`; ONNX input only: a PyTorch model is in
            memory whole anyway); None: the whole model at once.
        last_position: the outputs (by index) the candidate computes at the last position of
            axis 1 only (``--last-token-logits``): the references' are compared there too.
        float64: whether a float64 oracle may be built (False: the memory plan has no room
            for its run; the reference is then the raw model or PyTorch float32, and the
            notes say why).

    Raises:
        ValueError: ``last_position`` with ``block_bytes`` (the blocks' values are compared
            whole).
    """

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        raw: Recorded,
        raw_path: Path,
        sets: dict[str, dict[str, np.ndarray]],
        feed_names: list[str],
        work: Path,
        provider: str,
        atol: float,
        rtol: float,
        strict: bool,
        rule: str = "fp32",
        block_bytes: int | None = None,
        float64: bool = True,
        last_position: tuple[int, ...] = (),
    ):
        if last_position and block_bytes is not None:
            raise ValueError("a verdict block by block compares whole outputs")
        self.loaded, self.raw, self.raw_path, self.rule = loaded, raw, raw_path, rule
        self.last_position, self.float64 = last_position, float64
        self.chains = None
        if block_bytes is not None and loaded.module is None:
            self.chains = _chains(raw_path, block_bytes, work, provider)
        self.sets, self.feed_names, self.work, self.provider = sets, feed_names, work, provider
        self.atol, self.rtol, self.strict = atol, rtol, strict
        self._references: dict | None = None
        self._rounding: dict[str, dict] = {}
        self._chain_notes: list[str] = []

    def record(self, precisions: Sequence[str] = ()) -> None:
        """Build the references where not yet built, and run each on every input set (the
        oracle also on the sets rounded by the rule of :attr:`rule` and of each of
        ``precisions``), one model at a time, freeing each before the next opens."""
        if self._references is None:
            self._references = references(self) if self.chains is None else self._by_blocks()
            _at_last_position(self._references, self.last_position)
            if self.rule != "fp32":
                self._references["notes"].append(
                    f"the model's weights are {self.rule}: judged by the {self.rule} rule"
                )
        precisions = (self.rule, *precisions)
        refs, rounded = self._references, []
        for precision in precisions:
            round_inputs = self.rounding(precision).get("round_inputs", refs.get("round_inputs"))
            if precision == "fp32" and self.chains is None:
                continue  # the one-ulp move, run where it decides (check_parity), not ahead
            for feeds in self.sets.values() if round_inputs is not None else ():
                moved = round_inputs(feeds)  # as check_parity: only where a feed moved
                changed = any(moved[k] is not feeds[k] for k in feeds)
                if changed and all(moved is not seen for seen in rounded):
                    rounded.append(moved)
        if self.chains is not None:
            self.chains.record(list(self.sets.values()), rounded)
            others = [n for n in refs["notes"] if n not in self._chain_notes]
            self._chain_notes = [self.chains.oracle_note, *self.chains.fallbacks]
            refs["notes"] = [*self._chain_notes, *others]
            return
        oracle = refs["reference"]
        oracle.record([*self.sets.values(), *rounded], f"the oracle ({refs['oracle_kind']})")
        for name, what in (("raw", "the raw model"), ("pytorch", "PyTorch float32")):
            if refs.get(name) is not None and refs[name] is not oracle:
                refs[name].record(self.sets.values(), f"{what} on every input set")

    def _by_blocks(self) -> dict:
        """:func:`check_parity`'s reference arguments where the references run block by
        block: the oracle's and the raw model's chains (recorded by :meth:`record`)."""
        chains = self.chains
        return {
            "reference": Recorded(chains.final(chains.oracle)),
            "reference_kind": "onnx",
            "raw": Recorded(chains.final(chains.raw)),
            "oracle_kind": "onnx_float64",
            "notes": [],
            "round_inputs": Recorded(ulp_perturbed),
            "oracle_float32": chains.float32,
        }

    def rounding(self, precision: str) -> dict:
        """The half-precision rule's input rounding for ``precision`` as
        :func:`check_parity`'s ``round_inputs`` (fp32: none; the references' own, the float32
        rule's one-ulp move, stands; int8: none, and the top-1 share
        :data:`~normexport.verdict.tolerance.INT8_MIN_TOP1`), one function per precision (the
        oracle's outputs on the rounded sets are recorded by their identity)."""
        if precision == "fp32":
            return {}
        if precision in INT8_PRECISIONS:  # int8 is judged by its budget, no input rounding
            return {"round_inputs": None, "min_top1": INT8_MIN_TOP1}
        if precision not in self._rounding:
            rounded = functools.partial(rounded_feeds, precision=precision)
            self._rounding[precision] = {"round_inputs": Recorded(rounded)}
        return self._rounding[precision]

    def __call__(
        self, path: Path, candidate: Candidate, precision: str | None = None
    ) -> ParityResult:
        """The verdict on the model at ``path``, opened by ``candidate``, by the rule for
        ``precision`` (``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int8-dynamic"``;
        None: :attr:`rule`); the candidate
        is opened once the references have run and been freed (block by block, where they
        ran so).

        Raises:
            ValueError: the candidate returns other outputs (count or shapes) than the
                references.
            whatever ``candidate`` raises.
        """
        precision = precision or self.rule
        self.record((precision,))
        rule = {
            "sets": self.sets,
            "atol": self.atol,
            "rtol": self.rtol,
            "max_rel_l2": HALF_MAX_REL_L2.get(precision),
            "strict": self.strict,
            **(self._references | self.rounding(precision)),
        }
        if self.chains is not None:
            verdict = self.chains.judge(path, candidate, **rule)
            give_back()
            return verdict
        run, output_names = candidate(path, None)
        progress.step("the candidate on every input set")
        got = {id(feeds): list(run(feeds)) for feeds in self.sets.values()}
        del run  # the candidate's session, handed back before the oracle may open again
        give_back()
        verdict = check_parity(lambda feeds: got[id(feeds)], output_names=output_names, **rule)
        rule["reference"].close()  # where the one-ulp move ran it again
        return verdict


def _at_last_position(refs: dict, indices: tuple[int, ...]) -> None:
    """Make the references' outputs at ``indices`` their last position of axis 1 only
    (``a[:, -1:]``), in place (a run that is two references at once stays one)."""
    if not indices:
        return
    made: dict[int, Recorded] = {}
    for key in ("reference", "raw", "pytorch"):
        run = refs.get(key)
        if run is not None and id(run) not in made:
            made[id(run)] = Recorded(functools.partial(_last, run, indices), run.close)
        if run is not None:
            refs[key] = made[id(run)]


def _last(run: Recorded, indices: tuple[int, ...], feeds) -> list[np.ndarray]:
    """``run``'s outputs on ``feeds``, those at ``indices`` at their last position of axis 1."""
    outputs = list(run(feeds))
    return [np.ascontiguousarray(a[:, -1:]) if i in indices else a for i, a in enumerate(outputs)]


def _chains(raw_path: Path, block_bytes: int, work: Path, provider: str):
    """:class:`block_parity.Chains` of the model, or None where it cannot be cut (its parity then
    runs whole, its sessions reading their weights from disk on every run)."""
    try:
        return block_parity.Chains(raw_path, block_bytes, work, provider)
    except ValueError:
        return None


def references(judge: Judge) -> dict:
    """:func:`check_parity`'s reference arguments: the oracle (``reference``), the raw model
    where it is not the oracle itself, PyTorch float32 where it is not, the notes, and which
    float32 run the export check judges (``judge_export``; None for ONNX input). Each model is
    a :class:`~normexport.verdict.parity.Recorded` run (once per input set however many
    candidates are compared with it), the oracle on inputs moved by one ulp too (the float32
    rule's ``round_inputs``, :func:`normexport.verdict.parity.ulp_perturbed`)."""
    raw, example = judge.raw, judge.sets["example"]
    if judge.loaded.module is None:
        found = (
            onnx_float64(judge.raw_path, raw, example, judge.work, "the input graph")
            if judge.float64
            else Oracle(None, "", [NO_ROOM])
        )
        if found.run is None:  # compared with the input file itself, tolerance only
            notes = [*found.notes, "the reference is the input file as written, in float32"]
            return dict(reference=raw, reference_kind="onnx", oracle_kind="onnx", notes=notes)
        return {
            "reference": Recorded(found.run, found.close),
            "reference_kind": "onnx",
            "raw": raw,
            "oracle_kind": found.kind,
            "notes": found.notes,
            "round_inputs": Recorded(ulp_perturbed),
            "oracle_float32": found.float32,
        }
    eager = Eager(judge.loaded.module)
    pytorch = Recorded(lambda feeds: eager([feeds[n] for n in judge.feed_names]))
    found = _pytorch_oracle(judge, raw)
    return {
        "reference": Recorded(found.run, found.close) if found.run else pytorch,
        "reference_kind": "pytorch",
        "raw": raw,
        "pytorch": pytorch if found.run else None,
        "oracle_kind": found.kind,
        "notes": found.notes,
        # the oracle from the raw export judges PyTorch float32, any other the raw export
        "judge_export": "pytorch" if found.kind.startswith("onnx") else "raw",
        "round_inputs": Recorded(ulp_perturbed),
        "oracle_float32": found.float32,
    }


def _pytorch_oracle(judge: Judge, raw: Run) -> Oracle:
    """The PyTorch model in float64; where that cannot run, the raw export in float64; where
    neither can, None (PyTorch float32 is the reference), with every reason in the notes."""
    example = judge.sets["example"]
    if not judge.float64:
        return Oracle(None, "pytorch_float32", [NO_ROOM, "the reference is PyTorch float32"])
    found = pytorch_float64(judge.loaded, example, judge.feed_names)
    if found.run is not None:
        return found
    export = onnx_float64(judge.raw_path, raw, example, judge.work, "the raw export")
    export.notes[:0] = found.notes  # the same list: what the runs add later is said too
    if export.run is None:
        export.notes.append("the reference is PyTorch float32")
        return Oracle(None, "pytorch_float32", export.notes)
    return export
