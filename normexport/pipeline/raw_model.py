"""The raw model stage (the report's ``reference`` stage begins with it): the model the output
is compared with and rebuilt from, on file: the input itself for ONNX input (loaded as written,
run once on the example inputs, checked), else the raw export saved into the scratch folder;
judged as deployed and, where ONNX Runtime's own fusions misread it, repaired into exact forms
(:func:`as_deployed`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from fusion.ort_forms import ISSUES, avoid_ort_misfusions
from normexport import progress, runtime
from normexport.errors import InputFileError, RunTimedOut, UsageError, one_line
from normexport.io import files
from normexport.pipeline.job import Job
from normexport.verdict import deployed
from normexport.verdict.checker_levels import checker_level
from normexport.verdict.parity import Recorded
from normexport.verdict.references import Judge


@dataclasses.dataclass(frozen=True)
class RawModel:
    """The raw model on file: what the output is compared with and rebuilt from.

    Attributes:
        path: the input file (ONNX input) or the raw export saved in the scratch folder; where
            it was repaired for ONNX Runtime (:func:`as_deployed`), its repaired form there.
        runs: it, run as written (:func:`normexport.runtime.check_session`, opened on demand,
            its outputs recorded per input set; ``runs.close()`` frees its session).
        checker: how far the ONNX checker accepts it, and its complaint
            (:func:`normexport.verdict.checker_levels.checker_level`; ``("full", None)`` for
            an export).
        found: where it was repaired for ONNX Runtime (:func:`as_deployed`), what the
            default session did to it as it was; else None.
        repairs: those repairs: the ONNX Runtime issue each avoids -> nodes rewritten.
    """

    path: Path
    runs: Recorded
    checker: tuple[str, str | None] = ("full", None)
    found: str | None = None
    repairs: dict[str, int] = dataclasses.field(default_factory=dict)


def raw_model(job: Job, raw: ir.Model, work: Path) -> RawModel:
    """The raw model on file (:class:`RawModel`): for ONNX input the input itself (loaded
    as written, run once on the example, checked; its session freed), else the raw export
    saved into ``work``.

    Raises:
        InputFileError: ONNX Runtime cannot load the input file.
        UsageError: ONNX Runtime cannot run the input file as given.
    """
    if job.loaded.kind != "onnx":
        path = work / "raw.onnx"
        files.save_model(raw, path, external_data=True)
        return RawModel(path, _recorded(runtime.OnDemand(path, job.provider)))
    path = Path(job.opts.model)
    session = runtime.OnDemand(path, job.provider)
    _opens(session, path)
    recorded = _recorded(session)
    try:
        _runs_as_given(recorded, job.sets["example"], path, _hint(job.opts))
    finally:
        recorded.close()
    return RawModel(path, recorded, checker_level(path))


def as_deployed(job: Job, raw: ir.Model, ref: RawModel, judge: Judge, work: Path) -> RawModel:
    """The raw model ``ref`` judged as deployed (:func:`normexport.verdict.deployed.judged`, by
    its own rule) before the passes; where ONNX Runtime's default session fails it, ``raw``
    rewritten in place into the exact forms its fusions do not misread (:func:`for_ort`: the
    passes then start from them), saved into ``work`` and judged again. Where that model loads
    and runs as deployed, its :class:`RawModel` (what the default session did to the model as
    it was, and the repairs), so that the rollback's rebuilds, the latency stage and the output
    all start from a model that ONNX Runtime loads; its outputs as written are the same, bit for
    bit, as those recorded. Else ``ref``, where it loads and runs as deployed (another function
    there is the published output's verdict to find). docs/parity.md#judged-as-deployed.

    Raises:
        InputFileError: ONNX Runtime's default session cannot load or run the raw model, and
            no known bug of its fusions explains it (or the exact forms did not help).
    """
    progress.step(f"the raw model as deployed ({deployed.LEVEL})")
    found = deployed.judged(ref.path, job.provider, judge, job.computes_in)
    if found.passed:
        return ref
    repairs = for_ort(raw)
    if repairs:
        path = work / "raw-ort" / ref.path.name
        path.parent.mkdir()
        files.save_model(raw, path, external_data=job.external)
        again = deployed.judged(path, job.provider, judge, job.computes_in)
        if again.runs:
            return dataclasses.replace(ref, path=path, found=found.message, repairs=repairs)
        found = again
    if found.runs:
        return ref
    what = "this model" if job.loaded.kind == "onnx" else "its ONNX export"
    why = (
        f"the exact forms for {', '.join(repairs)} did not help"
        if repairs
        else "no known bug of ONNX Runtime's fusions explains it (docs/parity.md)"
    )
    raise InputFileError(
        f"{job.opts.model}: ONNX Runtime's default session fails {what}: {found.message}; "
        f"it runs with graph optimizations off, and {why}: report it to ONNX Runtime, or "
        "fix or re-export the model"
    )


def for_ort(model: ir.Model) -> dict[str, int]:
    """:func:`fusion.ort_forms.avoid_ort_misfusions` of ``model`` (in place): the ONNX Runtime
    issue each rewrite avoids -> the nodes it rewrote (those that rewrote any)."""
    return {ISSUES[key]: n for key, n in avoid_ort_misfusions(model).items()}


def _recorded(session: runtime.OnDemand) -> Recorded:
    """The model of ``session`` run as written, its outputs recorded; ``close()`` frees it."""
    run = functools.partial(runtime.run, quiet=True, kept=True)
    return Recorded(lambda feeds: run(session.open(), feeds), session.close)


def _opens(session: runtime.OnDemand, path: Path) -> None:
    """Open the input file's session: a file ONNX Runtime cannot load is the user's to fix.

    Raises:
        InputFileError: ONNX Runtime cannot load ``path``.
    """
    try:
        session.open()
    except runtime.ProviderUnavailable:
        raise
    except Exception as err:  # ORT raises its own error types for a bad file
        raise InputFileError(
            f"{path}: ONNX Runtime cannot load this model ({one_line(err)}); normexport "
            "optimizes models that ONNX Runtime runs: fix or re-export it"
        ) from None


def _hint(opts: Any) -> str:
    """What to check where the input file fails on the example inputs: the inputs the user
    gave, the sizes of the symbolic axes, or the file itself."""
    if opts.input_shape or opts.inputs:
        return "check --input-shape / --inputs against the model's inputs"
    if getattr(opts, "dim", None):
        return (
            "check that the --dim sizes agree with one another (a mask over the past and the "
            "new tokens has as many positions as the two together)"
        )
    return "fix or re-export it"


def _runs_as_given(raw: Recorded, feeds: dict[str, np.ndarray], path: Path, hint: str) -> None:
    """Run the input file once on the example inputs, before anything is optimized: a model
    that ONNX Runtime loads but cannot run (an invalid node, inputs of the wrong shape) is the
    user's to fix, not a parity failure. ``hint``: what to check (:func:`_hint`).

    Raises:
        UsageError: ONNX Runtime fails on it, naming the inputs that were given.
    """
    try:
        raw(feeds)  # the failure is reported once, by us
    except RunTimedOut as err:  # said as it is: the model ran, too long
        raise RunTimedOut(f"{path}: {err}") from None
    except Exception as err:  # ORT's own error types
        shapes = " ".join(f"{k}={'x'.join(map(str, v.shape))}:{v.dtype}" for k, v in feeds.items())
        raise UsageError(
            f"{path}: ONNX Runtime cannot run this model as given on inputs {shapes} "
            f"({one_line(err)}); {hint}"
        ) from None
