"""The one registry of fusion passes, the kinds of rewrite they make, and the norm ops.

The report, ``explain``, ``bench``, the variants, the demo and the gallery read these instead
of keeping lists of their own. A new fusion is one line in :data:`PASSES`.
"""

from __future__ import annotations

from collections.abc import Mapping

from fusion.base import Kind, Op
from fusion.fold_batchnorm import FoldBatchNorm
from fusion.fuse_attention import FuseAttention
from fusion.fuse_groupnorm import FuseGroupNorm
from fusion.fuse_instancenorm import FuseInstanceNorm
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_layernorm_cf import FuseChannelsFirstLayerNorm
from fusion.fuse_rmsnorm import FuseRMSNorm
from fusion.fuse_skip import FuseSkip
from fusion.merge_branches import MergeBranches

#: The fusion passes in the order optimize() runs them. MergeBranches follows FoldBatchNorm,
#: whose folds leave each branch of a re-parameterizable block a Conv; FuseSkip is last: it
#: fuses the norms the passes before it produce.
PASSES = (
    FoldBatchNorm,
    MergeBranches,
    FuseInstanceNorm,
    FuseGroupNorm,
    FuseChannelsFirstLayerNorm,
    FuseLayerNorm,
    FuseRMSNorm,
    FuseAttention,
    FuseSkip,
)

#: Every kind of rewrite, in report order.
KINDS: tuple[Kind, ...] = tuple(kind for p in PASSES for kind in p.kinds)

#: The report's count keys (every report carries each, zero or not).
FUSION_KINDS: tuple[str, ...] = tuple(kind.name for kind in KINDS)


#: The normalization ops, each with its family: what ``fusion.norm_ops`` counts. An op that
#: two families leave belongs to the first (InstanceNormalization: ``instancenorm``, also
#: ``groupnorm``'s between its Reshapes).
def _norm_ops() -> dict[Op, str]:
    ops: dict[Op, str] = {}
    for kind in KINDS:
        for op in kind.ops if kind.norm else ():
            ops.setdefault(op, kind.family)
    return ops


NORM_OPS: Mapping[Op, str] = _norm_ops()

#: The norm ops the fusion passes emit (BatchNormalization is folded away, never emitted).
FUSED_NORM_OPS: tuple[Op, ...] = tuple(op for op in NORM_OPS if op.op_type != "BatchNormalization")

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
