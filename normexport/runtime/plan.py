"""The memory plan: before the first session opens, what each stage needs (read from the
tensors' headers, nothing loaded), what the machine has
(:func:`normexport.runtime.memory.available_bytes`), and how the run goes about it:
:func:`plan` makes the :class:`MemoryPlan` (whole-model or block-by-block parity, latency timed
or not), :func:`made_tensor` finds the largest tensor the graph makes from constant shapes, and
a run that cannot even do the passes stops before any work
(:class:`normexport.errors.EnvironmentProblem`, exit 2). What each stage holds and why, and the
thresholds: docs/memory.md#the-memory-plan.
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from normexport.errors import EnvironmentProblem
from normexport.runtime import memory

#: The largest tensor, in float32, times this: the working memory of the passes and of a
#: session besides its weights.
WORKING_TENSORS = 3
#: Below this many bytes of weights, and where everything fits, the plan is not said.
QUIET_BYTES = 2**26


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What the run needs and how it goes about it (bytes).

    Attributes:
        available_bytes: what the process can take now (None: the system does not say).
        weight_bytes: the initializers' bytes on file.
        working_bytes: the passes' and a session's working memory besides its weights
            (:data:`WORKING_TENSORS` times the largest tensor in float32, and the graph).
        parity_bytes: what whole-model parity keeps resident: the float64 oracle's weights
            and the working memory.
        parity_fits: whether that fits in :data:`~normexport.runtime.memory.SESSIONS_SHARE`
            of what is available (True where the system does not say).
        block_bytes: parity goes block by block, each block reading at most this many bytes
            of weights on file; None: the whole model at once.
        latency: why the latency is not timed (a deployed session does not fit); None: it is.
        line: the plan in one line, as said before the run (``memory: ...``).
    """

    available_bytes: int | None
    weight_bytes: int
    working_bytes: int
    parity_bytes: int
    parity_fits: bool
    block_bytes: int | None
    latency: str | None
    line: str

    @property
    def said(self) -> bool:
        """Whether the plan is worth a line before the run: large weights, or a change."""
        changed = not self.parity_fits or self.latency is not None
        return changed or self.weight_bytes >= QUIET_BYTES

    def to_dict(self) -> dict:
        """The report's ``memory``."""
        return dataclasses.asdict(self)


def plan(
    model: ir.Model,
    source: str,
    provider: str,
    *,
    latency: bool,
    autotune: bool,
    by_blocks: bool = True,
) -> MemoryPlan:
    """The memory plan of the raw ``model`` (its initializers read from their headers), named
    ``source`` in messages, on ``provider``; ``latency``, ``autotune``: whether they run;
    ``by_blocks``: whether parity can run block by block (ONNX input: a PyTorch model is in
    memory whole, and its parity runs whole).

    Raises:
        EnvironmentProblem: not even the passes fit (exit 2), or ``autotune`` was asked for
            and a deployed session does not fit; the message gives what is needed and what
            there is.
    """
    tensors = [v.const_value for g in model.graphs() for v in g.initializers.values()]
    tensors = [t for t in tensors if t is not None]
    weights = sum(t.nbytes for t in tensors)
    made, maker = made_tensor(model)
    widest = max([t.size * 4 for t in tensors] + [made])
    working = WORKING_TENSORS * widest + _graph_bytes(model)
    oracle = weights + sum(t.nbytes for t in tensors if t.dtype == ir.DataType.FLOAT)
    available = memory.available_bytes()
    share = memory.SESSIONS_SHARE * available if available is not None else None
    have = f"{_gib(available)} available{_where(available)}" if available is not None else ""
    if share is not None and made * WORKING_TENSORS > share:
        raise EnvironmentProblem(
            f"{source}: not enough memory to run this model: {maker} makes a tensor of "
            f"{_gib(made)} from constant shapes, and a run holds about {WORKING_TENSORS} such "
            f"tensors, {have}; run it where more memory is free, or make the shape smaller"
        )
    if share is not None and working > share:
        raise EnvironmentProblem(
            f"{source}: not enough memory to optimize this model: the passes need about "
            f"{_gib(working)} (the largest tensor, {_gib(widest)} in float32, "
            f"{WORKING_TENSORS} times, and the graph), {have}; run it where more memory is free"
        )
    blocks, fits = None, share is None or oracle + working <= share
    if not fits and by_blocks:
        blocks = max(int((share - working) * weights / max(oracle, 1)), widest)
    deployed = memory.weights_in_session(tensors, provider)
    skipped = None
    if (latency or autotune) and share is not None and deployed > share:
        skipped = (
            f"latency not timed: a deployed session (ORT_ENABLE_ALL, weights prepacked) holds "
            f"about {_gib(deployed)}, over {memory.SESSIONS_SHARE:.0%} of the {have}"
        )
        if autotune:
            raise EnvironmentProblem(f"{source}: --autotune times deployed sessions: {skipped}")
    line = f"memory: {_gib(weights)} of weights, {have or 'available memory unknown'}: "
    line += _parity_line(fits, blocks, oracle + working)
    line += f"; {skipped}" if skipped and latency else ""
    skipped = skipped if latency else None
    return MemoryPlan(available, weights, working, oracle + working, fits, blocks, skipped, line)


def made_tensor(model: ir.Model) -> tuple[int, str]:
    """The largest tensor (bytes) a node of the main graph makes whose size its constant
    inputs fix (``ConstantOfShape``, ``Expand``, ``Tile``, ``Range``), and that node
    (``"ConstantOfShape 'name'"``); ``(0, "")`` where there is none. The weights alone do not
    bound a run's memory: an 8 GiB ``ConstantOfShape`` of a constant shape holds no weight."""
    largest, maker = 0, ""
    for node in model.graph:
        size = _made_elements(node)
        out = node.outputs[0] if node.outputs else None
        dtype = out.dtype if out is not None and out.dtype is not None else ir.DataType.FLOAT
        nbytes = size * max(dtype.itemsize, 1) if size else 0
        if nbytes > largest:
            largest, maker = nbytes, f"{node.op_type} {node.name or out.name!r}"
    return largest, maker


def _made_elements(node: ir.Node) -> int | None:
    """How many elements ``node`` makes, where its constant inputs (and known input shape)
    fix it; None elsewhere."""

    def const(index: int):
        if len(node.inputs) <= index or node.inputs[index] is None:
            return None
        tensor = ir.convenience.get_const_tensor(node.inputs[index])
        return None if tensor is None else tensor.numpy()

    def dims(index: int) -> list[int] | None:
        shape = node.inputs[index].shape if node.inputs[index] is not None else None
        return list(shape) if shape is not None and shape.is_static() else None

    if node.domain != "":
        return None
    try:
        if node.op_type == "ConstantOfShape" and (shape := const(0)) is not None:
            return int(math.prod(int(d) for d in shape.reshape(-1)))
        if node.op_type == "Expand" and (shape := const(1)) is not None:
            source = dims(0) or []
            target = [int(d) for d in shape.reshape(-1)]
            width = max(len(source), len(target))
            source = [1] * (width - len(source)) + source
            target = [1] * (width - len(target)) + target
            return int(math.prod(max(a, b) for a, b in zip(source, target, strict=True)))
        if node.op_type == "Tile" and (repeats := const(1)) is not None and dims(0):
            return int(math.prod(d * int(r) for d, r in zip(dims(0), repeats, strict=True)))
        if node.op_type == "Range" and all(const(i) is not None for i in range(3)):
            start, limit, delta = (float(const(i)) for i in range(3))
            return max(int(math.ceil((limit - start) / delta)), 0) if delta else None
    except (TypeError, ValueError, OverflowError):
        return None
    return None


def _parity_line(fits: bool, blocks: int | None, needed: int) -> str:
    """How parity runs, in words: whole, whole though it does not fit, or block by block."""
    if fits:
        return "whole-model parity fits"
    if blocks is None:
        return (
            f"whole-model parity needs about {_gib(needed)}, and a PyTorch model's runs whole: "
            "its sessions read their weights from disk on every run"
        )
    return (
        f"whole-model parity needs about {_gib(needed)}, so parity runs block by block, each "
        f"reading at most {_gib(blocks)} of weights"
    )


def _graph_bytes(model: ir.Model) -> int:
    """A bound on the graph's own memory: its nodes (about 2 KiB each in onnx-ir) and the
    tensors held in the file (not external data)."""
    held = sum(
        v.const_value.nbytes
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
    )
    nodes = sum(1 for g in model.graphs() for _ in g)
    return 2048 * nodes + held


def _where(available: int) -> str:
    """`` (a cgroup's limit)`` where a memory cgroup, not the machine, sets ``available``."""
    cgroup = memory.cgroup_available()
    return " (under a memory cgroup's limit)" if cgroup is not None and cgroup <= available else ""


def _gib(n: float | None) -> str:
    return f"{n / 2**30:.2f} GiB" if n is not None else "?"
