"""Run a process under a memory limit the way a container runtime does: a memory cgroup made
directly under the root of the hierarchy (cgroup v1's ``memory`` controller, or v2 where its
``memory`` controller is enabled at the root), the process written to the group's
``cgroup.procs`` before it executes (a ``preexec_fn``), the group removed afterwards.

The page cache is the user's choice: ``cold`` drops it first (``/proc/sys/vm/drop_caches``:
every file is read from disk, and the kernel charges the pages to the group that reads them);
``warm`` leaves it as it is (a model file written or read just before, its pages charged to
whichever group first touched them, possibly still dirty).

    with cgroup.limited(4 * 2**30, cache="warm") as group:
        subprocess.run(cmd, preexec_fn=group.enter)
        print(group.stats())
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
#: Per version: the mount, the limit file, the peak file (v2's only from Linux 5.19), the
#: anonymous memory's key in ``memory.stat``.
VERSIONS = {
    "v1": (ROOT / "memory", "memory.limit_in_bytes", "memory.max_usage_in_bytes", "total_rss"),
    "v2": (ROOT, "memory.max", "memory.peak", "anon"),
}


class Group:
    """A memory cgroup with a limit (bytes), its version (``"v1"`` or ``"v2"``), and a thread
    that samples its anonymous memory every :data:`SAMPLE_S` seconds while it exists."""

    SAMPLE_S = 0.2

    def __init__(self, path: Path, version: str):
        self.path, self.version = path, version
        self.peak_anon = 0
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def enter(self) -> None:
        """Put the calling process into the group (a ``preexec_fn``: the child, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def _stat(self) -> dict[str, int]:
        text = (self.path / "memory.stat").read_text()
        return {k: int(v) for k, v in (line.split() for line in text.splitlines())}

    def _sample(self) -> None:
        key = VERSIONS[self.version][3]
        while not self._done.wait(self.SAMPLE_S):
            with contextlib.suppress(OSError, ValueError):
                self.peak_anon = max(self.peak_anon, self._stat().get(key, 0))

    def stats(self) -> dict:
        """The group's limit, peak usage (page cache included: at the limit wherever the
        files read pass it), peak anonymous memory (sampled), how often it hit the limit
        (v1) and OOM kills (bytes, counts)."""
        _, limit_file, peak_file, _ = VERSIONS[self.version]
        peak = self.path / peak_file
        events = {}
        for name in ("memory.oom_control", "memory.events"):
            with contextlib.suppress(OSError):
                text = (self.path / name).read_text()
                events.update(line.split() for line in text.splitlines())
        failcnt = self.path / "memory.failcnt"
        return {
            "version": self.version,
            "group": str(self.path),
            "limit_bytes": int((self.path / limit_file).read_text()),
            "max_usage_bytes": int(peak.read_text()) if peak.exists() else None,
            "peak_anon_bytes": self.peak_anon,
            "failcnt": int(failcnt.read_text()) if failcnt.exists() else None,
            "oom_kill": int(events.get("oom_kill", 0)),
        }

    def stop(self) -> None:
        self._done.set()
        self._sampler.join()


def version() -> str | None:
    """The cgroup version whose memory controller a group at the root can use, or None."""
    if (VERSIONS["v1"][0] / "memory.limit_in_bytes").exists():
        return "v1"
    controllers = ROOT / "cgroup.subtree_control"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return "v2"
    return None


def why_not() -> str | None:
    """Why no limited group can be made here (not root, no memory controller), or None."""
    if os.geteuid() != 0:
        return "needs root (a memory cgroup at the root of the hierarchy)"
    if version() is None:
        return "needs a memory controller (cgroup v1's, or v2's enabled at the root)"
    return None


@contextlib.contextmanager
def limited(limit_bytes: int, cache: str = "cold") -> Iterator[Group]:
    """A memory cgroup at the root of the hierarchy limited to ``limit_bytes``, the page cache
    dropped first where ``cache`` is ``"cold"`` (``"warm"``: left as it is); removed on exit
    (its processes must have ended).

    Raises:
        OSError: see :func:`why_not`.
        ValueError: ``cache`` is neither ``"cold"`` nor ``"warm"``.
    """
    if cache not in ("cold", "warm"):
        raise ValueError(f"cache {cache!r}: 'cold' or 'warm'")
    problem = why_not()
    if problem:
        raise OSError(problem)
    kind = version()
    mount, limit_file, _, _ = VERSIONS[kind]
    path = mount / f"normexport-limited-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    group = None
    try:
        (path / limit_file).write_text(str(limit_bytes))
        if cache == "cold":
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1")
        group = Group(path, kind)
        yield group
    finally:
        if group is not None:
            group.stop()
        path.rmdir()
