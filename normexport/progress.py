"""What a run is doing and what it costs: its stages, each one's wall time and peak resident
memory, and, while it runs, a live line on a terminal.

The pipeline marks its stages (:func:`stage`) and, inside the long ones, the step in turn
(:func:`step`: the input set, the variant being timed). :func:`recording` collects the stages
of one run for the report; :func:`shown` (the CLI) draws them with rich on stderr, transient,
on a terminal, and where the output is a pipe or a log prints one line as each stage starts and
one as it ends, with its time and peak memory (a log then shows the run as it goes, not
everything at the end). Without either, both calls do nothing: the Python API stays silent.

Peak memory is the process's resident set (RSS, Linux ``/proc/self``): a stage's peak is
``VmHWM`` where the high-water mark rose during the stage (exact), else the largest RSS a
sampling thread saw (every :data:`SAMPLE_S`). Where ``/proc`` is absent, memory is None.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

#: Seconds between two RSS samples while a run is recorded.
SAMPLE_S = 0.05


@dataclasses.dataclass
class Stage:
    """One stage of a run.

    Attributes:
        name: e.g. ``"reference"``, ``"parity"``.
        wall_s: its wall time (s).
        peak_rss_bytes: the process's peak resident set during it (bytes), or None where the
            system does not say.
    """

    name: str
    wall_s: float
    peak_rss_bytes: int | None


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes, or None."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


class _Recorder:
    """The stages of one run, with an RSS sampling thread while a stage is open."""

    def __init__(self, display: _Display | _Lines | None):
        self.stages: list[Stage] = []
        self.display = display
        #: The stage open now and its latest step (:func:`where`).
        self.now: tuple[str, str] = ("", "")
        self._peak: int | None = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start, mark = time.perf_counter(), _status("VmHWM")
        self._peak, self._stop = _status("VmRSS"), threading.Event()
        sampler = threading.Thread(target=self._sample, args=(self._stop,), daemon=True)
        sampler.start()
        self.now = (name, "")
        if self.display:
            self.display.start(name)
        try:
            yield
        finally:
            self._stop.set()
            sampler.join()
            end_mark = _status("VmHWM")
            rose = mark is not None and end_mark is not None and end_mark > mark
            peak = end_mark if rose else self._peak
            self.stages.append(Stage(name, time.perf_counter() - start, peak))
            if self.display:
                self.display.finish(self.stages[-1])

    def _sample(self, stop: threading.Event) -> None:
        while not stop.wait(SAMPLE_S):
            rss = _status("VmRSS")
            if rss is not None and (self._peak is None or rss > self._peak):
                self._peak = rss


class _Display:
    """A transient rich display on stderr: a line per stage (spinner, name, step, elapsed)."""

    def __init__(self, progress: Progress):
        self.progress, self.task, self.name = progress, None, ""

    def start(self, name: str) -> None:
        self.name = name
        self.task = self.progress.add_task(name, total=1)

    def step(self, text: str) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=f"{self.name}: {text}")

    def finish(self, done: Stage) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=self.name, completed=1)
            self.task = None


class _Lines:
    """The stages as lines on a console that is no terminal (a pipe, a log): one as each
    starts, one as it ends with its wall time and peak memory; steps are not printed."""

    def __init__(self, console: Console):
        self.console = console

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def start(self, name: str) -> None:
        self._print(f"stage {name}: started")

    def step(self, text: str) -> None:
        pass

    def finish(self, done: Stage) -> None:
        peak = done.peak_rss_bytes
        memory = f", peak memory {peak / 2**30:.2f} GiB" if peak else ""
        self._print(f"stage {done.name}: {done.wall_s:.1f} s{memory}")


_display: contextvars.ContextVar[_Display | _Lines | None] = contextvars.ContextVar(
    "normexport_display", default=None
)
_recorder: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "normexport_recorder", default=None
)


_console: contextvars.ContextVar[Console | None] = contextvars.ContextVar(
    "normexport_console", default=None
)


@contextlib.contextmanager
def shown(console: Console, log: Console | None = None) -> Iterator[None]:
    """Draw the stages of the runs inside on ``console`` (use a stderr console) while they
    run, where it is a terminal; elsewhere (a pipe, a log, ``TERM=dumb``) print a line as each
    starts and ends on ``log`` (the output's console; nothing where None). What the runs
    :func:`say` is printed on ``console`` either way."""
    said = _console.set(console)
    try:
        if not console.is_terminal or console.is_dumb_terminal:
            token = _display.set(_Lines(log) if log is not None else None)
            try:
                yield
            finally:
                _display.reset(token)
            return
        columns = (SpinnerColumn(finished_text="[green]✓[/]"), TextColumn("{task.description}"))
        with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
            token = _display.set(_Display(bar))
            try:
                yield
            finally:
                _display.reset(token)
    finally:
        _console.reset(said)


def process_age_s() -> float | None:
    """Seconds since this process started (its start time in ``/proc/self/stat``, field 22, in
    clock ticks since boot, against ``/proc/uptime``), or None where the system does not say:
    a run's time with the interpreter's start and the imports counted."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def say(text: str) -> None:
    """Print one line now, before the run's report, on the console of :func:`shown` (where a
    run is shown: the CLI; the Python API says nothing)."""
    console = _console.get()
    if console is not None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)


@contextlib.contextmanager
def recording() -> Iterator[list[Stage]]:
    """Record the stages marked inside (:func:`stage`); yields their list, filled as each
    stage ends."""
    recorder = _Recorder(_display.get())
    token = _recorder.set(recorder)
    try:
        yield recorder.stages
    finally:
        _recorder.reset(token)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Mark the code inside as stage ``name`` of the run being recorded (nothing otherwise)."""
    recorder = _recorder.get()
    if recorder is None:
        yield
        return
    with recorder.stage(name):
        yield


def step(text: str) -> None:
    """Say which step of the current stage runs now (an input set, a variant), on the display
    where there is one."""
    recorder = _recorder.get()
    if recorder is not None:
        recorder.now = (recorder.now[0], text)
        if recorder.display is not None:
            recorder.display.step(text)


def where() -> str:
    """Where the recorded run is: ``"the reference stage, input set random_0"``, or ``""``."""
    recorder = _recorder.get()
    if recorder is None or not recorder.now[0]:
        return ""
    name, text = recorder.now
    return f"the {name} stage" + (f", {text}" if text else "")
