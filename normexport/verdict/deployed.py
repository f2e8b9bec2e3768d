"""The published model judged as deployed: its outputs in ONNX Runtime's default session
(``ORT_ENABLE_ALL``, ONNX Runtime's own graph fusions on) against the oracle, by the same rule
as parity (:func:`judged`); why and what it found: docs/parity.md#judged-as-deployed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from normexport import precision, runtime
from normexport.runtime.sessions import FP16_INITIALIZERS_TO_FP32
from normexport.verdict.parity import ParityResult
from normexport.verdict.references import Judge
from normexport.verdict.rollback import diverged

#: The session level judged: what ``ort.InferenceSession(path)`` runs by default.
LEVEL = "ORT_ENABLE_ALL"


class _Failed(Exception):
    """ONNX Runtime failed to load or run the model in its default session (what it said)."""


def judged(
    path: Path, provider: str, judge: Judge, rule: str, disabled: Sequence[str] = ()
) -> tuple[bool, str]:
    """Whether the model at ``path`` runs in ONNX Runtime's default session (:data:`LEVEL`,
    ``disabled``: the ORT optimizers autotune turned off) as parity says it runs as written:
    every output within ``judge``'s rule (``rule``: ``"fp32"``, ``"fp16"``, ``"bf16"``) against
    the oracle on every input set. One session, opened once ``judge``'s references have run and
    been freed; its weights mapped, not prepacked, float16 initializers not widened, CUDA's
    float32 products in float32 (:func:`normexport.runtime.check_session`'s reasons), none of
    which moves its graph.

    Returns:
        ``(passed, message)``: the message says the worst output's error against its tolerance,
        which outputs diverge, or ONNX Runtime's refusal, in one line.

    Raises:
        normexport.runtime.ProviderUnavailable: the provider does not load.
    """
    name = runtime.PROVIDERS[provider][0]

    def candidate(model, folder):
        try:
            session = runtime.make_session(
                model,
                provider,
                spinning=False,
                quiet=True,
                prepacking=False,
                tf32=False,
                disabled_optimizers=[FP16_INITIALIZERS_TO_FP32, *disabled],
                external_data_folder=folder,
            )
        except runtime.ProviderUnavailable:
            raise
        except Exception as err:  # ORT's own error types
            raise _Failed(f"{name} {LEVEL} cannot load it: {runtime.message(err)}") from None

        def run(feeds):
            try:
                return runtime.run(session, precision.cast_feeds(session, feeds), quiet=True)
            except Exception as err:  # ORT's own error types
                raise _Failed(f"{name} {LEVEL} cannot run it: {runtime.message(err)}") from None

        return run, [o.name for o in session.get_outputs()]

    try:
        verdict = judge(path, candidate, precision=rule)
    except _Failed as err:
        return False, str(err)
    except ValueError as err:  # other outputs (count or shapes) than the oracle's
        return False, f"{name} {LEVEL} computes other outputs: {err}"
    rejection = diverged(verdict)
    if rejection is not None:
        return False, f"{name} {LEVEL} computes another function: {rejection.message}"
    return True, f"{name} {LEVEL} computes the same function: {_worst(verdict)}"


def _worst(verdict: ParityResult) -> str:
    """The output with the largest max abs error, in a few words."""
    worst = verdict.worst()
    if not worst:
        return "no outputs"
    e = max(worst.values(), key=lambda e: e.max_abs_err)
    return f"output {e.output!r} max abs err {e.max_abs_err:.3g} (max |oracle| {e.max_abs_ref:.3g})"
