"""Keep the libraries' own prints, warnings and log lines off the user's terminal.

The exporters, optimizers and loaders that normexport calls report progress and failures in
their own words; normexport reports what matters in one line of its own (see
:mod:`normexport.errors`). Two context managers: :func:`quiet` for named loggers and anything
printed, :func:`quiet_torch` for torch's loggers, whose errors it collects.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings


@contextlib.contextmanager
def quiet(*loggers: str):
    """Raise the named loggers to ERROR, ignore warnings and swallow anything printed to
    stdout or stderr inside the block (progress prints, banners)."""
    saved = [(logger, logger.level) for logger in map(logging.getLogger, loggers)]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


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
