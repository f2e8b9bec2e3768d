"""The conversion (:func:`to_half`): ONNX Runtime's float16 converter, with the norms kept safe
and the ops without a kernel blocked, and the fixes normexport makes to the converter's output.

:func:`to_half` loads the optimized model as one protobuf (:func:`load_for_conversion`), finds
the nodes to keep float32 (:func:`normexport.precision.kept.kept_float32`), converts
(:func:`_converted`: every fused norm of :data:`fusion.registry.STASH_NORM_OPS` gets
``stash_type=1``; the converter's repeated casts, float16 round trips between float32 nodes and
rounded constants are undone), retypes to bfloat16 for ``bf16``
(:func:`normexport.precision.bfloat16.to_bfloat16`), and blocks each op type ONNX Runtime
reports no kernel for (:mod:`normexport.precision.kernels`) until the model loads.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from fusion.base import Op
from fusion.registry import SKIP_NORM_OPS, STASH_NORM_OPS
from normexport.errors import UsageError
from normexport.io import files
from normexport.precision import kernels, subgraphs
from normexport.precision.bfloat16 import to_bfloat16
from normexport.precision.kept import KeptFloat32, kept_float32

#: ``--precision`` values; ``fp32`` is the model as optimized.
#: The first ai.onnx opset whose ops take bfloat16 (Cast-13, Add-13, MatMul-13, ...).
BF16_MIN_OPSET = 13
#: Protobuf's limit on one serialized message.
PROTO_LIMIT = 2**31


@dataclasses.dataclass
class PrecisionReport:
    """What the half-precision stage did.

    Attributes:
        precision: ``fp16`` or ``bf16``.
        converter: the converter and version that did the bulk.
        keep_io_types: the model's inputs and outputs stayed float32 (always with ``bf16``).
        stash_float32: names of the fused norms that compute statistics in float32.
        kept_float32: the nodes left in float32 (:class:`KeptFloat32`).
        float32_op_types: op types left in float32 everywhere (no kernel of the target type on
            the provider).
    """

    precision: str
    converter: str
    keep_io_types: bool
    stash_float32: list[str]
    kept_float32: list[KeptFloat32]
    float32_op_types: list[str]

    def to_dict(self) -> dict:
        """JSON form (``docs/report.md``, ``precision``)."""
        return dataclasses.asdict(self)


#: Half-precision initializer types, by the ``--precision`` name of their rule.
_HALF_WEIGHTS = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


def computes_in(model: ir.Model) -> str:
    """The precision the model's weights are in: ``"fp16"`` or ``"bf16"`` where more than half
    of its floating-point initializer bytes are of that type, else ``"fp32"`` (read from the
    tensors' headers). A half-precision model's rounding noise is that of its type, and parity
    judges it by that type's rule (:data:`normexport.verdict.tolerance.HALF_MAX_REL_L2`)."""
    by_type: collections.Counter = collections.Counter()
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is not None and tensor.dtype.is_floating_point():
                by_type[tensor.dtype] += tensor.nbytes
    total = sum(by_type.values())
    return next((k for k, t in _HALF_WEIGHTS.items() if 2 * by_type[t] > total > 0), "fp32")


def model_bytes(path: Path) -> int:
    """The bytes a model file and its external data files hold (without loading them)."""
    total = path.stat().st_size
    proto = onnx.load(path, load_external_data=False)
    locations = {
        entry.value
        for tensor in proto.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return total + sum((path.parent / loc).stat().st_size for loc in locations)


def load_for_conversion(path: Path, precision: str = "fp16") -> onnx.ModelProto:
    """The model at ``path`` as one protobuf, its external data read in.

    Raises:
        UsageError: the model's tensors pass protobuf's 2 GiB limit; ``bf16`` for a model below
            :data:`BF16_MIN_OPSET`.
    """
    size = model_bytes(path)
    if size >= PROTO_LIMIT:
        raise UsageError(
            f"--precision {precision}: the optimized model holds {size / 2**30:.1f} GiB; ONNX "
            "Runtime's float16 converter and its quantizer need it as one protobuf, limited "
            "to 2 GiB: "
            "convert the written model with a tool that streams external data"
        )
    proto = onnx.load(path, load_external_data=True)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    if precision == "bf16" and opset < BF16_MIN_OPSET:
        raise UsageError(
            f"--precision bf16: the model is at opset {opset}, and bfloat16 entered ONNX's ops "
            f"at opset {BF16_MIN_OPSET} (Cast-13 is the first Cast that takes it): export with "
            f"--opset {BF16_MIN_OPSET} or later (an ONNX file: convert it first with "
            "onnx.version_converter), or use --precision fp16"
        )
    return proto


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give every unnamed node, in ``graph`` and its subgraphs, a unique name (the converter's
    block list goes by name, and :func:`subgraphs.input_casts` matches subgraph nodes by it)."""
    graphs = [graph, *subgraphs.subgraphs(graph)]
    taken = {n.name for g in graphs for n in g.node}
    for index, g in enumerate(graphs):
        for i, node in enumerate(g.node):
            if not node.name:
                stem = f"{node.op_type}_half_{i}" + (f"_{index}" if index else "")
                node.name = next(
                    f"{stem}_{j}" for j in range(len(taken) + 1) if f"{stem}_{j}" not in taken
                )
                taken.add(node.name)


def _converted(
    proto: onnx.ModelProto, keep_io_types: bool, nodes: Sequence[str], op_types: Sequence[str]
) -> onnx.ModelProto:
    """A float16 copy of ``proto`` by ONNX Runtime's converter: ``nodes`` and ``op_types``
    (on top of the converter's default op block list) stay float32 with casts around them;
    every fused norm computes its statistics in float32 (``stash_type=1``)."""
    from onnxruntime.transformers import float16

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    converted = float16.convert_float_to_float16(
        copy,
        keep_io_types=keep_io_types,
        op_block_list=[*float16.DEFAULT_OP_BLOCK_LIST, *op_types],
        node_block_list=list(nodes),
    )
    _drop_repeated_casts(converted.graph)
    _skip_round_trips(converted.graph, set(nodes))
    _exact_constants(converted.graph, proto.graph)
    subgraphs.input_casts(converted.graph, proto.graph)
    subgraphs.sort(converted.graph)
    for node in converted.graph.node:
        if Op(node.op_type, node.domain) in STASH_NORM_OPS:
            kept = [a for a in node.attribute if a.name != "stash_type"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("stash_type", 1)])
    return converted


def _drop_repeated_casts(graph: onnx.GraphProto) -> None:
    """Remove the converter's repeated casts: where two float32-kept nodes read the same float16
    value, it inserts one Cast for each, with the same output name (an invalid graph).

    Raises:
        ValueError: two nodes that are not the same Cast write one value.
    """
    seen: dict[str, onnx.NodeProto] = {}
    keep = []
    for node in graph.node:
        first = seen.get(node.output[0]) if node.output else None
        if first is None:
            seen.update((out, node) for out in node.output)
            keep.append(node)
        elif node.op_type != "Cast" or (first.input, first.attribute) != (
            node.input,
            node.attribute,
        ):
            raise ValueError(f"the converter wrote value {node.output[0]!r} twice")
    del graph.node[:]
    graph.node.extend(keep)


def _skip_round_trips(graph: onnx.GraphProto, kept: set[str]) -> None:
    """Between two float32-kept nodes the converter casts to float16 and back (``x**2`` of a
    decomposed norm would overflow there): each such Cast(float32) of a Cast(float16) of a kept
    node's output is bypassed, its readers reading the float32 value, and casts left unread
    are removed."""
    producer = {out: n for n in graph.node for out in n.output}

    def cast_to(node, to):
        return node is not None and node.op_type == "Cast" and node.attribute[0].i == to

    alias = {}
    for node in graph.node:
        first = producer.get(node.input[0]) if node.input else None
        if (
            cast_to(node, onnx.TensorProto.FLOAT)
            and cast_to(first, onnx.TensorProto.FLOAT16)
            and getattr(producer.get(first.input[0]), "name", None) in kept
        ):
            alias[node.output[0]] = first.input[0]
    for node in graph.node:
        node.input[:] = [alias.get(i, i) for i in node.input]
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if n.op_type == "Cast" and n.output[0] not in read]
        if not dead:
            return
        for node in dead:
            graph.node.remove(node)


def _exact_constants(graph: onnx.GraphProto, original: onnx.GraphProto) -> None:
    """Where a float32-kept node reads an initializer through Cast(float32) of its float16
    copy (an eps rounded to float16: 1e-5 becomes 1.0014e-5), it reads the original float32
    tensor instead; float16 initializers no node reads any more are removed."""
    source = {t.name: t for t in original.initializer if t.data_type == onnx.TensorProto.FLOAT}
    inits = {t.name for t in graph.initializer}
    exact = []
    for node in graph.node:
        if (
            node.op_type == "Cast"
            and node.attribute[0].i == onnx.TensorProto.FLOAT
            and node.input[0] in inits
            and node.input[0] in source
        ):
            tensor = onnx.TensorProto()
            tensor.CopyFrom(source[node.input[0]])
            tensor.name = node.output[0]
            exact.append((node, tensor))
    for node, tensor in exact:
        graph.node.remove(node)
        graph.initializer.append(tensor)
    read = subgraphs.names_read(graph)
    unread = [t for t in graph.initializer if t.name not in read]
    for tensor in unread:
        graph.initializer.remove(tensor)


def _write_half(
    proto: onnx.ModelProto,
    original: ir.Model,
    dst: Path,
    *,
    precision: str,
    keep_io_types: bool,
    nodes: Sequence[str],
    op_types: Sequence[str],
    external_data: bool,
) -> onnx.ModelProto:
    """Convert ``proto`` (:func:`_converted`; retyped by
    :func:`normexport.precision.bfloat16.to_bfloat16` for ``bf16``, ``original`` being ``proto`` in
    onnx-ir), sort it and write it to ``dst``; returns the converter's float16 model."""
    converted = _converted(proto, keep_io_types, nodes, op_types)
    model = ir.serde.deserialize_model(converted)
    if precision == "bf16":
        to_bfloat16(model, original)
    model.graph.sort()  # the converter appends its casts at the end
    for path in (dst, files.data_path(dst)):
        path.unlink(missing_ok=True)
    files.save_model(model, dst, external_data=external_data)
    return converted


def to_half(
    src: Path,
    dst: Path,
    *,
    precision: str = "fp16",
    provider: str,
    keep_io_types: bool,
    refused: Iterable = (),
    external_data: bool,
) -> PrecisionReport:
    """Write a float16 (``fp16``) or bfloat16 (``bf16``) copy of the model at ``src`` to ``dst``
    (see :mod:`normexport.precision`).

    Args:
        src: the optimized float32 model (its external data beside it).
        dst: where to write the half-precision model (``dst`` + ``.data`` with
            ``external_data``).
        precision: ``fp16`` or ``bf16``.
        provider: ``cpu`` or ``cuda``: whose kernels of the target type are asked for.
        keep_io_types: keep float32 graph inputs and outputs (casts inside); ``bf16`` always
            does.
        refused: the fusions' refusals (:class:`fusion.Refused`): the norms left decomposed.
        external_data: write the tensors to ``dst`` + ``.data``.

    Raises:
        UsageError: the model passes protobuf's 2 GiB limit; ``bf16`` where the provider has no
            bfloat16 kernel for :func:`kernels.must_run_in_half` ops (:func:`kernels.bf16_refusal`).
        RuntimeError: ONNX Runtime reports a missing kernel for ops already float32 (a bug).
    """
    from onnxruntime import __version__ as ort_version

    proto = load_for_conversion(src, precision)
    name_nodes(proto.graph)
    original = ir.serde.deserialize_model(proto)
    keep_io_types = keep_io_types or precision == "bf16"
    kept = kept_float32(proto.graph, refused, precision)
    heavy, op_types = kernels.must_run_in_half(original), []
    while True:
        converted = _write_half(
            proto,
            original,
            dst,
            precision=precision,
            keep_io_types=keep_io_types,
            nodes=[k.node for k in kept],
            op_types=op_types,
            external_data=external_data,
        )
        missing = kernels.missing_kernel(dst, provider)
        if missing is None:
            break
        blocked = kernels.to_block(missing, converted, op_types)
        op_types += blocked
        if precision == "bf16" and heavy.intersection(blocked):
            raise UsageError(kernels.bf16_refusal(provider, op_types, heavy))
    converter = f"onnxruntime.transformers.float16 {ort_version}"
    if precision == "bf16":
        converter += ", retyped to bfloat16 by normexport"
    stash = _stash_norms(converted, {k.node for k in kept}, op_types)
    return PrecisionReport(precision, converter, keep_io_types, stash, kept, op_types)


def _stash_norms(model: onnx.ModelProto, kept: Iterable[str], op_types: Sequence[str]) -> list[str]:
    """Names of the fused norms of ``model`` that take half-precision input and compute their
    statistics in float32: neither in ``kept`` (nodes) nor of ``op_types`` (float32 op types)."""
    return [
        n.name
        for n in model.graph.node
        if Op(n.op_type, n.domain) in (*STASH_NORM_OPS, *SKIP_NORM_OPS)
        and n.name not in set(kept)
        and n.op_type not in op_types
    ]
