"""ONNX graph passes: fold BatchNorm, fuse LayerNorm and RMSNorm (and, for ONNX Runtime, attention
and GELU). Usable alone on any .onnx::

    import onnx_ir as ir
    import fusion

    model = ir.load("model.onnx")
    report = fusion.optimize(model, target="ort")   # in place
    fusion.check(model)
    ir.save(model, "model.opt.onnx")
    print(report.to_dict())

Every rewrite is exact (up to float rounding): a candidate that cannot be expressed exactly by
the fused op is left alone and recorded in the report with its reason.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import onnx
import onnx_ir as ir

from fusion.cleanup import cleanup, normalize_ir_version
from fusion.fold_batchnorm import FoldBatchNorm
from fusion.fuse_attention import FuseAttention
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_rmsnorm import TARGETS, FuseRMSNorm
from fusion.fuse_skip import FuseSkip
from fusion.report import FUSION_KINDS, FusionReport, Refusal

__all__ = [
    "FUSION_KINDS",
    "TARGETS",
    "FuseSkip",
    "FusionReport",
    "Refusal",
    "check",
    "cleanup",
    "norm_ops",
    "optimize",
]

#: ONNX Runtime ops that ORT registers in the default ("") domain although ONNX has no such op.
#: ORT's own fusions emit them there, and a com.microsoft node of these names fails to load.
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})

#: Standard ops that ORT registers in the default domain below the opset that introduced them
#: (op -> that opset): its LayerNormFusion emits LayerNormalization into models of any opset.
ORT_EARLY_OPS = {"LayerNormalization": 17}


def ort_registered(op_type: str, domain: str, opset: int) -> bool:
    """Whether ``op_type`` in ``domain`` is an ONNX Runtime op, not a standard one, in a model
    of default-domain ``opset`` (:data:`ORT_DEFAULT_DOMAIN_OPS`, :data:`ORT_EARLY_OPS`)."""
    if domain != "":
        return False
    return op_type in ORT_DEFAULT_DOMAIN_OPS or opset < ORT_EARLY_OPS.get(op_type, 0)


#: Op types that the report counts before and after optimizing.
NORM_OPS = (
    "BatchNormalization",
    "LayerNormalization",
    "RMSNormalization",
    "SimplifiedLayerNormalization",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
)


def optimize(
    model: ir.Model, *, target: str = "ort", skip: bool = False, attention: bool | None = None
) -> FusionReport:
    """Fold BatchNorm and fuse LayerNorm / RMSNorm in ``model``, in place.

    Runs: exact clean-up (constant folding, CSE, dead nodes), FoldBatchNorm, FuseLayerNorm,
    FuseRMSNorm, FuseAttention (``target="ort"``), optionally FuseSkip, clean-up again. The
    model's opset is never raised: an op is only emitted where the model's opset (or, for
    ``target="ort"``, ONNX Runtime) has it.

    Args:
        model: the model, changed in place.
        target: one of :data:`TARGETS`.
        skip: also fuse residual Add + norm into com.microsoft Skip(Simplified)LayerNormalization.
            A speed choice per execution provider, not an exactness one: on ORT 1.31's CPU
            provider SkipLayerNormalization is 2.4-3.6x slower than Add + LayerNormalization
            (``benchmarks/results/forms_cpu.json``). Needs ``target="ort"``.
        attention: fuse attention and GELU into com.microsoft ops with onnxscript's rules
            (:mod:`fusion.fuse_attention`). None (default): for ``target="ort"`` only.

    Returns:
        What was fused, and what was refused with the reason.

    Raises:
        ValueError: ``target`` is not one of :data:`TARGETS`, or ``skip`` or ``attention``
            without ``"ort"``.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: choose one of {TARGETS}")
    for name, wanted in (("skip", skip), ("attention", attention)):
        if wanted and target != "ort":
            raise ValueError(f"{name}=True emits com.microsoft ops: it needs target='ort'")
    report = FusionReport()
    if (note := normalize_ir_version(model)) is not None:
        report.note(note)
    cleanup(model)
    passes = [
        FoldBatchNorm(report),
        FuseLayerNorm(report, target=target),
        FuseRMSNorm(report, target=target),
    ]
    if attention or (attention is None and target == "ort"):
        passes.append(FuseAttention(report))
    if skip:
        passes.append(FuseSkip(report))  # last: it fuses the norms the passes above produce
    for fusion_pass in passes:
        fusion_pass(model)
    cleanup(model)
    return report


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


def norm_ops(model: ir.Model) -> dict[str, int]:
    """How many nodes of each :data:`NORM_OPS` type the main graph holds (zeros left out)."""
    counts = Counter(node.op_type for node in model.graph if node.op_type in NORM_OPS)
    return dict(sorted(counts.items()))
