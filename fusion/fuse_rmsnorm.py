"""Fuse a hand-written RMSNorm into ``RMSNormalization`` (opset 23) or ONNX Runtime's
``SimplifiedLayerNormalization`` (below 23, ``target="ort"``).

The math, the two ops, the spellings accepted, mixed precision and each refusal with its code:
see docs/fusions/fuse_rmsnorm.md. The matching helpers are in :mod:`fusion.norm_match`.
"""

from __future__ import annotations

import enum

import onnx_ir as ir

from fusion._ir import label, opset_version, producer, rank_of
from fusion.base import CannotFuse, Code, Kind, Op
from fusion.norm_match import (
    NO_EPS,
    ORT_CPU_TYPES,
    NormFusionPass,
    NormMatch,
    centered,
    check_core,
    divided,
    match_eps_outside_sqrt,
    no_eps_note,
    normalized_dims,
    require_kernel,
    variance,
    weight_first,
)


class RMSNormCode(enum.StrEnum):
    """Why FuseRMSNorm left a candidate alone, besides the codes every pass shares
    (:class:`fusion.base.Code`)."""

    #: ``F.normalize(x) * sqrt(d)``: the L2 norm clamped at eps, not eps added to the mean square.
    F_NORMALIZE = "f_normalize"


EPS_OUTSIDE = (
    "eps outside the square root: not an RMSNorm; differs by orders of magnitude for small inputs"
)
F_NORMALIZE = (
    "F.normalize(x) * sqrt(d) is not RMSNorm: it clamps the L2 norm at eps instead of adding "
    "eps to the mean square"
)


def _clamped_l2_norm(den: ir.Value) -> bool:
    """Whether ``den`` is ``Max(ReduceL2(.), c)`` or ``Clip(ReduceL2(.), c)``, maybe Expanded."""
    expand = producer(den, "Expand")
    if expand is not None:
        den = expand.inputs[0]
    clamp = producer(den, "Max")
    if clamp is None:
        clamp = producer(den, "Clip")
    return clamp is not None and any(producer(v, "ReduceL2") is not None for v in clamp.inputs)


class FuseRMSNorm(NormFusionPass):
    """Replace each hand-written RMSNorm in the main graph by one fused node.

    Opset 23 and up: ``RMSNormalization`` (for ``target="ort"`` in bfloat16, which ONNX Runtime
    has no kernel for: ``SimplifiedLayerNormalization``). Below 23: ORT's
    ``SimplifiedLayerNormalization`` for ``target="ort"``; nothing for ``target="onnx"`` (each
    candidate refused with the reason).
    Fusions are counted as ``"rmsnorm_fused"``; look-alikes and candidates that cannot be fused
    exactly are left intact and recorded as ``"rmsnorm"`` refusals (docs/fusions/fuse_rmsnorm.md).
    """

    kinds = (
        Kind(
            "rmsnorm_fused",
            "rmsnorm",
            (Op("RMSNormalization"), Op("SimplifiedLayerNormalization")),
            meaning=(
                "hand-written RMSNorms made one `RMSNormalization` / `SimplifiedLayerNormalization`"
            ),
        ),
    )
    summary = (
        "hand-written RMSNorms into RMSNormalization / SimplifiedLayerNormalization, matched with "
        "norm_match"
    )
    codes = RMSNormCode
    needs_opset = {"onnx": 23}

    def match(self, model: ir.Model, node: ir.Node) -> NormMatch | None:
        """Walk up from ``node`` (the division) to ``x``, then down through Cast and weight.

        Returns:
            The match (``x`` of the type the norm computes in, float32, float16 or bfloat16,
            or the half type of a round trip through float32; ``k`` trailing axes), or None
            when ``node`` ends no RMSNorm.

        Raises:
            CannotFuse: ``eps_outside_sqrt``, ``f_normalize``, ``wrong_numerator``,
                ``shared_output``, ``no_ort_kernel`` (a bfloat16 RMSNormalization, target
                "onnx"), or a code of :func:`fusion.norm_match.check_core`.
        """
        found = divided(node)
        if found is None:
            return None
        if not found.rsqrt:
            outside = match_eps_outside_sqrt(found.root)
            if outside is not None and centered(outside) is None:
                raise CannotFuse(Code.EPS_OUTSIDE_SQRT, EPS_OUTSIDE)
            if _clamped_l2_norm(found.root):
                raise CannotFuse(RMSNormCode.F_NORMALIZE, F_NORMALIZE)
        core = variance(found.root, found.rsqrt, moments=False)
        if core is None or centered(core.value) is not None:
            return None  # not a norm, or a LayerNorm (FuseLayerNorm's business)
        x, numerator = core.value, found.numerator
        first = weight_first(numerator) if numerator is not x else None
        if (first[0] if first is not None else numerator) is not x:
            raise CannotFuse(
                Code.WRONG_NUMERATOR,
                "divides a tensor other than the one whose mean square is taken",
            )
        weighted = first or found.weighted
        rank = rank_of(x, node.outputs[0])
        k = check_core(core, x, rank)
        nodes = [*([first[1]] if first else []), *core.nodes, *found.nodes, node]
        shared = self.check_shared(nodes, node.outputs[0], "RMSNorm")
        dims = normalized_dims(k, x, node.outputs[0])
        match = NormMatch(x, k, dims, float(core.eps), core.factor, nodes, node.outputs[0])
        match.dtype = core.dtype
        match.shared = shared
        if weighted is not None:
            match.take_weight(weighted, rank)
        else:
            match.absorb_casts()
            match.absorb_affine(self, rank, (("Mul", "weight"),), "fused RMSNorm")
        require_kernel(self._op_type(model, match.dtype), match.dtype)
        return match

    def _op_type(self, model: ir.Model, dtype: ir.DataType) -> str:
        """The fused op: RMSNormalization from opset 23, but for ``target="ort"`` where ONNX
        Runtime has no kernel for ``dtype`` (bfloat16), SimplifiedLayerNormalization."""
        standard = opset_version(model) >= 23
        if standard and (self.target != "ort" or dtype in ORT_CPU_TYPES["RMSNormalization"]):
            return "RMSNormalization"
        return "SimplifiedLayerNormalization"

    def rewrite(self, model: ir.Model, match: NormMatch) -> str:
        """Insert the fused node, move the readers over, drop the old nodes; return its op."""
        graph = model.graph
        anchor = match.nodes[-1]
        attributes = {"axis": -match.k, "epsilon": match.epsilon}
        op_type = self._op_type(model, match.dtype)
        if op_type == "RMSNormalization":
            attributes["stash_type"] = 1
        fused = ir.node(
            op_type,
            [match.x, match.scale(graph, label(anchor))],
            attributes,
            name=f"{label(anchor)}_{op_type}",
        )
        match.replace(graph, fused)
        if match.epsilon == 0:
            self.outcomes.note(no_eps_note("RMSNorm", "a row of zeros"))
            return f"{op_type} ({NO_EPS})"
        return op_type
