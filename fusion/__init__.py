"""ONNX graph passes: fold BatchNorm, merge re-parameterizable blocks, fuse LayerNorm and RMSNorm
(and, for ONNX Runtime, attention and GELU). Usable alone on any .onnx::

    import onnx_ir as ir
    import fusion

    model = ir.load("model.onnx")
    report = fusion.optimize(model, target="ort")   # in place
    ir.save(model, "model.opt.onnx")
    fusion.check("model.opt.onnx")
    print(report.to_dict(fusion.FUSION_KINDS))

Every rewrite is exact (up to float rounding): a candidate that cannot be expressed exactly by
the fused op is left alone and recorded in the report with its reason.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import onnx
import onnx_ir as ir

from fusion import registry
from fusion._ir import KnownShapes, fully_known, label, opset_version
from fusion.base import (
    MS_DOMAIN,
    TARGETS,
    CannotFuse,
    Code,
    Fused,
    FusionPass,
    FusionReport,
    Kind,
    NodeFusionPass,
    Op,
    Refused,
)
from fusion.cleanup import Cleanup, SimplifyWithShapes, cleanup, normalize_ir_version
from fusion.fuse_skip import FuseSkip
from fusion.registry import FUSION_KINDS, KINDS, NORM_OPS, PASSES, ort_registered

__all__ = [
    "FUSION_KINDS",
    "KINDS",
    "NORM_OPS",
    "PASSES",
    "TARGETS",
    "CannotFuse",
    "Code",
    "Fused",
    "FusionPass",
    "DropShapes",
    "FillShapes",
    "FusionReport",
    "Kind",
    "NodeFusionPass",
    "Op",
    "Refused",
    "check",
    "cleanup",
    "norm_ops",
    "onnxruntime_ops",
    "optimize",
    "ort_registered",
    "registry",
]


def optimize(
    model: ir.Model,
    *,
    target: str = "ort",
    skip: bool | str = False,
    attention: bool | None = None,
    gqa: bool | None = None,
    exclude: Collection[Fused] = (),
) -> FusionReport:
    """Fold BatchNorm and fuse LayerNorm / RMSNorm in ``model``, in place.

    Runs, as one :class:`onnx_ir.passes.PassManager`: exact clean-up (constant folding, CSE,
    dead nodes), :class:`FillShapes` (ONNX shape inference for the values that carry no shape,
    as the TorchScript exporter leaves them; :class:`DropShapes` takes them off again after the
    passes), the exact rewrites those shapes allow (:class:`fusion.cleanup.SimplifyWithShapes`),
    then each pass of :data:`fusion.registry.PASSES` that is enabled for ``target``
    and the options, in the registry's order (FoldBatchNorm first, FuseSkip last), then
    clean-up again. An op is only emitted where the model's opset (or, for ``target="ort"``,
    ONNX Runtime) has it; the opset is raised in two cases only, to 23: by
    FuseGroupQueryAttention, for a decoder's attention with a KV cache or a run-time mask
    (:mod:`fusion.fuse_gqa.standard`), and by FuseSDPA, for an attention it makes ONNX's
    ``Attention`` (:mod:`fusion.fuse_sdpa`); each is said in the report's notes.

    Args:
        model: the model, changed in place.
        target: one of :data:`TARGETS`.
        skip: also fuse residual Add + norm into com.microsoft Skip(Simplified)LayerNormalization
            (:mod:`fusion.fuse_skip`): a speed choice per execution provider, not an exactness
            one; ``"kv_cache"``: all only in a model with a KV cache (a decode step's attention
            with a past, fused), elsewhere only where the Skip op also absorbs a dense layer's
            bias Add. Needs ``target="ort"``.
        attention, gqa: fuse attention and GELU into com.microsoft ops with onnxscript's rules
            (:mod:`fusion.fuse_attention`); decoder attention into GroupQueryAttention
            (:mod:`fusion.fuse_gqa`). None (default): for ``target="ort"`` only.
        exclude: rewrites to leave out, as an earlier run on the same model reported them
            (their ``kind`` and ``node``): the pass that makes that kind skips the candidate
            anchored there, and records nothing for it (see :class:`FusionPass`).

    Returns:
        What was fused, and what was refused with the reason, in pass order.

    Raises:
        ValueError: ``target`` is not one of :data:`TARGETS`, or ``skip``, ``attention`` or
            ``gqa`` without ``"ort"``, or ``skip`` neither a bool nor ``"kv_cache"``.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: choose one of {TARGETS}")
    passes = _passes(target, {"skip": skip, "attention": attention, "gqa": gqa}, exclude)
    report = FusionReport()
    if (note := normalize_ir_version(model)) is not None:
        report.note(note)
    fill = FillShapes()
    steps = [Cleanup(), fill, SimplifyWithShapes(), *passes, DropShapes(fill), Cleanup(final=True)]
    ir.passes.PassManager(steps)(model)
    for fusion_pass in passes:
        report.extend(fusion_pass.outcomes)
    _drop_removed_batchnorms(report, model)
    _import_ms_domain(model)
    return report


def _passes(target: str, options: dict, exclude: Collection[Fused]) -> list[FusionPass]:
    """The passes :func:`optimize` runs for ``target`` and ``options`` (its keywords), each
    told the rewrites to leave out.

    Raises:
        ValueError: an option asked for without ``target="ort"``, or ``skip`` neither a bool
            nor ``"kv_cache"``.
    """
    if options["skip"] not in (True, False, "kv_cache"):
        raise ValueError(f"skip={options['skip']!r}: give True, False or 'kv_cache'")
    for name, wanted in options.items():
        if wanted and target != "ort":
            raise ValueError(f"{name}=True emits com.microsoft ops: it needs target='ort'")
    passes = [
        p(target, exclude={f.node for f in exclude if f.kind in {k.name for k in p.kinds}})
        for p in PASSES
        if p.enabled(target, options)
    ]
    for fusion_pass in passes:
        if isinstance(fusion_pass, FuseSkip):
            fusion_pass.kv_cache_only = options["skip"] == "kv_cache"
    return passes


def _import_ms_domain(model: ir.Model) -> None:
    """Declare com.microsoft version 1 (the contrib ops' only version) where a pass emitted a
    node of that domain, in any subgraph too, and the model does not import it: ONNX Runtime
    runs such a model, but ONNX's shape inference and checker refuse it ("No opset import for
    domain com.microsoft"), and so does every tool built on them (float16 converters)."""
    if MS_DOMAIN in model.opset_imports:
        return
    if any(n.domain == MS_DOMAIN for n in ir.traversal.RecursiveGraphIterator(model.graph)):
        model.opset_imports[MS_DOMAIN] = 1


def _drop_removed_batchnorms(report: FusionReport, model: ir.Model) -> None:
    """A BatchNorm one pass left alone and a later one removed (an identity branch's, merged
    with its block by MergeBranches) is no longer left alone: drop its refusal."""
    labels = {label(node) for node in model.graph}
    report.refused = [r for r in report.refused if r.kind != "batchnorm" or r.node in labels]


class FillShapes(ir.passes.InPlacePass):
    """Give each main-graph node output that carries no shape (or no element type) the one
    ONNX shape inference finds (:class:`fusion._ir.KnownShapes`: onnx_ir's
    ``ShapeInferencePass`` on a clone, initializers over 1 KB left out of the protobuf, so
    external data and the 2 GiB limit do not matter), or where that one leaves dimensions
    unknown, ONNX Runtime's symbolic shape inference (:mod:`fusion._symbolic`: the head count of
    ``view(B, S, -1, H)``). The matchers need ranks, head and channel counts; the TorchScript
    exporter writes none for intermediate values.

    A dimension or type the model already carries is never replaced (the dynamo exporter's
    symbolic dimensions say more than inference's); only its unknown dimensions are filled
    (:func:`_filled`). Where inference fails or finds nothing the value stays as it is: the
    passes then refuse what needs a shape, as before. The shapes are scaffolding for the passes:
    :class:`DropShapes` (run after them) takes them off again, except where a node a pass made
    reads or writes the value, so that the other values and the clean-up after the passes are as
    they would be without them.

    Attributes:
        filled: ``(value, its shape, its type)`` before, for each value given something.
        nodes: the main graph's nodes when it ran.
    """

    def __init__(self):
        super().__init__()
        self.filled: list[tuple[ir.Value, ir.Shape | None, ir.TypeProtocol | None]] = []
        self.nodes: set[ir.Node] = set()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        shapes = KnownShapes(model)
        self.nodes = set(model.graph)
        self.filled = []
        for value in (v for node in model.graph for v in node.outputs):
            shape = _filled(value.shape, shapes(value) if not fully_known(value.shape) else None)
            dtype = shapes.dtype(value) if value.dtype is None else None
            if shape is not None or dtype is not None:
                self.filled.append((value, value.shape, value.type))
            if shape is not None:
                value.shape = shape.copy()
            if dtype is not None:
                value.dtype = dtype
        return ir.passes.PassResult(model, modified=bool(self.filled))


def _filled(own: ir.Shape | None, inferred: ir.Shape | None) -> ir.Shape | None:
    """The shape :class:`FillShapes` gives a value that carries ``own``: ``inferred`` where it
    carries none, ``own`` with its unknown dimensions (no number, no name) taken from
    ``inferred`` where the ranks agree (the dynamo exporter writes a Reshape to a target computed
    at run time with no dimension known); None where that adds nothing."""
    if own is None or inferred is None:
        return inferred
    if len(own) != len(inferred):
        return None
    pairs = zip(own, inferred, strict=True)
    dims = [o if isinstance(o, int) or o.value is not None else i for o, i in pairs]
    return ir.Shape(dims) if dims != list(own) else None


class DropShapes(ir.passes.InPlacePass):
    """Take the shapes and types that ``fill`` (a :class:`FillShapes` that has run) put on off
    the values that no node made since reads or writes and that are no graph output (a rewrite
    that made one an output, e.g. a Conv that absorbed the BatchNorm after it, keeps its type).

    Args:
        fill: the FillShapes pass run before the fusion passes.
    """

    def __init__(self, fill: FillShapes):
        super().__init__()
        self.fill = fill

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for value, shape, type_ in self.fill.filled:
            nodes = [value.producer(), *(use.node for use in value.uses())]
            if value.is_graph_output():  # made one by a rewrite: an output needs its type
                continue
            if all(node in self.fill.nodes for node in nodes if node is not None):
                value.shape, value.type = shape, type_
        return ir.passes.PassResult(model, modified=False)


def check(model: ir.Model | str | os.PathLike, *, full_check: bool = True) -> None:
    """Run the ONNX checker on a model file, or on an in-memory model.

    A model is checked from a file, never as one protobuf in memory: the checker then resolves
    external data itself and handles models over protobuf's 2 GiB limit. An in-memory model is
    written to a temporary folder first (with external data).

    The ONNX Runtime ops (:func:`ort_registered`) live in the default domain, where the
    checker looks them up among the standard ops and fails; they are checked as custom-domain
    ops instead, on a copy of the graph (no tensors) written beside the model file, so that
    every standard op is still fully checked. Loading the model in an ONNX Runtime session
    validates those nodes themselves.

    Args:
        model: an .onnx path, or an onnx_ir model.
        full_check: also run ONNX shape inference in strict mode (``check_model``'s
            ``full_check``).

    Raises:
        onnx.checker.ValidationError: the model is not valid ONNX.
        onnx.shape_inference.InferenceError: with ``full_check``, shapes contradict each other.
    """
    if isinstance(model, ir.Model):
        with tempfile.TemporaryDirectory(prefix="normexport-check-") as tmp:
            path = Path(tmp) / "model.onnx"
            ir.save(model, path, external_data="model.onnx.data", size_threshold_bytes=1024)
            check(path, full_check=full_check)
        return
    path = Path(model)
    proto = onnx.load(path, load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    ort_nodes = [n for n in proto.graph.node if ort_registered(n.op_type, n.domain, opset)]
    if not ort_nodes:
        onnx.checker.check_model(path, full_check=full_check)
        return
    for node in ort_nodes:
        node.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    # Beside the model, so that its external data paths resolve from the copy too.
    fd, copy = tempfile.mkstemp(dir=path.parent, prefix=".check-", suffix=".onnx")
    os.close(fd)
    try:
        onnx.save(proto, copy)
        onnx.checker.check_model(copy, full_check=full_check)
    finally:
        os.unlink(copy)


def onnxruntime_ops(model: ir.Model) -> dict[str, int]:
    """How many nodes of each op the model holds, subgraphs included (a GroupQueryAttention
    behind an If), that only ONNX Runtime runs (zeros left out): com.microsoft contrib ops as
    ``com.microsoft.OpType``, and the ops ONNX Runtime registers in the default domain where
    ONNX has none at the model's opset (:func:`ort_registered`: SimplifiedLayerNormalization,
    LayerNormalization below 17)."""
    opset = opset_version(model)
    counts = Counter(
        f"{node.domain}.{node.op_type}" if node.domain else node.op_type
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if node.domain == MS_DOMAIN or ort_registered(node.op_type, node.domain, opset)
    )
    return dict(sorted(counts.items()))


def norm_ops(model: ir.Model) -> dict[str, int]:
    """How many nodes of each :data:`NORM_OPS` type the main graph holds (zeros left out)."""
    counts = Counter(
        node.op_type for node in model.graph if Op(node.op_type, node.domain) in NORM_OPS
    )
    return dict(sorted(counts.items()))
