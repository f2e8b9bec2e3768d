"""Half precision (``--precision fp16|bf16``): convert the optimized model to float16 or
bfloat16 with the norms kept safe.

The bulk of the work is ONNX Runtime's own converter,
``onnxruntime.transformers.float16.convert_float_to_float16``. It is chosen over
onnxconverter-common's converter (which it is derived from) because it ships inside the
onnxruntime package normexport already depends on (no new dependency), it is maintained with the
ONNX Runtime ops it must understand (the com.microsoft norms, GroupNorm, Resize's float inputs),
and it takes a node block list and an op block list, casting around blocked nodes. What
normexport adds on top:

- **fused norms** (LayerNormalization, RMSNormalization, SimplifiedLayerNormalization) take
  float16 input and compute their statistics in float32: ``stash_type=1`` is written on each
  (ONNX spec, LayerNormalization: "stash_type: type of Mean and InvStdDev"; it is the default,
  set explicitly so that no later tool reads it otherwise). ONNX Runtime's
  SkipLayerNormalization / SkipSimplifiedLayerNormalization have no such attribute; its CPU
  provider computes their statistics in float32 for float16 input (asked of ONNX Runtime in
  ``tests/normexport/test_precision.py``, inputs of magnitude 1e3 stay finite and exact to
  float16 rounding).
- **norms left decomposed** (a fusion refused them) are kept in float32, with casts around
  them: a hand-written norm in float16 squares its input, and ``x**2`` overflows float16 above
  ``|x| = 256``.
- **constants that float16 cannot hold** (a BatchNorm folded with a tiny running variance
  gives a huge scale, a huge one a tiny scale; the fold computes in float64 and stores
  float32): every node with a float initializer that overflows float16 (``|v| > 65504``), or
  whose float16 copy loses more than float16's own rounding (relative L2 error of the cast
  above :data:`FP16_LOSS`: its values are mostly subnormal or flush to zero), stays in float32,
  where the converter would silently clamp it. A few tiny values among normal ones (trained
  weights have them) are no loss: in any product ``w @ x`` their flush moves the result by
  ``||dw|| ||x||``, less than the rounding of the other values, ``2**-11 ||w|| ||x||``.
- **ops without a float16 kernel** on the provider stay float32: the converted model is loaded
  in an ONNX Runtime session, and each op type it reports NOT_IMPLEMENTED for is blocked, until
  it loads (the kernel question: :mod:`normexport.precision.kernels`).

The converter works on one ``onnx.ModelProto``: models whose tensors pass protobuf's 2 GiB
limit are refused (:class:`normexport.errors.UsageError`) rather than held in one protobuf.

**bfloat16** (``bf16``) is the float16 conversion above (same block lists, same fixes), then
retyped to bfloat16 (:mod:`normexport.precision.bfloat16`: constants rounded from their float32
originals; decomposed norms stay float32, constants are not kept for their range; inputs and
outputs stay float32). Where the provider has no bfloat16 kernel for the model's linear ops
(the norms where it has none; any op where it has neither), the conversion is refused
(:class:`normexport.errors.UsageError`, :func:`normexport.precision.kernels.bf16_refusal`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from normexport.errors import UsageError
from normexport.io import files
from normexport.precision import kernels
from normexport.precision.bfloat16 import to_bfloat16
from normexport.precision.kernels import SKIP_NORMS, STASH_NORMS

#: ``--precision`` values; ``fp32`` is the model as optimized.
PRECISIONS = ("fp32", "fp16", "bf16")
#: The element type of each half precision, by ``--precision`` value.
HALF_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
#: The largest finite float16.
FP16_MAX = 65504.0
#: Nonzero magnitudes below this round to zero in float16 (half the smallest subnormal, 2**-24).
FP16_FLUSH = 2.0**-25
#: The largest relative L2 error of an initializer's float16 copy that is float16's own
#: rounding: twice its unit roundoff 2**-11 (IEEE 754 binary16, 11 significant bits); more
#: means subnormals or flushes lost precision.
FP16_LOSS = 2.0**-10
#: Fusion families whose refused candidates stay decomposed in the model.
DECOMPOSED_FAMILIES = ("layernorm", "rmsnorm", "instancenorm")
#: Ops a decomposed norm's statistics pass through (where the walk up from its division stops).
_REDUCE = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2")
#: Ops between a norm's input and its reduction: the square (``Pow(x, 2)``, ``Mul(x, x)``) and
#: an upcast; a norm's nodes start at the value they come from.
_TO_REDUCE = ("Pow", "Mul", "Cast")
#: How many nodes up from the anchor a decomposed norm may span.
_NORM_DEPTH = 12
#: Float constants this large are fill values, not weights: the attention-mask fills -1e9,
#: -1e30 and ``finfo(float32).min`` (about -3.4e38); no trained weight, statistic or folded
#: scale comes near (a folded BatchNorm's scale is at most ``1 / sqrt(eps)`` times a weight).
#: The converter clamps them to -65504 / 65504, ``finfo(float16).min`` / ``max``: the fill a
#: float16 model uses, where keeping the reader float32 would only move the overflow to the
#: next cast, -inf (a row masked throughout then gives NaN in softmax).
FP32_FILL = 1e9
#: The first ai.onnx opset whose ops take bfloat16 (Cast-13, Add-13, MatMul-13, ...).
BF16_MIN_OPSET = 13
#: Protobuf's limit on one serialized message.
PROTO_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
class KeptFloat32:
    """A node left in float32 in the half-precision model, and why.

    Attributes:
        node: its name in the written model.
        op: its op type.
        reason: ``decomposed_norm`` (a norm the fusions refused: float16 would square its
            input, bfloat16 would sum it with 8 significant bits), ``fp16_overflow`` /
            ``fp16_underflow`` (it reads an initializer or a Constant's value float16 cannot
            hold, or it is that Constant).
        detail: one sentence for people.
    """

    node: str
    op: str
    reason: str
    detail: str


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


def check_precision(precision: str) -> None:
    """Refuse an unknown ``--precision`` (whether ``bf16`` can be delivered is asked of ONNX
    Runtime when converting, :func:`to_half`).

    Raises:
        UsageError: a value not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")


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
            "Runtime's float16 converter needs it as one protobuf, which is limited to 2 GiB: "
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


def decomposed_norm_nodes(graph: onnx.GraphProto, anchor: str) -> list[str]:
    """The nodes of a norm left decomposed, from its anchor (the division a norm fusion
    refused, found by its name or, for a node the exporter left unnamed, by its first output's:
    :func:`fusion._ir.label`) up to the input its first reduction reads: the
    centring, the square, the reductions, eps and the root.

    Returns:
        Node names in graph order ([] where ``anchor`` is no node or no reduction is above it).
    """
    producer = {out: n for n in graph.node for out in n.output}
    start = next((n for n in graph.node if n.name == anchor), None) or next(
        (n for n in graph.node if n.output and n.output[0] == anchor), None
    )
    if start is None:
        return []
    above, frontier = {start.name: start}, [start]
    for _ in range(_NORM_DEPTH):
        frontier = [producer[i] for n in frontier for i in n.input if i in producer]
        frontier = [n for n in frontier if n.name not in above]
        above.update((n.name, n) for n in frontier)
    reductions = [n for n in above.values() if n.op_type in _REDUCE]
    if not reductions:
        return []
    sources = {_reduced_value(r.input[0], producer, above) for r in reductions}
    inside = {name for v in sources for name in _between(v, start, above)}
    read = {i for n in graph.node if n.name in inside for i in n.input}
    for node in graph.node:  # its eps and exponents: Constant nodes only it reads
        readers = {m.name for m in graph.node if set(node.output) & set(m.input)}
        if node.op_type == "Constant" and set(node.output) & read and readers <= inside:
            inside.add(node.name)
    return [n.name for n in graph.node if n.name in inside]


def _reduced_value(
    value: str, producer: Mapping[str, onnx.NodeProto], nodes: Mapping[str, onnx.NodeProto]
) -> str:
    """The value a reduction's input is computed from by a square or a cast (``x`` of
    ``ReduceMean(Pow(Cast(x), 2))``, an RMSNorm's), walking up through :data:`_TO_REDUCE` nodes
    of ``nodes``; a Mul only where it squares (both inputs one value)."""
    node = producer.get(value)
    while (
        node is not None
        and node.name in nodes
        and node.op_type in _TO_REDUCE
        and (node.op_type != "Mul" or node.input[0] == node.input[1])
    ):
        value = node.input[0]
        node = producer.get(value)
    return value


def _between(source: str, end: onnx.NodeProto, nodes: Mapping[str, onnx.NodeProto]) -> set[str]:
    """Names of the nodes in ``nodes`` (ancestors of ``end``, and ``end``) that read value
    ``source``, directly or through each other: the nodes on a path from it to ``end``."""
    reached, values, changed = set(), {source}, True
    while changed:
        changed = False
        for name, node in nodes.items():
            if name not in reached and values.intersection(node.input):
                reached.add(name)
                values.update(node.output)
                changed = True
    return reached


def unsafe_constants(graph: onnx.GraphProto) -> list[KeptFloat32]:
    """The nodes that read a float constant (an initializer, or a Constant node's value)
    float16 cannot hold: a value above :data:`FP16_MAX` in magnitude (overflow), or a float16
    copy whose relative L2 error passes :data:`FP16_LOSS` (values subnormal or flushed to zero:
    underflow). Each such node stays float32, and so does the Constant node (the converter
    would clamp the values). Fill values (:data:`FP32_FILL`) are left out: clamped, they are
    float16's own fill."""
    bad: dict[str, str] = {}
    for name, what, value in _float_constants(graph):
        value = value[np.abs(value) < FP32_FILL]
        mag = np.abs(value)
        if mag.size and mag.max() > FP16_MAX:
            bad[name] = f"fp16_overflow:{what}: max |value| {mag.max():.3g} > {FP16_MAX:g}"
        elif (loss := _float16_loss(value)) > FP16_LOSS:
            flushed = int(np.count_nonzero((mag > 0) & (mag < FP16_FLUSH)))
            bad[name] = (
                f"fp16_underflow:{what}: its float16 copy is {loss:.2g} off (relative L2), "
                f"{flushed} of {mag.size} values flush to 0"
            )
    kept = []
    for node in graph.node:
        for name in (v for v in (*node.input, *node.output[:1]) if v in bad):
            reason, detail = bad[name].split(":", 1)
            kept.append(KeptFloat32(node.name, node.op_type, reason, detail))
            break
    return kept


def _float_constants(graph: onnx.GraphProto) -> Iterator[tuple[str, str, np.ndarray]]:
    """``(value name, how to name it for people, float64 values)`` of every float32 / float64
    initializer and Constant node value of ``graph``."""
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
    for tensor in graph.initializer:
        if tensor.data_type in floats:
            yield tensor.name, f"initializer {tensor.name}", _as_float64(tensor)
    for node in graph.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        for attr in node.attribute:
            if attr.name == "value" and attr.t.data_type in floats:
                yield node.output[0], f"constant {node.output[0]}", _as_float64(attr.t)
            elif attr.name in ("value_float", "value_floats"):
                value = np.asarray(onnx.helper.get_attribute_value(attr), np.float64)
                yield node.output[0], f"constant {node.output[0]}", value


def _as_float64(tensor: onnx.TensorProto) -> np.ndarray:
    return numpy_helper.to_array(tensor).astype(np.float64)


def _float16_loss(value: np.ndarray) -> float:
    """Relative L2 error of ``value`` (float64) stored as float16, for values float16 can hold
    (0 for a zero tensor)."""
    norm = np.linalg.norm(value)
    if norm == 0:
        return 0.0
    with np.errstate(over="ignore"):
        return float(np.linalg.norm(value.astype(np.float16).astype(np.float64) - value) / norm)


#: Why a decomposed norm stays float32, by target precision.
_DECOMPOSED_RISK = {
    "fp16": "in float16 it would square its input, which overflows above |x| = 256",
    "bf16": "in bfloat16 it would sum its input with 8 significant bits, and its mean and "
    "variance would keep few correct ones",
}


def decomposed_norms(
    graph: onnx.GraphProto, refused: Iterable, precision: str = "fp16"
) -> list[KeptFloat32]:
    """The nodes of every norm a fusion refused (``refused``: :class:`fusion.Refused`-like,
    with ``kind``, ``node``, ``code``), to be kept in float32 in a ``precision`` model."""
    ops = {n.name: n.op_type for n in graph.node}
    kept: dict[str, KeptFloat32] = {}
    for r in refused:
        if r.kind not in DECOMPOSED_FAMILIES:
            continue
        detail = (
            f"part of the {r.kind} at {r.node!r} left decomposed ({r.code}): "
            + _DECOMPOSED_RISK[precision]
        )
        for name in decomposed_norm_nodes(graph, r.node):
            kept.setdefault(name, KeptFloat32(name, ops[name], "decomposed_norm", detail))
    return list(kept.values())


def kept_float32(graph: onnx.GraphProto, refused: Iterable, precision: str) -> list[KeptFloat32]:
    """The nodes a ``precision`` copy of ``graph`` keeps in float32: the norms left decomposed
    (:func:`decomposed_norms`), and for ``fp16`` the nodes reading constants float16 cannot hold
    (:func:`unsafe_constants`; bfloat16 has float32's exponent range)."""
    kept = decomposed_norms(graph, refused, precision)
    if precision == "fp16":
        kept += [k for k in unsafe_constants(graph) if k.node not in {c.node for c in kept}]
    return kept


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Give every unnamed node a unique name (the converter's block list goes by name)."""
    taken = {n.name for n in graph.node}
    for i, node in enumerate(graph.node):
        if not node.name:
            node.name = next(
                f"{node.op_type}_half_{i}_{j}"
                for j in range(len(taken) + 1)
                if f"{node.op_type}_half_{i}_{j}" not in taken
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
    for node in converted.graph.node:
        if node.op_type in STASH_NORMS:
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
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
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
    (see the module docstring).

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
    _name_nodes(proto.graph)
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
        if n.op_type in (*STASH_NORMS, *SKIP_NORMS)
        and n.name not in set(kept)
        and n.op_type not in op_types
    ]


def cast_feeds(session, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with each float array cast to the float type ``session`` declares for it
    (float16 inputs of a converted model without ``--keep-io-types``)."""
    types = {i.name: i.type for i in session.get_inputs()}
    out = {}
    for name, array in feeds.items():
        if types.get(name) == "tensor(float16)" and array.dtype != np.float16:
            array = array.astype(np.float16)
        out[name] = array
    return out


#: The overflow probe's input set name.
OVERFLOW_PROBE = "overflow_outliers"


#: One feature in this many on the last axis of an overflow probe's input is an outlier.
OUTLIER_STRIDE = 8
#: The outliers' magnitude: squared, as a hand-written norm squares them, they pass float16's
#: largest finite value 65504 (256**2 = 65536).
OUTLIER_SCALE = 1e3


def with_outliers(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float64 values of ``shape``, one feature in :data:`OUTLIER_STRIDE` on
    the last axis times :data:`OUTLIER_SCALE` (transformer hidden states carry such outliers;
    Dettmers et al. 2022, "LLM.int8()")."""
    out = rng.standard_normal(shape)
    if out.ndim:
        out[..., ::OUTLIER_STRIDE] *= OUTLIER_SCALE
    return out


def overflow_set(example: Mapping[str, np.ndarray], seed: int = 2) -> dict[str, dict]:
    """The overflow probe, ``{OVERFLOW_PROBE: feeds}``: each float input standard normal, with
    one feature in eight on the last axis an outlier of magnitude about 1e3 (transformer hidden
    states carry such outliers): squared, as a hand-written norm squares them, they pass float16's
    65504. Integer inputs as in ``example``; {} where there is no float input."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, array in example.items():
        if np.issubdtype(array.dtype, np.floating):
            array = with_outliers(rng, array.shape).astype(array.dtype)
        feeds[name] = array
    changed = any(feeds[k] is not example[k] for k in feeds)
    return {OVERFLOW_PROBE: feeds} if changed else {}


def rounded_feeds(
    feeds: Mapping[str, np.ndarray], precision: str = "fp16"
) -> dict[str, np.ndarray]:
    """``feeds`` with every float array rounded to the half type of ``precision``
    (:data:`HALF_TYPES`) and back to its own dtype (the half-precision parity rule's input
    rounding, :func:`normexport.verdict.parity.compare`); other arrays as they are. Values beyond
    float16's range become Inf, as the model's own float16 inputs would.
    """
    half = HALF_TYPES[precision].numpy()
    out = {}
    for name, array in feeds.items():
        if np.issubdtype(array.dtype, np.floating):
            with np.errstate(over="ignore"):
                array = array.astype(half).astype(array.dtype)
        out[name] = array
    return out
