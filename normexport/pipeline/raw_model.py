"""The raw model stage (the report's ``reference`` stage begins with it): the model the output
is compared with and rebuilt from, on file: the input itself for ONNX input (loaded as written,
run once on the example inputs, checked), else the raw export saved into the scratch folder.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from normexport import runtime
from normexport.errors import InputFileError, RunTimedOut, UsageError, one_line
from normexport.io import files
from normexport.pipeline.job import Job
from normexport.verdict.checker_levels import checker_level
from normexport.verdict.parity import Recorded


@dataclasses.dataclass(frozen=True)
class RawModel:
    """The raw model on file: what the output is compared with and rebuilt from.

    Attributes:
        path: the input file (ONNX input) or the raw export saved in the scratch folder.
        runs: it, run as written (:func:`normexport.runtime.check_session`, opened on demand,
            its outputs recorded per input set; ``runs.close()`` frees its session).
        checker: how far the ONNX checker accepts it, and its complaint
            (:func:`normexport.verdict.checker_levels.checker_level`; ``("full", None)`` for
            an export).
    """

    path: Path
    runs: Recorded
    checker: tuple[str, str | None] = ("full", None)


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
