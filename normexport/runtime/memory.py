"""How much memory ONNX Runtime sessions take and how much there is: the latency stage's plan
(docs/memory.md).

An ``ORT_ENABLE_ALL`` session on the CPU provider holds its weights once (prepacked: MLAS's
packed copies replace the originals), except half-precision weights: the CPU provider has no
float16 or bfloat16 kernel for most ops, inserts ``Cast`` nodes to float32 and constant-folds
them, so the session holds those weights in float32, twice their bytes on file.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
from collections.abc import Iterator
from pathlib import Path

import onnx_ir as ir

#: The share of the memory available now that the latency stage's sessions may take together
#: (the rest: activations, the interpreter, what else the machine runs).
SESSIONS_SHARE = 0.8
#: Half-precision initializer types, which the CPU provider holds as float32.
_HALF = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, where this process runs on it (its ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def give_back() -> None:
    """Hand the memory of freed sessions back to the system. ONNX Runtime frees a session's
    buffers with ``free``, and glibc keeps much of it in the process's heap (about 1 GiB
    after a session of the 3 B float16 model, ``benchmarks/scale.py``), so the next session
    comes on top of it; ``malloc_trim(0)`` returns it. Nothing where the C library is not
    glibc. A full garbage collection comes first: a session held in a reference cycle, and
    every onnx_ir model let go (its nodes and graphs refer to each other, so only the cyclic
    collector frees them and their tensors), are freed before the heap is trimmed. Its cost
    grows with the live objects it walks (PyTorch loaded: hundreds of thousands)."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def imports_spared() -> Iterator[None]:
    """Within the block, the garbage collector skips every object alive when it opens (the
    modules imported so far: with PyTorch and the pipeline loaded, about 320,000 objects that a
    full collection walks each time, a quarter of a second on the 2-core machine, where
    :func:`give_back` runs a full collection after every session). What was garbage when it
    opens is collected first; what the block makes is collected as usual. Python's
    ``gc.freeze()`` (the objects move to the permanent generation), undone on leaving
    (``gc.unfreeze()``), so that a long-lived process calling the job (a test run, a notebook)
    keeps its collector as it was."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def available_bytes() -> int | None:
    """The memory this process can still take without swapping or being killed (bytes): the
    smaller of the kernel's ``MemAvailable`` (free memory and the page cache it can drop) and
    what every memory cgroup the process is in still allows (:func:`cgroup_available`); None
    where the system says neither (not Linux)."""
    found = [b for b in (_meminfo_available(), cgroup_available()) if b is not None]
    return min(found) if found else None


def _meminfo_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (bytes), or None."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


#: A cgroup v1 ``memory.limit_in_bytes`` at or above this is "no limit" (the kernel writes
#: ``PAGE_COUNTER_MAX`` pages: 9223372036854771712 on 4 KiB pages).
_UNLIMITED = 2**62


def cgroup_available(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """What the memory cgroups this process is in still allow it (bytes): over the process's
    group and each group above it that has a limit, the smallest ``limit - usage + clean file
    cache``, the clean file cache (active and inactive, less what is dirty or under
    writeback) being what the kernel reclaims before it kills, as ``MemAvailable`` counts it
    (a model file read by an earlier run stays in the group's cache, charged to it; one just
    written in the group is dirty until the kernel writes it back, and cannot be dropped
    before). cgroup v1 (the ``memory`` controller: ``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``, ``memory.stat``'s ``total_inactive_file``,
    ``total_active_file``, ``total_dirty`` and ``total_writeback``) and v2 (the smaller of
    ``memory.max`` and ``memory.high``, ``memory.current``, ``inactive_file``,
    ``active_file``, ``file_dirty`` and ``file_writeback``). None where no group has a limit
    or the files cannot be read.

    Args:
        proc_cgroup: the process's cgroup membership file.
        root: where the cgroup file systems are mounted.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            found += _group_room(root / "memory", path, "v1")
        elif controllers == "" and (root / "cgroup.controllers").exists():
            found += _group_room(root, path, "v2")
    return min(found) if found else None


#: Per cgroup version: the limit files (the smallest binds: v2's ``memory.high``, above which
#: the kernel throttles the group and reclaims its memory hard, as well as ``memory.max``,
#: above which it kills), the usage file, the file cache's keys in ``memory.stat`` and its
#: dirty part's (v1's ``total_``: this group and its children).
_FILES = {
    "v1": (
        ("memory.limit_in_bytes",),
        "memory.usage_in_bytes",
        ("total_inactive_file", "total_active_file"),
        ("total_dirty", "total_writeback"),
    ),
    "v2": (
        ("memory.max", "memory.high"),
        "memory.current",
        ("inactive_file", "active_file"),
        ("file_dirty", "file_writeback"),
    ),
}


def _limit(group: Path, names: tuple[str, ...]) -> int | None:
    """The smallest of the limit files ``names`` of ``group`` that exist and set one (bytes);
    None where none does ("max", or v1's :data:`_UNLIMITED`)."""
    found = []
    for name in names:
        try:
            text = (group / name).read_text().strip()
        except OSError:
            continue
        if text != "max" and int(text) < _UNLIMITED:
            found.append(int(text))
    return min(found) if found else None


def _group_room(mount: Path, path: str, version: str) -> list[int]:
    """``limit - usage + clean file cache`` of the group at ``path`` under ``mount`` and of
    each group above it that has a limit (bytes)."""
    limit_files, usage_file, cache_keys, dirty_keys = _FILES[version]
    rooms, group = [], mount / path.strip("/")
    while True:
        try:
            limit = _limit(group, limit_files)
            if limit is not None:
                usage = int((group / usage_file).read_text())
                stat = dict(
                    line.split() for line in (group / "memory.stat").read_text().splitlines()
                )
                cache = sum(int(stat.get(key, 0)) for key in cache_keys)
                cache -= min(cache, sum(int(stat.get(key, 0)) for key in dirty_keys))
                rooms.append(max(0, limit - usage + cache))
        except (OSError, ValueError):
            pass  # a level we may not read, or none mounted here
        if group == mount or mount not in group.parents:
            return rooms
        group = group.parent


def session_bytes(path: Path, provider: str) -> int:
    """The memory an ``ORT_ENABLE_ALL`` session of the model at ``path`` holds for its weights
    on ``provider`` (bytes: :func:`weights_in_session`). Read from the tensors' headers; the
    external data stays on disk."""
    model = ir.load(path)
    tensors = [v.const_value for g in model.graphs() for v in g.initializers.values()]
    return weights_in_session([t for t in tensors if t is not None], provider)


def weights_in_session(tensors: list[ir.TensorProtocol], provider: str) -> int:
    """The memory an ``ORT_ENABLE_ALL`` session holds for ``tensors`` on ``provider`` (bytes;
    host memory on CPU, device memory on CUDA): their bytes, half-precision ones counted as
    float32 on CPU (see the module docstring)."""
    return sum(t.nbytes * (2 if provider == "cpu" and t.dtype in _HALF else 1) for t in tensors)


def copies_that_fit(paths: list[Path], provider: str, most: int) -> tuple[int, str | None]:
    """How many ``ORT_ENABLE_ALL`` sessions of each of ``paths`` to open at once, at most
    ``most``: ``(copies, None)``, or ``(1, why not)`` where even one of each would not fit in
    memory together (then each is timed alone; the reason in words for the report). Where the
    system does not say how much memory there is, ``most`` of each.

    Only host memory is planned: on CUDA the weights go to the device, and one session of
    each is opened.
    """
    if provider != "cpu":
        return 1, None
    available = available_bytes()
    if available is None:
        return most, None
    needed = sum(session_bytes(p, provider) for p in paths)
    room = SESSIONS_SHARE * available
    if needed <= room:
        return min(most, int(room // max(needed, 1))), None
    return 1, (
        f"timed one at a time: {len(paths)} sessions together would take about "
        f"{needed / 2**30:.1f} GiB, over {SESSIONS_SHARE:.0%} of the "
        f"{available / 2**30:.1f} GiB available"
    )
