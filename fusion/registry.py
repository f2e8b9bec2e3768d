"""The one registry of fusion passes, the kinds of rewrite they make, the norm ops and the
policies that choose among the passes.

The report, ``explain``, ``bench``, the variants, the half-precision conversion, the float64
oracle, the demo and the gallery read these instead of keeping lists of their own. A new fusion
is one line in :data:`PASSES`; the lists of ops and families below are derived from what the
passes declare (:attr:`fusion.base.FusionPass.kinds`, :attr:`fusion.base.FusionPass.targets`).
"""

from __future__ import annotations

from collections.abc import Mapping

from fusion.base import FusionPass, Kind, Op, Policy
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

#: Every kind of rewrite, in report order.
KINDS: tuple[Kind, ...] = tuple(kind for p in PASSES for kind in p.kinds)

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

#: The execution providers on which a run fuses residual Add + norm into ONNX Runtime's Skip
#: ops (:func:`policy`): on CUDA SkipSimplifiedLayerNormalization is faster than Add +
#: SimplifiedLayerNormalization, and SkipLayerNormalization is what ORT makes of Add +
#: LayerNormalization anyway (``benchmarks/results/forms_cuda.json``, docs/cuda.md).
SKIP_PROVIDERS = ("cuda",)

#: The execution providers on which a run fuses them all only in a model with a KV cache, and
#: elsewhere only where the Skip op absorbs a dense layer's bias Add too and the norm alone
#: reads the sum (``skip="kv_cache"``, :mod:`fusion.fuse_skip`). On the CPU provider the Skip
#: ops make a decoder's decode step faster and its prefill and the encoders slower (the
#: ``normexport_skip`` variant of ``benchmarks/results/decoders_cpu.json``; one node alone,
#: ``forms_cpu.json``, slower), unless they remove two Adds: BERT's post-norm Skip ops with the
#: bias absorbed are faster, ViT's pre-norm ones, whose sum the residual stream reads too, slower
#: (``benchmarks/results/families_cpu.json``; :mod:`fusion.fuse_skip`).
SKIP_KV_CACHE_PROVIDERS = ("cpu",)

#: The execution providers on which a run fuses decoder attention into GroupQueryAttention
#: (:func:`policy`): ONNX Runtime's CUDA kernel of the op takes float16 and bfloat16 only (its
#: kernel table, :mod:`normexport.runtime.cuda_kernels`), and the passes run on the float32
#: model.
GQA_PROVIDERS = ("cpu",)

#: The execution providers whose attention kernels run one thread per batch and head, so that
#: :mod:`fusion.fuse_sdpa` and :mod:`fusion.fuse_attention` leave an attention with fewer than
#: the run's intra-op threads (the policy's ``threads``).
THREADED_PROVIDERS = ("cpu",)

#: The execution providers on which :mod:`fusion.fuse_sdpa` fuses YOLO's transposed attention
#: (``q^T @ k``, ``v @ attn^T``: ``Attention`` of ``q^T`` and of the Transposes of K and V, its
#: output transposed back; the policy's ``sdpa_transposed``). On the CPU provider it is left
#: (``transposed_form``): ONNX Runtime's session makes the unfused form two ``FusedMatMul``s
#: and a Softmax, no Transpose left, and the fused one four Transposes (copies) around
#: ``Attention``. Whole models, the choice flipped (``benchmarks/results/attention_ab_cpu.json``):
#: YOLO11n fused over left 1.01 [0.99, 1.03], never faster. On CUDA it stays fused, as before
#: (not measured there).
TRANSPOSED_SDPA_PROVIDERS = ("cuda",)


def policy(target: str, provider: str, threads: int = 1) -> Policy:
    """The fusion policy of a run for ``target`` on ``provider`` (``"cpu"`` or ``"cuda"``, as
    :func:`normexport.runtime.resolve_provider` resolves it) with ``threads`` intra-op threads:
    the fusions that are a speed choice per provider decided by the lists above (``skip``:
    True on :data:`SKIP_PROVIDERS`, ``"kv_cache"`` on :data:`SKIP_KV_CACHE_PROVIDERS`; ``gqa`` on
    :data:`GQA_PROVIDERS`; ``threads`` kept on :data:`THREADED_PROVIDERS`, 1 elsewhere;
    ``sdpa_transposed`` on :data:`TRANSPOSED_SDPA_PROVIDERS`), each only for the targets its pass
    runs for. The run, ``bench``'s normexport variant and
    ``explain`` all ask this.

    Raises:
        ValueError: ``target`` is not one of :data:`fusion.base.TARGETS`; ``threads`` below 1.
    """
    skip: bool | str = False
    if target in FuseSkip.targets and provider in SKIP_PROVIDERS:
        skip = True
    elif target in FuseSkip.targets and provider in SKIP_KV_CACHE_PROVIDERS:
        skip = "kv_cache"
    gqa = target in FuseGroupQueryAttention.targets and provider in GQA_PROVIDERS
    threads = threads if provider in THREADED_PROVIDERS else 1
    transposed = provider in TRANSPOSED_SDPA_PROVIDERS
    return Policy(target=target, skip=skip, gqa=gqa, threads=threads, sdpa_transposed=transposed)


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
