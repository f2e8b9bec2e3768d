"""Int8 (``--precision int8`` / ``int8-dynamic``): the optimized float32 model quantized by ONNX
Runtime's own tools (``onnxruntime.quantization``: :func:`quantize_static` to QDQ with MinMax
calibration, :func:`quantize_dynamic`), after normexport's passes (BatchNorm folded, branches
merged), with the fused norms and Softmax kept in float (:func:`kept_ops`), and the convs
int8 is slower for (:func:`slow_convs`) where the model times faster so; where the int8
budget fails, the layers that cost most (:mod:`normexport.precision.int8_budget`, one at a
time) are kept in float too. Which and why: docs/precision.md#int8.

normexport writes no quantizer of its own: each model here is one call of ONNX Runtime's.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from fusion.registry import FUSED_NORM_OPS
from normexport.errors import UsageError
from normexport.precision.kept import KeptFloat32, decomposed_norms

#: The int8 values of ``--precision``: static (activations calibrated, QDQ) and dynamic
#: (weights int8, activations quantized at run time).
INT8_PRECISIONS = ("int8", "int8-dynamic")
#: Ops kept in float, and why (docs/precision.md#int8): a norm's statistics and Softmax's
#: exponent are where int8 loses most (a norm divides by a standard deviation that an 8-bit
#: input, zero point rounded, moves; Softmax's input range is set by its largest logit), and
#: they are cheap next to the MatMuls and Convs that int8 speeds up.
KEPT_OP_REASONS = {
    **{op.op_type: "norm" for op in FUSED_NORM_OPS},
    "GroupNorm": "norm",
    "Softmax": "softmax",
}
#: A Conv with fewer multiply-adds per output than this (``C_in / group * kh * kw``, the
#: reduction of its GEMM) may stay float (:func:`slow_convs`, reason ``int8_slower``): int8
#: saves time per multiply-add and costs a requantization per output, and ONNX Runtime's int8
#: conv kernels on x86 lose to its float ones below it (depthwise convs, a conv on an image's
#: three channels; the figures: docs/precision.md#int8).
MIN_INT8_MACS = 64


@dataclasses.dataclass
class Int8Report:
    """What the int8 stage did.

    Attributes:
        precision: ``int8`` or ``int8-dynamic``.
        quantizer: ONNX Runtime's function and version that quantized.
        calibration: where the calibration samples came from (``--calibration``'s path, or the
            generated input sets), and how many; None for ``int8-dynamic``.
        kept_float: the nodes left in float (:class:`~normexport.precision.kept.KeptFloat32`).
        published: ``int8``, or ``fp32`` where the float32 optimized model was published.
        why_float32: why float32 was published (int8 slower on this provider, or out of its
            budget with :data:`~normexport.precision.int8_budget.MAX_KEPT_FOR_BUDGET` layers
            kept in float), else None.
    """

    precision: str
    quantizer: str
    calibration: str | None
    kept_float: list[KeptFloat32]
    published: str = "int8"
    why_float32: str | None = None

    def to_dict(self) -> dict:
        """JSON form (``docs/report.md``, ``precision``)."""
        return dataclasses.asdict(self)


def kept_ops(path: Path, refused: Iterable = ()) -> list[KeptFloat32]:
    """The nodes of the model at ``path`` kept in float by op type (:data:`KEPT_OP_REASONS`),
    and the nodes of every norm the fusions refused (``refused``: :class:`fusion.Refused`;
    :func:`normexport.precision.kept.decomposed_norms`), reason ``decomposed_norm``.

    Raises:
        ValueError: a node has no name (ONNX Runtime's exclusion list goes by name; the
            optimized model names every node).
    """
    graph = onnx.load(path, load_external_data=False).graph
    kept = []
    for node in graph.node:
        reason = KEPT_OP_REASONS.get(node.op_type)
        if reason is None:
            continue
        if not node.name:
            raise ValueError(f"a {node.op_type} node has no name")
        detail = (
            "a norm's statistics stay float: int8 input moves the mean and deviation it divides by"
            if reason == "norm"
            else "Softmax stays float: its exponent turns int8 steps of its largest logits into "
            "large relative errors"
        )
        kept.append(KeptFloat32(node.name, node.op_type, reason, detail))
    return [*kept, *decomposed_norms(graph, refused, "int8")]


def slow_convs(path: Path) -> list[KeptFloat32]:
    """The Convs of the model at ``path`` with fewer than :data:`MIN_INT8_MACS` multiply-adds
    per output (:func:`macs_per_output`), as kept in float, reason ``int8_slower``: depthwise
    convs, a first conv on an image's channels. Whether they are kept float is the latency
    verdict's to say (:func:`normexport.pipeline.rewrite.int8`): the float conv is faster, the
    Quantize/DequantizeLinear and layout transposes around it cost, and either may win."""
    graph = onnx.load(path, load_external_data=False).graph
    weights = {t.name: list(t.dims) for t in graph.initializer}
    slow = []
    for node in graph.node:
        macs = macs_per_output(node, weights)
        if macs is None or macs >= MIN_INT8_MACS:
            continue
        detail = (
            f"a conv of {macs} multiply-adds per output: ONNX Runtime's int8 conv is slower "
            f"than its float one below {MIN_INT8_MACS}, and the model timed faster with it float"
        )
        slow.append(KeptFloat32(node.name, node.op_type, "int8_slower", detail))
    return slow


def macs_per_output(node: onnx.NodeProto, weights: Mapping[str, Sequence[int]]) -> int | None:
    """The multiply-adds per output value of a Conv ``node`` whose weight is an initializer
    (``weights``: name -> dims, ``(C_out, C_in / group, kh, kw, ...)``): ``C_in / group``
    times the kernel's size, the reduction of the GEMM it runs as (ONNX ``Conv``); None for
    another op or a weight computed at run time."""
    if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in weights:
        return None
    return int(np.prod(weights[node.input[1]][1:]))


#: The first ai.onnx opset whose DequantizeLinear takes an axis (per-channel weights).
PER_CHANNEL_OPSET = 13


def per_channel_opset(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` at ai.onnx opset :data:`PER_CHANNEL_OPSET` at least (``onnx.version_converter``
    where it is below): ONNX Runtime's quantizer writes per-channel DequantizeLinear nodes
    with an ``axis`` that older opsets refuse (the model then does not load), and per-channel
    weights are what keeps a depthwise conv with a BatchNorm folded in accurate.

    Raises:
        UsageError: the version converter cannot lift the model.
    """
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    if opset >= PER_CHANNEL_OPSET:
        return proto
    from onnx import version_converter

    try:
        return version_converter.convert_version(proto, PER_CHANNEL_OPSET)
    except Exception as err:  # the converter raises bare RuntimeErrors and more
        raise UsageError(
            f"--precision int8: the model is at opset {opset}, and ONNX Runtime's per-channel "
            f"int8 weights need opset {PER_CHANNEL_OPSET}, which onnx's version converter "
            f"cannot lift it to ({type(err).__name__}: {err}): export with --opset 13 or later"
        ) from None


def reduce_range() -> bool:
    """Whether to quantize weights to 7 bits: on an x86 CPU without VNNI (no ``avx512_vnni`` or
    ``avx_vnni`` in ``/proc/cpuinfo``), where ONNX Runtime's U8S8 kernels multiply-add pairs
    into int16 (``VPMADDUBSW``) and saturate on full 8-bit weights (ONNX Runtime's
    quantization docs, "reduce_range")."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" not in flags and "avx_vnni" not in flags


class _Reader:
    """ONNX Runtime's ``CalibrationDataReader``: the calibration feeds, one sample at a time."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]]):
        self._feeds = iter(feeds)

    def get_next(self) -> dict | None:
        """The next sample's feeds, or None at the end."""
        return dict(next(self._feeds, None) or {}) or None


def quantize(
    src: Path,
    dst: Path,
    *,
    precision: str,
    calibration: Sequence[Mapping[str, np.ndarray]],
    kept: Iterable[str],
    external_data: bool,
    cache: Path | None = None,
) -> str:
    """Write the int8 model of the float32 model at ``src`` to ``dst`` by ONNX Runtime's tools,
    the nodes named in ``kept`` left in float: ``int8``, :func:`quantize_static` (QDQ, uint8
    activations and per-channel int8 weights, "U8S8", the form ONNX Runtime's x86 kernels are
    fast for, MinMax calibration on ``calibration``: docs/precision.md#int8); ``int8-dynamic``,
    :func:`quantize_dynamic` (per-channel int8 weights, activations quantized per tensor at
    run time); both with 7-bit weights
    (``reduce_range``) on an x86 CPU without VNNI (:func:`reduce_range`). ``cache``: a JSON
    file of the calibrated ranges, written on the first call and read on the next (one
    calibration per run). Returns the quantizer, in words.
    """
    import onnxruntime

    dst.parent.mkdir(parents=True, exist_ok=True)
    excluded = list(kept)
    root, level = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.ERROR)  # its advice to pre-process: the passes have (BatchNorm folded)
    try:  # and numpy's warnings of its zero points where a tensor's range is empty
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            _quantize(src, dst, precision, calibration, excluded, external_data, cache)
    finally:
        root.setLevel(level)
    _float_inputs(src, dst, set(excluded))
    if precision == "int8-dynamic":
        return (
            f"onnxruntime.quantization.quantize_dynamic {onnxruntime.__version__} "
            "(per-channel weights)"
        )
    return f"onnxruntime.quantization.quantize_static {onnxruntime.__version__} (QDQ U8S8, MinMax)"


def _quantize(src, dst, precision, calibration, excluded, external_data, cache) -> None:
    """One call of ONNX Runtime's quantizer, as :func:`quantize` describes."""
    from onnxruntime import quantization as q

    if precision == "int8-dynamic":
        q.quantize_dynamic(
            src,
            dst,
            weight_type=q.QuantType.QInt8,
            per_channel=True,
            reduce_range=reduce_range(),
            nodes_to_exclude=excluded,
            use_external_data_format=external_data,
        )
    else:
        q.quantize_static(
            src,
            dst,
            _Reader(calibration),
            quant_format=q.QuantFormat.QDQ,
            activation_type=q.QuantType.QUInt8,
            weight_type=q.QuantType.QInt8,
            per_channel=True,
            reduce_range=reduce_range(),
            calibrate_method=q.CalibrationMethod.MinMax,
            nodes_to_exclude=excluded,
            use_external_data_format=external_data,
            calibration_cache_path=cache,
        )


def _float_inputs(src: Path, path: Path, kept: set[str]) -> None:
    """Let each node of ``kept`` read its float inputs: ONNX Runtime's QDQ quantizer leaves an
    excluded node reading a Quantize/DequantizeLinear round trip where the tensor's producer
    was quantized (its output quantized for the int8 kernel after it), so that the node
    excluded still computes on int8-rounded values. Each such input is read from before the
    round trip instead, and the round trips no node reads any more are removed; except where
    the tensor before the round trip is no longer what the float32 model at ``src`` computes
    there: the quantizer removes a Relu or Clip after a quantized node (its clipping done by
    the quantized range: ``QDQKeepRemovableActivations``) and gives the node before it the
    activation's output name, so that the tensor before the round trip is the unclipped one;
    such a node reads the round trip, whose range clips as the activation did."""
    float_graph = onnx.load(src, load_external_data=False).graph
    source = {o: n.name for n in float_graph.node for o in n.output}
    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name for t in graph.initializer}

    def before(name: str) -> str:
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            return name
        qn = producer.get(dq.input[0])
        if qn is None or qn.op_type != "QuantizeLinear" or qn.input[0] in inits:
            return name
        made = producer.get(qn.input[0])
        if (made.name if made is not None else None) != source.get(qn.input[0]):
            return name  # an activation the quantizer removed: the tensor is not its output
        return qn.input[0]

    changed = False
    for node in graph.node:
        if node.name in kept:
            inputs = [before(i) if i else i for i in node.input]
            changed |= inputs != list(node.input)
            node.input[:] = inputs
    if not changed:
        return
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [
            n
            for n in graph.node
            if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.output[0] not in read
        ]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    read = {i for n in graph.node for i in n.input}
    for tensor in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(tensor)  # the removed round trips' scales and zero points
    onnx.save(model, path)
