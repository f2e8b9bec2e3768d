"""How much memory ONNX Runtime sessions take and how much there is: the latency stage's plan
(docs/memory.md).

An ``ORT_ENABLE_ALL`` session on the CPU provider holds its weights once (prepacked: MLAS's
packed copies replace the originals), except half-precision weights: the CPU provider has no
float16 or bfloat16 kernel for most ops, inserts ``Cast`` nodes to float32 and constant-folds
them, so the session holds those weights in float32, twice their bytes on file.
"""

from __future__ import annotations

import ctypes
import functools
import gc
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
    glibc."""
    gc.collect()  # the session objects themselves first
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def available_bytes() -> int | None:
    """The memory this process can still take without swapping or being killed (bytes): the
    kernel's ``MemAvailable`` (free memory and the page cache it can drop); None where the
    system does not say (not Linux)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def session_bytes(path: Path, provider: str) -> int:
    """The memory an ``ORT_ENABLE_ALL`` session of the model at ``path`` holds for its weights
    on ``provider`` (bytes; host memory on CPU, device memory on CUDA): the initializers'
    bytes, half-precision ones counted as float32 on CPU (see the module docstring). Read from
    the tensors' headers; the external data stays on disk."""
    model = ir.load(path)
    total = 0
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue
            widened = provider == "cpu" and tensor.dtype in _HALF
            total += tensor.nbytes * (2 if widened else 1)
    return total


def fit_together(paths: list[Path], provider: str) -> str | None:
    """Whether ``ORT_ENABLE_ALL`` sessions of all of ``paths`` fit in memory at once: None
    where they do (or where the system does not say how much there is), else why not, in
    words for the report.

    Only host memory is planned: on CUDA the weights go to the device.
    """
    available = available_bytes()
    if available is None or provider != "cpu":
        return None
    needed = sum(session_bytes(p, provider) for p in paths)
    if needed <= SESSIONS_SHARE * available:
        return None
    return (
        f"timed one at a time: {len(paths)} sessions together would take about "
        f"{needed / 2**30:.1f} GiB, over {SESSIONS_SHARE:.0%} of the "
        f"{available / 2**30:.1f} GiB available"
    )
