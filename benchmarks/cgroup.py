"""Run a process under a memory limit smaller than the machine: a child memory cgroup (v1).

The machines this project runs on have the cgroup v1 memory controller; as root, a child group
under this process's own (``/sys/fs/cgroup/memory/<ours>/<child>``) gets
``memory.limit_in_bytes``, the child process is written to its ``cgroup.procs`` before it
executes, and the group is removed afterwards. The kernel charges a file's page cache to the
group that first read it, so the page cache is dropped first (``/proc/sys/vm/drop_caches``):
a model file cached by the build would otherwise be read for free.

    with cgroup.limited(4 * 10**9) as group:
        subprocess.run(cmd, preexec_fn=group.enter)
        print(group.stats())
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

MOUNT = Path("/sys/fs/cgroup/memory")


class Group:
    """A child memory cgroup with a limit (bytes)."""

    def __init__(self, path: Path):
        self.path = path

    def enter(self) -> None:
        """Put the calling process into the group (a ``preexec_fn``: the child, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def stats(self) -> dict:
        """The group's limit, peak usage, how often it hit the limit, and OOM kills."""
        oom = dict(
            line.split() for line in (self.path / "memory.oom_control").read_text().splitlines()
        )
        return {
            "limit_bytes": int((self.path / "memory.limit_in_bytes").read_text()),
            "max_usage_bytes": int((self.path / "memory.max_usage_in_bytes").read_text()),
            "failcnt": int((self.path / "memory.failcnt").read_text()),
            "oom_kill": int(oom.get("oom_kill", 0)),
        }


def why_not() -> str | None:
    """Why no limited group can be made here (not root, no v1 memory controller), or None."""
    if os.geteuid() != 0:
        return "needs root (a child memory cgroup)"
    if not (MOUNT / "memory.limit_in_bytes").exists():
        return "needs the cgroup v1 memory controller at /sys/fs/cgroup/memory"
    return None


@contextlib.contextmanager
def limited(limit_bytes: int) -> Iterator[Group]:
    """A child memory cgroup of this process's own, limited to ``limit_bytes``, with the page
    cache dropped; removed on exit (its processes must have ended).

    Raises:
        OSError: see :func:`why_not`.
    """
    problem = why_not()
    if problem:
        raise OSError(problem)
    ours = next(
        line.split(":", 2)[2]
        for line in Path("/proc/self/cgroup").read_text().splitlines()
        if "memory" in line.split(":")[1].split(",")
    )
    path = MOUNT / ours.strip("/") / f"normexport-bench-{os.getpid()}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
        yield Group(path)
    finally:
        path.rmdir()
