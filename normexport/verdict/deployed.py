"""A model judged as deployed (the raw model before the passes, the published output): its
outputs in ONNX Runtime's default session (``ORT_ENABLE_ALL``, ONNX Runtime's own graph fusions
on) against the oracle, by the same rule as parity (:func:`judged`); why and what it found:
docs/parity.md#judged-as-deployed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from normexport import runtime
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Judge
from normexport.verdict.rollback import RuntimeFailed, diverged, opened

#: The session level judged: what ``ort.InferenceSession(path)`` runs by default.
LEVEL = "ORT_ENABLE_ALL"


class Deployment(NamedTuple):
    """What :func:`judged` found.

    Attributes:
        passed: the default session computes the same function (every output within the rule
            on every input set).
        message: the worst output's error against its tolerance, which outputs diverge, or ONNX
            Runtime's refusal, in one line.
        runs: the default session loaded the model and ran it on every input set (False: ONNX
            Runtime refused it, as its message says).
    """

    passed: bool
    message: str
    runs: bool


def judged(
    path: Path, provider: str, judge: Judge, rule: str, disabled: Sequence[str] = ()
) -> Deployment:
    """Whether the model at ``path`` runs in ONNX Runtime's default session (:data:`LEVEL`,
    ``disabled``: the ORT optimizers autotune turned off) as parity says it runs as written:
    every output within ``judge``'s rule (``rule``: ``"fp32"``, ``"fp16"``, ``"bf16"``) against
    the oracle on every input set. One session (:func:`normexport.runtime.deployed_session`,
    opened by :func:`normexport.verdict.rollback.opened`), opened once ``judge``'s references
    have run and been freed.

    Raises:
        normexport.runtime.ProviderUnavailable: the provider does not load.
    """
    name = runtime.PROVIDERS[provider][0]
    candidate = opened(runtime.deployed_session, provider, disabled_optimizers=disabled)
    try:
        verdict = judge(path, candidate, precision=rule)
    except RuntimeFailed as err:
        return Deployment(False, f"{name} {LEVEL} cannot {err.doing} it: {err}", False)
    except ValueError as err:  # other outputs (count or shapes) than the oracle's
        return Deployment(False, f"{name} {LEVEL} computes other outputs: {err}", True)
    rejection = diverged(verdict)
    if rejection is not None:
        message = f"{name} {LEVEL} computes another function: {rejection.message}"
        return Deployment(False, message, True)
    return Deployment(True, f"{name} {LEVEL} computes the same function: {_worst(verdict)}", True)


def _worst(verdict: ParityResult) -> str:
    """The output with the largest max abs error, in a few words."""
    worst = verdict.worst()
    if not worst:
        return "no outputs"
    e = max(worst.values(), key=lambda e: e.max_abs_err)
    return f"output {e.output!r} max abs err {e.max_abs_err:.3g} (max |oracle| {e.max_abs_ref:.3g})"
