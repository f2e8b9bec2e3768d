"""The nodes a half-precision model keeps in float32: the norms left decomposed
(:func:`decomposed_norms`) and, for float16, the nodes that read constants it cannot hold
(:func:`unsafe_constants`, :data:`FP16_LOSS`). Which, and why: docs/precision.md#float16
(bfloat16 keeps the first kind only: docs/precision.md#bfloat16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from fusion.registry import DECOMPOSED_FAMILIES

#: The largest finite float16.
FP16_MAX = 65504.0
#: Nonzero magnitudes below this round to zero in float16 (half the smallest subnormal, 2**-24).
FP16_FLUSH = 2.0**-25
#: The largest relative L2 error of an initializer's float16 copy that is float16's own
#: rounding: twice its unit roundoff 2**-11 (IEEE 754 binary16, 11 significant bits); more
#: means subnormals or flushes lost precision.
FP16_LOSS = 2.0**-10
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


@dataclasses.dataclass(frozen=True)
class KeptFloat32:
    """A node a conversion leaves in float32 (half precision, int8), and why.

    Attributes:
        node: its name in the written model.
        op: its op type.
        reason: ``decomposed_norm`` (a norm the fusions refused: float16 would square its
            input, bfloat16 would sum it with 8 significant bits, int8 would move the mean and
            deviation it divides by), ``fp16_overflow`` / ``fp16_underflow`` (it reads an
            initializer or a Constant's value float16 cannot hold, or it is that Constant);
            int8's ``norm`` or ``softmax`` (kept by op type,
            :data:`normexport.precision.int8.KEPT_OP_REASONS`), ``int8_slower`` (a Conv of
            fewer than :data:`normexport.precision.int8.MIN_INT8_MACS` multiply-adds per
            output, where the model timed faster with them float) and ``budget`` (a quantized
            layer that cost the output most, :func:`normexport.precision.int8_budget.layer_costs`).
        detail: one sentence for people.
    """

    node: str
    op: str
    reason: str
    detail: str


def decomposed_norm_nodes(graph: onnx.GraphProto, anchor: str) -> list[str]:
    """The nodes of a norm left decomposed, from its anchor (the division a norm fusion
    refused, found by its name or, for a node the exporter left unnamed, by its first output's:
    :func:`fusion.graph.label`) up to the input its first reduction reads: the
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
    "int8": "in int8 its mean and variance would be computed from rounded values",
}


def decomposed_norms(
    graph: onnx.GraphProto, refused: Iterable, precision: str = "fp16"
) -> list[KeptFloat32]:
    """The nodes of every norm a fusion refused (``refused``: :class:`fusion.Refused`-like,
    with ``kind``, ``node``, ``code``), to be kept in float32 in a ``precision`` model."""
    ops = {n.name: n.op_type for n in graph.node}
    kept: dict[str, KeptFloat32] = {}
    for r in refused:
        if r.family not in DECOMPOSED_FAMILIES:
            continue
        detail = (
            f"part of the {r.family} at {r.node!r} left decomposed ({r.code}): "
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
