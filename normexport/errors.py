"""Errors that the command line turns into one clear line and an exit code: the one place
where the kinds of user-facing error are named (one class each) and the exit codes too
(``EXIT_*``, which :mod:`normexport.cli` and :mod:`normexport.bench.command` return).

- :class:`UsageError` (exit 2) and its kinds: :class:`InputFileError` (the model file, or a
  file it needs, cannot be used), :class:`OutputPathError` (an output cannot be written
  there) and :class:`EnvironmentProblem` (this machine lacks something asked for, such as a
  CUDA provider that loads). The message names the file, node or option and the fix.
- :class:`Interrupted` (exit 130 for SIGINT, 143 for SIGTERM): the run was stopped by a
  signal; ``finally`` blocks have run, so no temporary file is left.
- anything else (exit 3): an exception nobody anticipated, a bug; ``--debug`` shows it.
"""

from __future__ import annotations

import re
import signal

#: Exit codes, defined here once (``docs/errors.md`` gives the same numbers): the run went
#: well; parity failed (the model is still written); a :class:`UsageError`; a bug.
EXIT_OK, EXIT_PARITY_FAILED, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3
#: A run stopped by a signal exits with this plus the signal's number (130 SIGINT, 143 SIGTERM).
EXIT_SIGNAL_BASE = 128


def one_line(err: BaseException) -> str:
    """``Type: first line`` of the error at the root of ``err``'s causes, colour codes removed:
    what a user-facing message quotes of an exception. Wrappers such as torch.onnx's "Failed to
    export ... step 1/3" say nothing of the model in their own first line; their cause does."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()
    first = text[0].strip() if text else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


class UsageError(Exception):
    """A user mistake (bad file, bad option, missing flag): exit code 2, no traceback.

    The message names the file, node or option and says how to fix it.
    """


class InputFileError(UsageError):
    """The model file, or a file it needs (external data, ``--inputs``), cannot be used."""


class OutputPathError(UsageError):
    """An output (``-o``, ``--report``, ``--json``, ``--chart``) cannot be written there."""


class EnvironmentProblem(UsageError):
    """This machine lacks what was asked for (a CUDA provider that loads)."""


class RunTimedOut(UsageError):
    """An ONNX Runtime run of the model went past ``--run-timeout`` and was cancelled (a graph
    that runs for ever, a Loop of 2**62 iterations, is the file's, not a bug): exit 2."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; raised from the signal handler that :func:`on_signals`
    installs. A KeyboardInterrupt, so that ``except Exception`` never swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """:data:`EXIT_SIGNAL_BASE` plus the signal's number: 130 for SIGINT, 143 for SIGTERM."""
        return EXIT_SIGNAL_BASE + self.signum


#: The first signal received while :func:`on_signals` was in force, else None.
_received: int | None = None


def received_signal() -> int | None:
    """The signal that interrupted this run, if one did."""
    return _received


def raise_if_interrupted() -> None:
    """Re-raise the interrupt when a signal arrived: for handlers of ``Exception`` that may
    be looking at what an interrupt turned into (a KeyboardInterrupt inside a lazy import
    leaves a half-initialized module, and the caller sees an AttributeError)."""
    if _received is not None:
        raise Interrupted(_received)


def _handler(signum, frame):
    global _received
    if _received is None:  # the first one stops the run; later ones let the clean-up finish
        _received = signum
        raise Interrupted(signum)


class on_signals:  # noqa: N801 (used as a context manager, reads as one)
    """Within the block, SIGINT and SIGTERM raise :class:`Interrupted` (so ``finally`` blocks
    run and temporary files are removed); the previous handlers come back afterwards.
    Only in the main thread (Python delivers signals there)."""

    def __enter__(self):
        global _received
        _received = None
        self._saved = {}
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._saved[signum] = signal.signal(signum, _handler)
        except ValueError:  # not the main thread: leave the handlers as they are
            pass
        return self

    def __exit__(self, *exc):
        global _received
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        _received = None  # a library call after the run is not interrupted by this one
        return False


def exit_status(err: BaseException) -> tuple[int, str]:
    """The exit code for ``err`` and the one line that says it (without a traceback)."""
    signum = received_signal()
    if isinstance(err, KeyboardInterrupt) or signum is not None:
        stop = err if isinstance(err, Interrupted) else Interrupted(signum or signal.SIGINT)
        name = signal.Signals(stop.signum).name
        return stop.exit_code, f"normexport: interrupted ({name}); temporary files removed"
    if isinstance(err, UsageError):
        return EXIT_USAGE, f"normexport: error: {err}"
    return EXIT_BUG, (
        f"normexport: internal error: {type(err).__name__}: {err}\n"
        "This is a bug in normexport; re-run with --debug and report the traceback."
    )
