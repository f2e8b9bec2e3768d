"""The one registry of fusion passes, the kinds of rewrite they make and the norm ops.

Whoever needs one of these lists (a caller's report, its half-precision conversion, its
oracle) reads it here instead of keeping a list of its own. Which passes a run enables is the
:class:`fusion.Policy` the caller gives :func:`fusion.optimize`. A new fusion
is one line in :data:`PASSES`; the lists of kinds, codes, ops and families below are derived
from what the passes declare (:attr:`fusion.base.FusionPass.kinds`,
:attr:`fusion.base.FusionPass.codes`, :attr:`fusion.base.FusionPass.targets`), and checked
here when ``fusion`` is imported (:func:`declarations`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from fusion.base import Code as SharedCode
from fusion.base import FusionPass, Kind, Op
from fusion.fold_batchnorm import FoldBatchNorm, algebra
from fusion.fuse_attention import FuseAttention
from fusion.fuse_gelu import FuseGelu
from fusion.fuse_gqa import FuseGroupQueryAttention
from fusion.fuse_groupnorm import FuseGroupNorm
from fusion.fuse_instancenorm import FuseInstanceNorm
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_layernorm_cf import FuseChannelsFirstLayerNorm
from fusion.fuse_rmsnorm import FuseRMSNorm
from fusion.fuse_sdpa import FuseSDPA
from fusion.fuse_skip import FuseSkip
from fusion.merge_branches import MergeBranches
from fusion.prune_rows import PruneRows

#: The fusion passes in the order optimize() runs them. MergeBranches follows FoldBatchNorm,
#: whose folds leave each branch of a re-parameterizable block a Conv; FuseGroupQueryAttention
#: precedes the norms, as it may raise the opset to 23, where an RMSNorm becomes ONNX's
#: RMSNormalization; FuseSDPA follows FuseAttention, so that the transformers encoders keep ONNX
#: Runtime's contrib attention (measured faster on them), and fuses the attention it leaves
#: (for target "onnx" it raises the opset before the first pass, its plan);
#: PruneRows follows the attention fusions, whose query it moves a selection of rows into;
#: FuseSkip is last: it fuses the norms the passes before it produce.
PASSES = (
    FoldBatchNorm,
    MergeBranches,
    FuseGroupQueryAttention,
    FuseInstanceNorm,
    FuseGroupNorm,
    FuseChannelsFirstLayerNorm,
    FuseLayerNorm,
    FuseRMSNorm,
    FuseGelu,
    FuseAttention,
    FuseSDPA,
    PruneRows,
    FuseSkip,
)


def declarations(
    passes: Iterable[type[FusionPass]],
) -> tuple[tuple[Kind, ...], tuple[enum.StrEnum, ...]]:
    """What ``passes`` declare: their kinds of rewrite in pass order, and every refusal code,
    the shared :class:`fusion.base.Code` first, then each pass's own
    (:attr:`~fusion.base.FusionPass.codes`).

    Raises:
        TypeError: a pass without its :attr:`~fusion.base.FusionPass.summary`, or a kind
            without its :attr:`~fusion.base.Kind.meaning` (the generated docs need both).
        ValueError: two kinds of one name, or two codes of one value or one name.
    """
    passes = tuple(passes)
    kinds = tuple(kind for p in passes for kind in p.kinds)
    codes = (*SharedCode, *(code for p in passes if p.codes is not None for code in p.codes))
    if missing := [p.__name__ for p in passes if not p.summary]:
        raise TypeError(f"passes without a summary: {missing}")
    if missing := [kind.name for kind in kinds if not kind.meaning]:
        raise TypeError(f"kinds without a meaning: {missing}")
    for what, names in (
        ("kind", [kind.name for kind in kinds]),
        ("code", [str(code) for code in codes]),
        ("code name", [code.name for code in codes]),
    ):
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"{what}s declared twice: {twice}")
    return kinds, codes


#: Every kind of rewrite, in report order; every refusal code (the report's
#: ``refused[].code``), each value once.
KINDS, CODES = declarations(PASSES)

#: Every refusal code by name, the shared ones and each pass's own (``fusion.Code``):
#: ``Code.FEW_HEADS == "few_heads"``.
Code = enum.StrEnum("Code", [(code.name, str(code)) for code in CODES])
Code.__doc__ = """Every stable refusal code (the report's ``refused[].code``), by name: the
shared :class:`fusion.base.Code` and each pass's own, collected from :data:`PASSES`."""

#: The report's count keys (every report carries each, zero or not).
FUSION_KINDS: tuple[str, ...] = tuple(kind.name for kind in KINDS)


def _ops(*passes: type[FusionPass]) -> tuple[Op, ...]:
    """The ops that the kinds of ``passes`` declare, in declaration order, each once."""
    return tuple(dict.fromkeys(op for p in passes for kind in p.kinds for op in kind.ops))


#: The normalization ops, each with its family: what ``fusion.norm_ops`` counts and what
#: ``explain`` calls a norm the model already has. An op that two families leave belongs to the
#: one whose rewrite leaves it alone (InstanceNormalization: ``instancenorm``, not
#: ``groupnorm``, which leaves Reshapes around it), the later pass where both do
#: (LayerNormalization: ``layernorm``, not ``layernorm_cf``, which runs first and leaves
#: Transposes around it).
def _norm_ops() -> dict[Op, str]:
    ops: dict[Op, Kind] = {}
    for kind in KINDS:
        for op in kind.ops if kind.norm else ():
            if op not in ops or len(kind.ops) <= len(ops[op].ops):
                ops[op] = kind
    return {op: kind.family for op, kind in ops.items()}


NORM_OPS: Mapping[Op, str] = _norm_ops()

#: The norm ops the fusion passes emit (FoldBatchNorm's BatchNormalization is folded away,
#: never emitted).
FUSED_NORM_OPS: tuple[Op, ...] = tuple(op for op in NORM_OPS if op not in _ops(FoldBatchNorm))

#: The fused norms that compute their statistics in the type their ``stash_type`` attribute
#: names (float32 when it is absent): the ops FuseLayerNorm and FuseRMSNorm emit
#: (LayerNormalization, RMSNormalization, ONNX Runtime's SimplifiedLayerNormalization). The
#: half-precision conversion writes ``stash_type=1`` on each; the float64 oracle widens it.
STASH_NORM_OPS: tuple[Op, ...] = _ops(FuseLayerNorm, FuseRMSNorm)

#: ONNX Runtime's residual norms, the ops FuseSkip emits (com.microsoft
#: SkipLayerNormalization, SkipSimplifiedLayerNormalization): no ``stash_type``; float32
#: statistics on ONNX Runtime's CPU provider.
SKIP_NORM_OPS: tuple[Op, ...] = _ops(FuseSkip)

#: The families whose refused candidates are norms written by hand, left decomposed in the
#: model (those of FuseLayerNorm, FuseRMSNorm and FuseInstanceNorm): what the half-precision
#: conversion keeps in float32.
DECOMPOSED_FAMILIES: tuple[str, ...] = tuple(
    p.kinds[0].family for p in (FuseLayerNorm, FuseRMSNorm, FuseInstanceNorm)
)

#: The linear layers, ai.onnx op types: what FoldBatchNorm folds a BatchNorm into, and the ops
#: that hold a model's weights and most of its arithmetic (a bfloat16 model is refused where
#: ONNX Runtime has no bfloat16 kernel for them).
LINEAR_OPS: tuple[str, ...] = algebra.LINEAR

#: ONNX Runtime ops that ORT registers in the default ("") domain although ONNX has no such op.
#: ORT's own fusions emit them there, and a com.microsoft node of these names fails to load.
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})

#: Standard ops that ORT registers in the default domain below the opset that introduced them
#: (op -> that opset): its LayerNormFusion emits LayerNormalization into models of any opset.
ORT_EARLY_OPS = {"LayerNormalization": 17}

#: The norms that ONNX Runtime's session-time SkipLayerNormFusion fuses a residual Add into
#: (LayerNormalization, and SimplifiedLayerNormalization in the default domain): the forms the
#: autotuner also times with that fusion disabled.
ORT_SKIP_FUSED_NORMS: tuple[Op, ...] = (
    Op("LayerNormalization"),
    Op("SimplifiedLayerNormalization"),
)


def ort_registered(op_type: str, domain: str, opset: int) -> bool:
    """Whether ``op_type`` in ``domain`` is an ONNX Runtime op, not a standard one, in a model
    of default-domain ``opset`` (:data:`ORT_DEFAULT_DOMAIN_OPS`, :data:`ORT_EARLY_OPS`)."""
    if domain != "":
        return False
    return op_type in ORT_DEFAULT_DOMAIN_OPS or opset < ORT_EARLY_OPS.get(op_type, 0)
