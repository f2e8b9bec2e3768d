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

import onnx_ir as ir

from fusion.ort_forms import ISSUES, avoid_ort_misfusions
from normexport import progress, runtime
from normexport.errors import InputFileError, RunTimedOut, UsageError, one_line
from normexport.io import files
from normexport.pipeline.job import Job, larger
from normexport.verdict import block_parity, deployed
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


def raw_model(
    job: Job, raw: ir.Model, work: Path, block_bytes: int | None = None
) -> tuple[RawModel, Job]:
    """The raw model on file (:class:`RawModel`): for ONNX input the input itself (loaded
    as written, run once on the example, checked; its session freed), else the raw export
    saved into ``work``; and the job, with larger example inputs where the model refused the
    sizes normexport picked (:func:`_runs`). ``block_bytes``: the memory plan's, where its
    whole run does not fit: the input runs block by block
    (:func:`normexport.verdict.block_parity.chained`), its whole session only opened.

    Raises:
        InputFileError: ONNX Runtime cannot load the input file.
        UsageError: ONNX Runtime cannot run the input file as given (at any size tried).
    """
    if job.loaded.kind != "onnx":
        path = work / "raw.onnx"
        files.save_model(raw, path, external_data=True)
        return RawModel(path, _recorded(runtime.OnDemand(path, job.provider))), job
    path = Path(job.opts.model)
    session = runtime.OnDemand(path, job.provider)
    _opens(session, path)
    recorded = _recorded(session)
    chain = block_parity.chained(path, block_bytes, job.provider) if block_bytes else None
    if chain is not None:
        session.close()
        recorded = Recorded(chain)
    try:
        job = _runs(job, recorded, path, raw)
    finally:
        recorded.close()
    return RawModel(path, recorded, checker_level(path)), job


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


def _hint(job: Job) -> str:
    """What to check where the input file fails on the example inputs: the inputs the user
    gave, the sizes normexport picked (all tried), the ``--dim`` sizes, or, where every size is
    the file's, its inputs or the file itself."""
    opts = job.opts
    if opts.inputs:
        return "check --inputs against the model's inputs"
    if job.sizing is not None and job.sizing.picked:
        return (
            f"normexport picked the sizes and tried {job.sizing.tried()}: give the sizes it "
            f"takes ({job.sizing.flags()}), or real inputs with --inputs FILE.npz"
            + ("; check that the --dim sizes agree with one another" if opts.dim else "")
        )
    if opts.input_shape:
        return "check --input-shape against the model's inputs"
    if getattr(opts, "dim", None):
        return (
            "check the --dim sizes: the model may need them to agree with one another (a mask "
            "over the past and the new tokens has as many positions as the two together) or "
            "to be larger (a window, a kernel)"
        )
    return (
        "where it runs on real inputs, give them with --inputs FILE.npz; else fix or re-export it"
    )


def _runs(job: Job, raw: Recorded, path: Path, model: ir.Model) -> Job:
    """Run the input file on the example inputs, before anything is optimized: a model that
    ONNX Runtime loads but cannot run (an invalid node, inputs of the wrong shape) is the
    user's to fix, not a parity failure. Where it refuses the sizes normexport picked (a
    window, a kernel longer than them), the next larger ones are tried (on the live display:
    :func:`normexport.pipeline.job.larger`), until one runs or none is left.

    Returns:
        ``job``, with the example and input sets of the sizes that ran.

    Raises:
        UsageError: ONNX Runtime fails on every example tried, naming the inputs that were
            given and what to check (:func:`_hint`).
    """
    while True:
        try:
            raw(job.sets["example"])  # the failure is reported once, by us
            return job
        except RunTimedOut as err:  # said as it is: the model ran, too long
            raise RunTimedOut(f"{path}: {err}") from None
        except Exception as err:  # ORT's own error types
            error = one_line(err)
        bigger = larger(job, model)
        if bigger is None:
            feeds = job.sets["example"]
            shapes = " ".join(
                f"{k}={'x'.join(map(str, v.shape))}:{v.dtype}" for k, v in feeds.items()
            )
            given = "at the largest sizes tried" if job.sizing and job.sizing.at else "as given"
            raise UsageError(
                f"{path}: ONNX Runtime cannot run this model {given} on inputs {shapes} "
                f"({error}); {_hint(job)}"
            ) from None
        grown = job.sizing.grown()  # on the live display only: stderr holds errors alone
        refused, tried = _sizes(job.sizing.picked, grown), _sizes(bigger.sizing.picked, grown)
        progress.step(f"{refused} refused: trying {tried}")
        job = bigger


def _sizes(picked: dict[str, int], keys: list[str]) -> str:
    return ", ".join(f"{k}={picked[k]}" for k in keys)
