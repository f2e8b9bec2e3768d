"""Keep the libraries' own prints, warnings and log lines off the user's terminal.

The exporters, optimizers and loaders that normexport calls report progress and failures in
their own words; normexport reports what matters in one line of its own (see
:mod:`normexport.errors`). Four context managers, each undoing what it changed on exit:

- :func:`quiet`: named loggers raised to ERROR, warnings ignored;
- :func:`quiet_torch`: torch's loggers, whose errors it collects;
- :func:`logs_for_debug`: the command line's whole run: every library's log records and
  warnings shown only with ``--debug``;
- :func:`swallow_prints`: ``sys.stdout`` / ``sys.stderr`` swapped for a buffer. That is the
  process's streams, for every thread, while the block runs; it is for the libraries that
  ``print()`` with no switch to stop them, and used only around those (each use says which).
  Where a library has a switch (``torch.onnx.export(verbose=False)``), the switch is used.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings


@contextlib.contextmanager
def quiet(*loggers: str):
    """Raise the named loggers to ERROR and ignore warnings inside the block; the levels and
    the warning filters are put back afterwards. Nothing printed is touched: see
    :func:`swallow_prints`."""
    saved = [(logger, logger.level) for logger in map(logging.getLogger, loggers)]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


@contextlib.contextmanager
def swallow_prints(*streams: str):
    """Swallow what is printed to the named streams (``"stdout"``, ``"stderr"``) inside the
    block, by swapping ``sys.stdout`` / ``sys.stderr`` for a buffer until it ends.

    The swap is process-wide while it lasts (another thread's prints are swallowed too), so it
    is only for code that prints with no switch to stop it, such as torch.export's partial
    graph of a failed trace or ONNX Runtime's transformer optimizer.

    Raises:
        ValueError: a stream is neither ``"stdout"`` nor ``"stderr"``.
    """
    redirect = {"stdout": contextlib.redirect_stdout, "stderr": contextlib.redirect_stderr}
    unknown = set(streams) - set(redirect)
    if unknown:
        raise ValueError(f"streams {sorted(unknown)}: expected 'stdout' or 'stderr'")
    with contextlib.ExitStack() as stack:
        for stream in streams:
            stack.enter_context(redirect[stream](io.StringIO()))
        yield


@contextlib.contextmanager
def quiet_torch():
    """Keep torch's warnings and log lines from the user; yields the errors they carried.

    torch's loggers print through their own handlers and do not propagate, so each one that
    prints is given a collecting handler for the duration.
    """
    errors: list[BaseException] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                errors.append(record.exc_info[1])

    collect = Collect()
    saved = {}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (
            isinstance(logger, logging.Logger)
            and (name == "torch" or name.startswith("torch."))
            and (logger.handlers or not logger.propagate)
        ):
            saved[logger] = logger.handlers
            logger.handlers = [collect]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield errors
    finally:
        for logger, handlers in saved.items():
            logger.handlers = handlers


@contextlib.contextmanager
def logs_for_debug(debug: bool, stream=None):
    """For the command line's run: every log record that reaches the root logger (the
    libraries' warnings and logged exceptions, onnx-ir's shape inference and onnxscript's
    rewriter among them) and every Python warning (through ``logging.captureWarnings``) go to
    ``stream`` (default ``sys.stderr``) with their tracebacks where ``debug``, and nowhere
    otherwise: Python's last-resort handler, which prints them on stderr when no handler is set,
    is not reached. What matters to the user normexport says in a line of its own. Put back
    on exit; the Python API does not call it (a library leaves logging to its caller)."""
    root = logging.getLogger()
    handler: logging.Handler
    if debug:
        handler = logging.StreamHandler(sys.stderr if stream is None else stream)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler = logging.NullHandler()
    root.addHandler(handler)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
