"""The parity oracle: the most exact run of the model that can be built here, against which
:mod:`normexport.verdict.parity` measures the optimized model, the raw model and PyTorch
float32. :func:`pytorch_float64` and :func:`onnx_float64` build the candidates, each an
:class:`Oracle` (``run`` None, with the reason in its notes, where it cannot be built);
:func:`to_float64` widens an ONNX graph. Which oracle is preferred, what is widened, which
engine runs it and the self-check: docs/parity.md#three-models-many-input-sets-one-oracle.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from onnx_ir import traversal

from fusion.base import Op
from fusion.registry import STASH_NORM_OPS
from normexport import runtime
from normexport.errors import one_line
from normexport.io import files
from normexport.io.eager import Eager
from normexport.io.inputs import memory_bytes
from normexport.io.load import LoadedModel
from normexport.verdict import reference_kernels
from normexport.verdict.parity import closeness

#: The largest share of physical memory the oracle's float64 copy of the weights may take.
MEMORY_SHARE = 0.25
#: The largest float64 graph ``onnx.reference`` is given (it needs one protobuf, which is
#: limited to 2 GiB, and runs in numpy).
REFERENCE_BYTES = 2**30

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
    """

    run: Run | None
    kind: str
    notes: list[str] = dataclasses.field(default_factory=list)
    close: Callable[[], None] | None = None


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
    """The ONNX model at ``source`` (a file, or a model, widened in place) in float64
    (:func:`to_float64`), checked on the example: the float64 run must agree with the file run as
    written in float32 within :data:`SELF_CHECK` (``closeness``'s atol, rtol)
    (docs/parity.md#three-models-many-input-sets-one-oracle).

    Args:
        source: the model file (its external data beside it), or the model.
        as_written: the same model in float32, as written (ONNX Runtime, optimizations off).
        example: feeds for the check (float inputs are cast to float64 on every run).
        work: a scratch folder for the float64 model (and its external data).
        what: how the notes name the model, e.g. ``"the input graph"``.

    Returns:
        an :class:`Oracle` of kind ``"onnx_float64"`` (the notes say which engine runs it), or
        with ``run`` None and the reason.
    """
    model = source if isinstance(source, ir.Model) else ir.load(source)
    needed, memory = 2 * _float32_bytes(model), memory_bytes()
    if memory is not None and needed > memory * MEMORY_SHARE:
        return Oracle(None, "", [_no_room(what, needed, memory)])
    to_float64(model)
    session = _float64_session(model, work)
    try:
        session.open()
    except Exception as err:  # ORT raises its own error types; NOT_IMPLEMENTED is the usual
        ort_error = runtime.message(err)  # the status, without ORT's code prefix
    else:

        def run(feeds):
            return runtime.run(session.open(), _widen(feeds), kept=True)

        found = _checked(run, as_written, example, what, "ONNX Runtime")
        session.close()
        return dataclasses.replace(found, close=session.close if found.run else None)
    return _on_reference(model, needed, (as_written, example), what, ort_error)


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
    is written)."""
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
        return runtime.OnDemand(graph, "cpu", external_data_folder=next(iter(folders), None))
    path = work / "oracle_float64.onnx"
    files.save_model(model, path, external_data=True)
    return runtime.OnDemand(path, "cpu")


def _on_reference(model: ir.Model, needed: int, check, what: str, ort_error: str) -> Oracle:
    """The float64 graph on ``onnx.reference``, where ONNX Runtime could not load it."""
    why = f"ONNX Runtime cannot run {what} in float64 ({ort_error})"
    foreign = sorted({n.domain for n in model.graph.all_nodes() if n.domain not in ("", "ai.onnx")})
    if foreign:
        return Oracle(None, "", [f"{why}, and onnx.reference has no ops of {', '.join(foreign)}"])
    if needed > REFERENCE_BYTES:
        size = f"{needed / 2**30:.1f} GiB"
        return Oracle(None, "", [f"{why}, and it is too large for onnx.reference ({size})"])
    from onnx.reference import ReferenceEvaluator  # imported on demand: it is only a fallback

    ir.external_data.load_to_model(model)  # onnx.reference reads no external data
    proto = ir.serde.serialize_model(model)
    evaluator = ReferenceEvaluator(proto, new_ops=reference_kernels.reference_ops())
    outputs = [v.name for v in model.graph.outputs]

    def run(feeds):
        return evaluator.run(outputs, _widen(feeds))

    oracle = _checked(run, *check, what, "onnx.reference")
    oracle.notes.insert(0, why)
    return oracle


def _checked(run: Run, as_written: Run, example, what: str, engine: str) -> Oracle:
    """``run`` as the oracle, once it agrees with ``as_written`` on the example; the notes name
    the engine and say how long a run takes."""
    try:
        start = time.perf_counter()
        outputs = run(example)
        seconds = time.perf_counter() - start
    except Exception as err:  # a float64 graph that loads but cannot run: fall back
        why = f"{what} in float64 could not be run on {engine} ({one_line(err)})"
        return Oracle(None, "", [why])
    for name, wide, narrow in zip(range(len(outputs)), outputs, as_written(example), strict=True):
        close = closeness(narrow, wide, atol=SELF_CHECK[0], rtol=SELF_CHECK[1])
        if not close.within:
            why = f"{what} in float64 on {engine} disagrees with the file run as written in "
            why += f"float32 on the example (output {name}: {close.describe()})"
            return Oracle(None, "", [why])
    note = f"the oracle is {what} in float64 on {engine} ({seconds * 1e3:.0f} ms per input set)"
    return Oracle(run, "onnx_float64", [note])


#: (atol, rtol) of the oracle's self-check against the float32 file: ten times the verdict's
#: defaults, since float32 itself is that far from float64 on deep models; a wrong conversion
#: or kernel is O(1) off.
SELF_CHECK = (1e-3, 1e-2)


def _widen(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float32 feeds as float64; every other feed as it is."""
    return {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}


def to_float64(model: ir.Model) -> None:
    """Make ``model`` compute in float64 where it computes in float32, in place (see the module
    docstring). Intermediate values lose their type and shape annotations, which ONNX Runtime
    infers again; float16 and bfloat16 values are left as they are. The graph is sorted
    topologically (ONNX Runtime runs unsorted files; ``onnx.reference`` does not)."""
    model.graph.sort()
    for graph in (model.graph, *model.functions.values()):
        for value in getattr(graph, "initializers", {}).values():
            _widen_initializer(value)
        nodes = list(traversal.RecursiveGraphIterator(graph))
        # Read before any annotation is dropped: which inputs were float32 at a float-only place.
        narrow = [(n, i) for n in nodes for i in _float_only_inputs(n, model.opset_imports)]
        for node in nodes:
            _widen_node(node)
        for node, index in narrow:
            _cast_input(node, index, ir.DataType.FLOAT)
        for value in (*graph.inputs, *graph.outputs):
            if value.dtype == ir.DataType.FLOAT:
                value.dtype = ir.DataType.DOUBLE


def _widen_initializer(value: ir.Value) -> None:
    """Make a float32 initializer float64, lazily: the cast runs when the tensor is read (as
    the model is saved, one tensor at a time), so no float64 copy of the weights is ever
    held whole."""
    tensor = value.const_value
    if tensor is not None and tensor.dtype == ir.DataType.FLOAT:
        value.const_value = ir.LazyTensor(
            lambda: ir.tensor(tensor.numpy().astype(np.float64)),
            ir.DataType.DOUBLE,
            tensor.shape,
            name=value.name,
        )
        value.dtype = ir.DataType.DOUBLE


#: Integer attributes that name a data type (float32 ones become float64).
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "stash_type"})


def _widen_node(node: ir.Node) -> None:
    """Widen ``node``'s float32 tensor and type attributes (a norm's stash type too, given or
    not) and forget its outputs' type and shape annotations."""
    if Op(node.op_type, node.domain) in STASH_NORM_OPS and "stash_type" not in node.attributes:
        node.attributes["stash_type"] = ir.AttrInt64("stash_type", ir.DataType.FLOAT)
    for name, attr in list(node.attributes.items()):
        if attr.type == ir.AttributeType.TENSOR and attr.value.dtype == ir.DataType.FLOAT:
            wide = ir.tensor(attr.value.numpy().astype(np.float64))
            node.attributes[name] = ir.AttrTensor(name, wide)
        elif name in _TYPE_ATTRIBUTES and attr.value == ir.DataType.FLOAT:
            node.attributes[name] = ir.AttrInt64(name, ir.DataType.DOUBLE)
    for value in node.outputs:
        if not value.is_graph_output():
            value.type, value.shape = None, None


def _float_only_inputs(node: ir.Node, opsets: Mapping[str, int]) -> list[int]:
    """Indices of ``node``'s inputs that are float32 (as annotated, or an initializer already
    widened) and whose schema admits no float64 (e.g. ``Resize``'s scales)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain, 1), node.domain)
    except onnx.defs.SchemaError:  # not an ONNX op: nothing known
        return []
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    found = []
    for index, value in enumerate(node.inputs):
        formal = schema.inputs[min(index, len(schema.inputs) - 1)]
        types = allowed.get(formal.type_str, {formal.type_str})
        widened = value is not None and (value.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE))
        if widened and "tensor(double)" not in types and "tensor(float)" in types:
            found.append(index)
    return found


def _cast_input(node: ir.Node, index: int, dtype: ir.DataType) -> None:
    """Put a ``Cast(to=dtype)`` in front of ``node``'s input ``index``."""
    value = node.inputs[index]
    cast = ir.node("Cast", [value], {"to": dtype}, name=f"{node.name}_oracle_cast_{index}")
    node.graph.insert_before(node, cast)
    node.replace_input_with(index, cast.outputs[0])


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
