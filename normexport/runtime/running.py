"""Running a session: :func:`run` (with the run-time limit of :func:`run_timeout`) and
:func:`message`, ONNX Runtime's error in a few words."""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
from collections.abc import Iterator, Mapping

import numpy as np
import onnxruntime as ort

from normexport import progress
from normexport.errors import RunTimedOut

#: ONNX Runtime's usual statuses, each with what it means for the user's model (the regex
#: on the status without its prefix, and the sentence, ``{}`` fields filled from its groups).
MEANINGS = (
    (
        r"Got invalid dimensions for input: (\S+) for the following indices index: (\d+) "
        r"Got: (\d+) Expected: (\d+).*",
        "input {0}: axis {1} is {2} here, but the model fixes it at {3}",
    ),
    (
        r"Invalid rank for input: (\S+) Got: (\d+) Expected: (\d+).*",
        "input {0} has {1} axes here, but the model takes {2}",
    ),
    (
        r"Unexpected input data type\. Actual: \((\S+)\) , expected: \((\S+)\)",
        "an input is {0} here, but the model takes {1}",
    ),
    (
        r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'",
        "ONNX Runtime has no kernel for {0} (opset {1}) with these input types on this "
        "provider (node '{2}')",
    ),
)


def message(err: BaseException) -> str:
    """ONNX Runtime's error ``err`` in a few words: its status message without the
    ``[ONNXRuntimeError] : 2 : INVALID_ARGUMENT :`` prefix, in the words of :data:`MEANINGS`
    where it is one of the usual ones, and for a node that failed to run, ``OpType: message``
    (the node's name is of the session's model, not the user's)."""
    text = " ".join(str(err).split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    for pattern, meaning in MEANINGS:
        if found := re.fullmatch(pattern, text):
            return meaning.format(*found.groups()).replace(" (node '')", "")
    node = re.search(r"running (\S+) node\. Name:'[^']*' Status Message: (.*)", text)
    return f"{node[1]}: {node[2]}" if node else text


_run_timeout: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "normexport_run_timeout", default=None
)


@contextlib.contextmanager
def run_timeout(seconds: float | None) -> Iterator[None]:
    """Within the block, every :func:`run` is cancelled after ``seconds`` (None: no limit)."""
    token = _run_timeout.set(seconds)
    try:
        yield
    finally:
        _run_timeout.reset(token)


def run(
    session: ort.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    *,
    quiet: bool = False,
    kept: bool = False,
) -> list[np.ndarray]:
    """Run ``session`` on ``feeds`` (input name -> array) and return its outputs in order;
    ``quiet``: ONNX Runtime logs nothing of a failure (the caller reports it); ``kept``: the
    outputs are copies that own their memory, for outputs kept after the session is freed
    (ONNX Runtime's outputs live in the session's memory arena and keep the whole arena
    alive: 0.4 GiB per session on a 0.6 GB float16 model). Within :func:`run_timeout`, a run
    past the limit is cancelled (``RunOptions.terminate``, set by a timer thread).

    Raises:
        normexport.errors.RunTimedOut: the run went past the limit of :func:`run_timeout`.
    """
    options = ort.RunOptions()
    if quiet:
        options.log_severity_level = 4  # fatal only
    limit = _run_timeout.get()
    timer = threading.Timer(limit, setattr, (options, "terminate", True)) if limit else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        outputs = session.run(None, dict(feeds), options)
    except Exception:
        if timer is not None and options.terminate:
            where = progress.where()
            at = f" ({where})" if where else ""
            raise RunTimedOut(
                f"an ONNX Runtime run of the model went past --run-timeout {limit:g} s{at} and "
                "was cancelled: a graph that runs this long (a Loop of very many iterations?) "
                "is not one normexport can check; give a larger --run-timeout if it is expected"
            ) from None
        raise
    finally:
        if timer is not None:
            timer.cancel()
    return [np.array(o, copy=True) for o in outputs] if kept else outputs
