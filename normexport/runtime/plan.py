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
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from normexport.errors import EnvironmentProblem
from normexport.runtime import memory
from normexport.runtime.activations import Activations, estimate

#: The largest tensor, in float32, times this: the working memory of the passes and of a
#: session besides its weights.
WORKING_TENSORS = 3
#: Below this many bytes of weights, and where everything fits, the plan is not said.
QUIET_BYTES = 2**26
#: Copies of the outputs the references keep per input set, in float32 sizes: the float64
#: oracle's (2) and its run on the inputs moved by one ulp (2), the raw model's and PyTorch
#: float32's (1 each).
KEPT_COPIES = 6
#: The input sets kept where their outputs do not fit: at least this many, the example first.
MIN_SETS = 2
#: The share of what is left beside a run that the kept outputs may take.
KEPT_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What the run needs and how it goes about it (bytes).

    Attributes:
        available_bytes: what the process can take now (None: the system does not say).
        weight_bytes: the initializers' bytes on file.
        working_bytes: the passes' and a session's working memory besides its weights
            (:data:`WORKING_TENSORS` times the largest tensor in float32, and the graph).
        activation_bytes: what a float32 run holds besides its weights, on the example's
            shapes (:func:`normexport.runtime.activations.estimate`: the values alive at
            once and the largest Conv's unfolded input).
        oracle_activation_bytes: the same for the oracle's run (twice the float32 values in
            a float64 oracle).
        kept_bytes: the references' outputs kept for one input set (:data:`KEPT_COPIES`
            times the outputs' float32 bytes).
        weight_values_bytes: the values a run computes from the weights alone, held at once
            with them (:class:`~normexport.runtime.activations.Activations`: a ``Transpose``
            of every weight of a file exported with the exporter's optimizer off), in the
            oracle's types where the oracle is a float64 run.
        parity_bytes: what whole-model parity keeps resident: the oracle's weights and the
            values its run computes from them, its run's activations, the kept outputs of
            every input set and the working memory.
        parity_fits: whether that fits in :data:`~normexport.runtime.memory.SESSIONS_SHARE`
            of what is available (True where the system does not say).
        block_bytes: parity goes block by block, each block reading at most this many bytes
            of weights on file and computing from them at most as many again, together
            (:func:`normexport.verdict.blocks.boundaries`); None: the whole model at once.
        latency: why the latency is not timed (a deployed session does not fit); None: it is.
        deployed: why the models are not judged as deployed (a deployed session does not
            fit: docs/parity.md#judged-as-deployed); None: they are.
        line: the plan in one line, as said before the run (``memory: ...``).
    """

    available_bytes: int | None
    weight_bytes: int
    working_bytes: int
    activation_bytes: int
    oracle_activation_bytes: int
    kept_bytes: int
    weight_values_bytes: int
    parity_bytes: int
    parity_fits: bool
    block_bytes: int | None
    float64_oracle: bool
    input_sets: int | None
    latency: str | None
    deployed: str | None
    line: str

    @property
    def said(self) -> bool:
        """Whether the plan is worth a line before the run: large weights, or a change."""
        changed = not self.parity_fits or self.latency is not None or not self.float64_oracle
        changed = changed or self.deployed is not None
        changed = changed or self.input_sets is not None
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
    feeds: Mapping[str, np.ndarray] | None = None,
    sets: int = 1,
) -> MemoryPlan:
    """The memory plan of the raw ``model`` (its initializers read from their headers), named
    ``source`` in messages, on ``provider``; ``latency``, ``autotune``: whether they run;
    ``by_blocks``: whether parity can run block by block (ONNX input: a PyTorch model is in
    memory whole, and its parity runs whole); ``feeds``: the example inputs (graph input name
    -> array; their shapes fix the activations: none counted where None); ``sets``: how many
    input sets parity runs. What does not fit degrades in this order: a float32 oracle where
    the float64 run's activations alone do not fit, fewer input sets (at least
    :data:`MIN_SETS`) where their kept outputs would take more than :data:`KEPT_SHARE` of
    what is left beside the run, then parity block by block (docs/memory.md#the-memory-plan).

    Raises:
        EnvironmentProblem: not even the passes fit, or a float32 run's activations on these
            input shapes do not (exit 2), or ``autotune`` was asked for and a deployed
            session does not fit; the message gives what is needed and what there is.
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
    if share is not None:
        _refuse_what_cannot_run(source, share, have, (made, maker), widest, working)
    run = estimate(model, feeds or {})
    if share is not None and run.peak_bytes + working > share:
        raise EnvironmentProblem(
            f"{source}: not enough memory to run this model on these input shapes: a run "
            f"holds about {_gib(run.peak_bytes)} of values besides its weights and the "
            f"passes' {_gib(working)}, {have}; give smaller shapes (--input-shape, --dim) or "
            "run it where more memory is free"
        )
    parity = _parity(run, share, weights, oracle, working, widest, sets, by_blocks)
    skipped, unjudged = _deployed_session(tensors, provider, share, have)
    if skipped and autotune:
        raise EnvironmentProblem(f"{source}: --autotune times deployed sessions: {skipped}")
    skipped = skipped if latency else None
    line = f"memory: {_gib(weights)} of weights, {have or 'available memory unknown'}: "
    line += parity.line + "".join(f"; {why}" for why in (skipped, unjudged) if why)
    return MemoryPlan(
        available_bytes=available,
        weight_bytes=weights,
        working_bytes=working,
        activation_bytes=run.peak_bytes,
        oracle_activation_bytes=parity.activation_bytes,
        kept_bytes=parity.kept_bytes,
        weight_values_bytes=parity.weight_values_bytes,
        parity_bytes=parity.needed,
        parity_fits=parity.fits,
        block_bytes=parity.blocks,
        float64_oracle=parity.float64,
        input_sets=parity.sets,
        latency=skipped,
        deployed=unjudged,
        line=line,
    )


def _deployed_session(
    tensors: list, provider: str, share: float | None, have: str
) -> tuple[str | None, str | None]:
    """Where a session with ONNX Runtime's defaults (weights prepacked, half precision as
    float32 on CPU: :func:`normexport.runtime.memory.weights_in_session`) does not fit in
    ``share``: why the latency is not timed, and why the models are not judged as deployed;
    ``(None, None)`` where it fits (or ``share`` is unknown)."""
    deployed = memory.weights_in_session(tensors, provider)
    if share is None or deployed <= share:
        return None, None
    over = f"holds about {_gib(deployed)}, over {memory.SESSIONS_SHARE:.0%} of the {have}"
    return (
        f"latency not timed: a deployed session (ORT_ENABLE_ALL, weights prepacked) {over}",
        f"not judged as deployed: a session with ONNX Runtime's defaults {over}",
    )


def _refuse_what_cannot_run(
    source: str,
    share: float,
    have: str,
    made_by: tuple[int, str],
    widest: int,
    working: int,
) -> None:
    """Stop before any work where not even the passes fit in ``share``.

    Raises:
        EnvironmentProblem: a tensor made from constant shapes, or the passes, need more
            than ``share``; the message names the file, what it needs and ``have`` (what
            there is).
    """
    made, maker = made_by
    if made * WORKING_TENSORS > share:
        raise EnvironmentProblem(
            f"{source}: not enough memory to run this model: {maker} makes a tensor of "
            f"{_gib(made)} from constant shapes, and a run holds about {WORKING_TENSORS} such "
            f"tensors, {have}; run it where more memory is free, or make the shape smaller"
        )
    if working > share:
        raise EnvironmentProblem(
            f"{source}: not enough memory to optimize this model: the passes need about "
            f"{_gib(working)} (the largest tensor, {_gib(widest)} in float32, "
            f"{WORKING_TENSORS} times, and the graph), {have}; run it where more memory is free"
        )


class _Parity(NamedTuple):
    """How parity runs: :class:`MemoryPlan`'s fields of the same meaning, and its words."""

    float64: bool
    activation_bytes: int
    kept_bytes: int
    weight_values_bytes: int
    sets: int | None
    needed: int
    fits: bool
    blocks: int | None
    line: str


def _parity(
    run: Activations,
    share: float | None,
    weights: int,
    oracle: int,
    working: int,
    widest: int,
    sets: int,
    by_blocks: bool,
) -> _Parity:
    """How parity runs beside ``share`` bytes (None: unknown), degraded in :func:`plan`'s
    order: a float32 oracle, fewer input sets, then block by block. ``oracle`` is the float64
    oracle's weights, ``widest`` the largest tensor in float32 (the smallest block). A block's
    budget counts its weights on file and the values computed from them alone
    (:func:`normexport.verdict.blocks.boundaries`), scaled to the oracle's."""
    float64 = share is None or run.float64_peak_bytes + working <= share
    oracle = oracle if float64 else weights
    acts = run.float64_peak_bytes if float64 else run.peak_bytes
    computed = run.float64_weight_values_bytes if float64 else run.weight_values_bytes
    kept, count = KEPT_COPIES * run.output_bytes, None
    rest = share - working - acts if share is not None else None
    if rest is not None and kept * sets > KEPT_SHARE * rest:
        count = min(sets, max(MIN_SETS, int(KEPT_SHARE * rest // max(kept, 1))))
    needed = oracle + computed + acts + working + kept * (count or sets)
    blocks, fits = None, share is None or needed <= share
    if not fits and by_blocks and float64:  # each block's oracle is a float64 run
        room = share - working - acts - kept * (count or sets)
        on_file = weights + run.weight_values_bytes
        blocks = max(int(room * on_file / max(oracle + computed, 1)), widest)
    line = _parity_line(fits, blocks, needed, pytorch=not by_blocks)
    if not float64:
        line += (
            f"; the float64 oracle's run would hold about {_gib(run.float64_peak_bytes)}: "
            "the reference is the model as written, in float32"
        )
    if count is not None:
        line += (
            f"; the references' outputs take {_gib(kept)} per input set: parity runs "
            f"{count} of the {sets} input sets"
        )
    return _Parity(float64, acts, kept, computed, count, needed, fits, blocks, line)


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


def _parity_line(fits: bool, blocks: int | None, needed: int, *, pytorch: bool) -> str:
    """How parity runs, in words: whole, whole though it does not fit (a PyTorch model's,
    ``pytorch``, or beside a float32 oracle), or block by block."""
    if fits:
        return "whole-model parity fits"
    if blocks is None:
        how = "a PyTorch model's runs whole" if pytorch else "it runs whole"
        return (
            f"whole-model parity needs about {_gib(needed)}, and {how}: its sessions read "
            "their weights from disk on every run"
        )
    return (
        f"whole-model parity needs about {_gib(needed)}, so parity runs block by block, each "
        f"holding at most {_gib(blocks)} of weights and of values computed from them"
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
