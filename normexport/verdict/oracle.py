"""The parity oracle: the most exact run of the model that can be built here, against which
:mod:`normexport.verdict.parity` measures the optimized model, the raw model and PyTorch
float32. :func:`pytorch_float64` and :func:`onnx_float64` build the candidates, each an
:class:`Oracle` (``run`` None, with the reason in its notes, where it cannot be built);
:func:`to_float64` widens an ONNX graph. Which oracle is preferred, what is widened, which
engine runs it and the self-check: docs/parity.md#three-models-many-input-sets-one-oracle.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from normexport import runtime
from normexport.errors import RunTimedOut, one_line
from normexport.io import files
from normexport.io.eager import Eager
from normexport.io.inputs import memory_bytes
from normexport.io.load import LoadedModel
from normexport.verdict.float64 import Float32Nodes, Float64Graph
from normexport.verdict.parity import closeness
from normexport.verdict.tolerance import error_metrics

#: The largest share of physical memory the oracle's float64 copy of the weights may take.
MEMORY_SHARE = 0.25

Run = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]


@dataclasses.dataclass
class Oracle:
    """What parity measures against.

    Attributes:
        run: input feeds (name -> array) -> outputs, or None where no float64 run could be
            built (the caller falls back to its float32 reference).
        kind: ``"pytorch_float64"``, ``"onnx_float64"``, or the fallback's kind.
        notes: how it was built or why it could not be, for the report.
        close: frees what ``run`` holds (its ONNX Runtime session, the PyTorch copy); the
            next run builds it again. None where it holds nothing worth freeing.
        float32: an ONNX graph's nodes the oracle runs in float32 (islands), by op type.
    """

    run: Run | None
    kind: str
    notes: list[str] = dataclasses.field(default_factory=list)
    close: Callable[[], None] | None = None
    float32: list[Float32Nodes] = dataclasses.field(default_factory=list)


def pytorch_float64(loaded: LoadedModel, example: Mapping, feed_names: Sequence[str]) -> Oracle:
    """The PyTorch model run in float64, tried on the example first.

    The copy holds the model's floating-point weights again at twice their float32 size; where
    that would take more than :data:`MEMORY_SHARE` of this machine's memory, none is made.

    Returns:
        an :class:`Oracle` of kind ``"pytorch_float64"``, or with ``run`` None and the reason
        (no room, the copy raised, or it returns float32: a forward that casts itself).
    """
    needed, memory = _torch_float64_bytes(loaded.module), memory_bytes()
    if memory is not None and needed > memory * MEMORY_SHARE:
        return Oracle(None, "pytorch_float32", [_no_room("the model", needed, memory)])
    copy: dict[str, Eager] = {}  # the float64 copy, made on first use and freed by close

    def run(feeds):
        if not copy:
            copy["eager"] = Eager(loaded.module, float64=True)
        return copy["eager"]([feeds[name] for name in feed_names])

    try:
        outs = run(example)
    except Exception as err:  # whatever a model's float64 copy raises: fall back, and say so
        why = f"a float64 copy of the PyTorch model could not be run ({one_line(err)})"
        return Oracle(None, "pytorch_float32", [why])
    narrow = sorted({str(o.dtype) for o in outs if o.dtype.kind == "f" and o.dtype != np.float64})
    if narrow:
        why = f"the float64 copy of the PyTorch model returns {', '.join(narrow)} outputs"
        return Oracle(None, "pytorch_float32", [why])
    return Oracle(run, "pytorch_float64", close=copy.clear)


def onnx_float64(
    source: Path | ir.Model, as_written: Run, example: Mapping, work: Path, what: str
) -> Oracle:
    """The ONNX model at ``source`` (a file, or a model, widened in place) in float64 on ONNX
    Runtime's CPU provider (:func:`to_float64`: float64 forms and float32 islands where it has
    no float64 kernel), checked on the example: the float64 run must agree with the file run as
    written in float32 within :data:`SELF_CHECK` (``closeness``'s atol, rtol)
    (docs/parity.md#three-models-many-input-sets-one-oracle).

    A node ONNX Runtime cannot load or run in float64 (its error names it) becomes a float32
    island and the graph is built again, at most :data:`REPAIRS` times; on an input set after
    the example where it still fails, the oracle there is the file as written (the notes say
    so). Nothing it raises ends the run, but the run-time limit (``--run-timeout``).

    Args:
        source: the model file (its external data beside it), or the model.
        as_written: the same model in float32, as written (ONNX Runtime, optimizations off).
        example: feeds for the check (float inputs are cast to float64 on every run).
        work: a scratch folder for the float64 model (and its external data).
        what: how the notes name the model, e.g. ``"the input graph"``.

    Returns:
        an :class:`Oracle` of kind ``"onnx_float64"`` (the notes say what is not float64, and
        ``float32`` lists those nodes), or with ``run`` None and the reason.
    """
    try:
        model = source if isinstance(source, ir.Model) else ir.load(source)
        needed, memory = 2 * _float32_bytes(model), memory_bytes()
        if memory is not None and needed > memory * MEMORY_SHARE:
            return Oracle(None, "", [_no_room(what, needed, memory)])
        run = Float64Run(to_float64(model), work, as_written)
        run.build()
    except RunTimedOut:
        raise
    except Exception as err:  # whatever widening or ONNX Runtime raises: fall back, and say so
        why = f"{what} could not be made to run in float64 ({_said(err)})"
        return Oracle(None, "", [why])
    found = _checked(run, as_written, example, what)
    if found.run is None:
        run.close()
        return found
    found.notes += [*run.notes, *run.described()]
    run.notes, run.fallback = found.notes, True  # what happens on later input sets is said
    return dataclasses.replace(found, close=run.close, float32=run.wide.float32)


#: The float64 session's intra-op threads: one, no slower than ONNX Runtime's default of one
#: per core or two input sets at once, faster on a busy machine
#: (docs/parity.md#one-intra-op-thread).
THREADS = 1
#: How many times the float64 graph is built again with one more op type made a float32
#: island, where ONNX Runtime names a node it cannot load or run.
REPAIRS = 8


class Float64Run:
    """The runs of a :class:`~normexport.verdict.float64.Float64Graph` on ONNX Runtime's CPU
    provider, its session opened on demand (:func:`_float64_session`), mended where a node
    fails (:meth:`_island`).

    Args:
        wide: the float64 graph.
        work: a scratch folder for it.
        as_written: the model as written, the oracle of an input set where the float64 graph
            cannot run once the oracle has been checked (:attr:`fallback`).
    """

    def __init__(self, wide: Float64Graph, work: Path, as_written: Run):
        self.wide, self.work, self.as_written = wide, work, as_written
        self.session: runtime.OnDemand | None = None
        self.repairs, self.seconds = 0, []
        self.notes: list[str] = []
        self.fallback = False
        #: the self-check's feeds and outputs, handed to the first run on those very feeds
        #: (the reference stage's run on the example) instead of running them again
        self.checked: tuple[Mapping, list[np.ndarray]] | None = None

    def build(self) -> None:
        """The session, built again with a float32 island for each node it names as one it
        cannot load (at most :data:`REPAIRS` times).

        Raises:
            whatever ONNX Runtime raises where it names no node, or after the repairs.
        """
        while True:
            self.wide.finish()
            session = _float64_session(self.wide.model, self.work)
            try:
                session.open()
            except Exception as err:  # ORT's own error types
                if not self._island(err, "ONNX Runtime could not load it in float64"):
                    raise
                continue
            self.session = session
            return

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if self.checked is not None and self.checked[0] is feeds:
            outputs, self.checked = self.checked[1], None
            return outputs
        while True:
            if self.session is None:
                self.build()
            start = time.perf_counter()
            try:
                outputs = runtime.run(self.session.open(), _widen(feeds), kept=True)
            except RunTimedOut:
                raise
            except Exception as err:  # ORT's own error types: a node failed in float64
                if self._island(err, "it failed in float64 at run time"):
                    self.close()
                    self.session = None
                    continue
                if not self.fallback:
                    raise
                return self._as_written(feeds, err)
            self.seconds.append(time.perf_counter() - start)
            return outputs

    def _island(self, err: BaseException, why: str) -> bool:
        """Make the node ``err`` names (and those like it) a float32 island; False where it
        names none that can be, or the repairs are spent."""
        name = _failed_node(str(err))
        node = self.wide.named(name) if name is not None else None
        if node is None or self.repairs >= REPAIRS or not self.wide.widened(node):
            return False
        self.repairs += 1
        self.wide.island(self.wide.like(node), f"{why} ({runtime.message(err)})")
        self.notes.append(f"{node.op_type} made a float32 island: {why} ({_said(err)})")
        return True

    def _as_written(self, feeds, err: BaseException) -> list[np.ndarray]:
        self.notes.append(
            "on an input set the float64 graph could not run "
            f"({_said(err)}): the oracle there is the file as written"
        )
        return [_wide(a) for a in self.as_written(feeds)]

    def described(self) -> list[str]:
        """Notes: which ops were computed another way in float64, which in float32."""
        notes = []
        if self.wide.forms:
            forms = ", ".join(f"{n} {op}" for op, n in sorted(self.wide.forms.items()))
            notes.append(f"float64 forms of ops ONNX Runtime has no float64 kernel for: {forms}")
        if self.wide.float32:
            ops = ", ".join(f"{len(f.nodes)} {f.op_type}" for f in self.wide.float32)
            notes.append(f"run in float32 (islands: docs/parity.md#float32-islands): {ops}")
        return notes

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def to_float64(model: ir.Model) -> Float64Graph:
    """``model`` widened to float64 in place (:class:`~normexport.verdict.float64.
    Float64Graph`)."""
    return Float64Graph(model)


#: Where ONNX Runtime's errors name the node (its loading errors, its run errors).
_NAMED = (
    r"node with name '([^']*)'",
    r"Name:'([^']*)'",
    r"in node \(([^)]*)\)",
    r"Node \(([^)]*)\)",
)


def _failed_node(text: str) -> str | None:
    """The node ONNX Runtime's error names: the innermost one (a node in an ``If`` is named
    after the ``If``)."""
    for pattern in _NAMED:
        if found := [name for name in re.findall(pattern, text) if name]:
            return found[-1]
    return None


def _said(err: BaseException) -> str:
    """An error in a few words: ONNX Runtime's status without its prefix, else ``one_line``."""
    text = runtime.message(err)
    return text if text and text != str(err) else one_line(err)


#: The most bytes of tensors held in memory (the widened ones, and any not on file) with which
#: the float64 graph is opened from one protobuf, its other tensors read from the model's own
#: external data file, rather than written out whole.
INLINE_BYTES = 2**28


def _float64_session(model: ir.Model, work: Path) -> runtime.OnDemand:
    """A session of the widened ``model``, opened on demand. Where what the widening changed
    is small (a float16 model: its norms' float32 parts) and the rest lies in one folder, the
    graph is given as one protobuf with the widened tensors in it, and the tensors it did not
    change are read from the model's own external data file: nothing is copied. Otherwise the
    float64 model is written to ``work`` (``oracle_float64.onnx``, each tensor widened as it
    is written). One intra-op thread (:data:`THREADS`)."""
    on_file = [v.const_value for g in model.graphs() for v in g.initializers.values()]
    on_file = [t for t in on_file if isinstance(t, ir.ExternalTensor)]
    folders = {Path(t.base_dir).resolve() for t in on_file}
    held = sum(
        v.const_value.nbytes
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None and not isinstance(v.const_value, ir.ExternalTensor)
    )
    if held <= INLINE_BYTES and len(folders) <= 1:
        graph = ir.to_proto(model).SerializeToString()
        folder = next(iter(folders), None)
        return runtime.OnDemand(graph, "cpu", external_data_folder=folder, threads=THREADS)
    path = work / "oracle_float64.onnx"
    files.save_model(model, path, external_data=True)
    return runtime.OnDemand(path, "cpu", threads=THREADS)


def _checked(run: Float64Run, as_written: Run, example, what: str) -> Oracle:
    """``run`` as the oracle, once it agrees with ``as_written`` on the example; the notes say
    how long a run takes."""
    try:
        outputs = run(example)
    except RunTimedOut:
        raise
    except Exception as err:  # a float64 graph that loads but cannot run: fall back
        why = f"{what} in float64 could not be run on ONNX Runtime ({_said(err)})"
        return Oracle(None, "", [why])
    notes = []
    for name, wide, narrow in zip(range(len(outputs)), outputs, as_written(example), strict=True):
        close = closeness(narrow, wide, atol=SELF_CHECK[0], rtol=SELF_CHECK[1])
        rel_l2 = error_metrics(narrow, wide)[1]
        if close.within:
            continue
        if run.wide.quantizes and rel_l2 <= QUANTIZED_SELF_CHECK:
            notes.append(
                f"output {name}: {close.describe()}, relative L2 error {rel_l2:.3g}: the graph "
                "quantizes what it computes, so float32 noise moves its quantized values by a "
                f"step; the self-check took relative L2 error within {QUANTIZED_SELF_CHECK:g}"
            )
            continue
        why = f"{what} in float64 on ONNX Runtime disagrees with the file run as written in "
        why += f"float32 on the example (output {name}: {close.describe()})"
        return Oracle(None, "", [why])
    run.checked = (example, outputs)
    seconds = run.seconds[-1]
    note = f"the oracle is {what} in float64 on ONNX Runtime ({seconds * 1e3:.0f} ms per input set)"
    return Oracle(run, "onnx_float64", [note, *notes])


#: (atol, rtol) of the oracle's self-check against the float32 file: ten times the verdict's
#: defaults, since float32 itself is that far from float64 on deep models; a wrong conversion
#: or kernel is O(1) off.
SELF_CHECK = (1e-3, 1e-2)
#: The self-check of a graph that quantizes values it computes (``DynamicQuantizeLinear``,
#: ``QuantizeLinear`` of an activation): the relative L2 error of each output. Its scales and
#: roundings follow the input, so float32 noise moves whole tensors by one quantization step
#: (a dynamically quantized int8 T5 encoder: 0.8%, max abs 1.3% of max|ref|); a wrong
#: conversion is O(1) off.
QUANTIZED_SELF_CHECK = 5e-2


def _widen(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float32 feeds as float64; every other feed as it is."""
    return {k: _wide(v) for k, v in feeds.items()}


def _wide(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float64) if array.dtype == np.float32 else array


def _float32_bytes(model: ir.Model) -> int:
    """Bytes of the model's float32 initializers (read from their headers, not loaded)."""
    total = 0
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is not None and tensor.dtype == ir.DataType.FLOAT:
                total += tensor.nbytes
    return total


def _torch_float64_bytes(module) -> int:
    """Bytes a float64 copy of a PyTorch model's floating-point parameters and buffers takes."""
    if isinstance(module, torch.export.ExportedProgram):
        tensors = [*module.state_dict.values(), *module.constants.values()]
    else:
        tensors = [*module.parameters(), *module.buffers()]
    return sum(
        8 * t.numel() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def _no_room(what: str, needed: int, memory: int) -> str:
    return (
        f"a float64 copy of {what} would take {needed / 2**30:.1f} GiB, over "
        f"{MEMORY_SHARE:.0%} of this machine's {memory / 2**30:.1f} GiB"
    )
