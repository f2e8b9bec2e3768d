"""Fuse a hand-written LayerNorm into one ``LayerNormalization`` node (ONNX opset 17 and up, or
ONNX Runtime at any opset).

The math (a scaled or unbiased variance included), the spellings accepted, epsilon 0, mixed
precision and each refusal with its code: see docs/fusions/fuse_layernorm.md. The matching
helpers are in :mod:`fusion.norm_match`, shared with :mod:`fusion.fuse_rmsnorm`.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import label, producer, rank_of
from fusion.base import CannotFuse, Code, Kind, Op
from fusion.norm_match import (
    NO_EPS,
    REDUCTIONS,
    NormFusionPass,
    NormMatch,
    centered,
    check_core,
    divided,
    match_eps_outside_sqrt,
    no_eps_note,
    normalized_dims,
    param_value,
    require_kernel,
    subtracted_mean,
    variance,
    weight_first,
)

WRONG_NUMERATOR = "divides a tensor other than x - mean(x) by the standard deviation"
EPS_OUTSIDE = (
    "eps outside the square root: (x - mean) / (sqrt(var) + eps) is not a LayerNormalization, "
    "which adds eps to the variance"
)


def _a_mean(value: ir.Value) -> bool:
    """Whether ``value`` is a reduction or its negation: the ``-m * g`` of a batch-norm-style
    norm (:mod:`fusion.norm_match.folded`), which is no numerator of its own."""
    neg = producer(value, "Neg")
    node = (neg.inputs[0] if neg is not None else value).producer()
    return node is not None and node.op_type in REDUCTIONS and node.domain == ""


class FuseLayerNorm(NormFusionPass):
    """Replace each hand-written LayerNorm in the main graph by one ``LayerNormalization``.

    Every rewrite is recorded as ``"layernorm_fused"`` in the report; every candidate that looks
    like a LayerNorm but cannot be fused exactly is left intact and recorded as a ``"layernorm"``
    refusal with its reason (docs/fusions/fuse_layernorm.md).
    """

    kinds = (
        Kind(
            "layernorm_fused",
            "layernorm",
            (Op("LayerNormalization"),),
            meaning="hand-written LayerNorms made one `LayerNormalization`",
        ),
    )
    summary = "hand-written LayerNorms into LayerNormalization, matched with norm_match"
    needs_opset = {"onnx": 17}

    def match(self, model: ir.Model, node: ir.Node) -> NormMatch | None:
        """Walk up from ``node`` (the division, or the product by the inverse root) to ``x``,
        then down through the affine part.

        Returns:
            The match (``x`` of the type the norm computes in, float32, float16 or bfloat16,
            or the half type of a round trip through float32; ``k`` trailing axes), or None
            when ``node`` ends no LayerNorm.

        Raises:
            CannotFuse: ``eps_outside_sqrt``, ``wrong_numerator``, ``different_axes``,
                ``shared_output``, ``clamp_not_zero``, ``wrong_mean_divisor``, a code of
                :func:`fusion.norm_match.check_core` or
                :meth:`fusion.norm_match.Centering.require_mean`.
        """
        found = divided(node)
        if found is None:
            return None
        if not found.rsqrt:
            outside = match_eps_outside_sqrt(found.root)
            if outside is not None and centered(outside) is not None:
                raise CannotFuse(Code.EPS_OUTSIDE_SQRT, EPS_OUTSIDE)
        core = variance(found.root, found.rsqrt)
        center = centered(core.value) if core is not None and core.mean is None else None
        if core is None or (center is None and core.mean is None):
            return None  # not a norm, or an RMSNorm (FuseRMSNorm's business)
        first = None  # a weight applied before the division: w * (x - m) / sqrt(var + eps)
        if found.weighted is None and centered(found.numerator, restores=True) is None:
            first = weight_first(found.numerator)
        numerator = first[0] if first is not None else found.numerator
        x = center.x if center is not None else core.value
        centers, shift = [center] if center is not None else [], None
        if numerator is x:  # the mean subtracted after the product, batch-norm style
            mean = (center if center is not None else core.mean).mean
            shift = subtracted_mean(node.outputs[0], mean, found.scaled)
            if shift is None:
                raise CannotFuse(Code.WRONG_NUMERATOR, WRONG_NUMERATOR)
        elif numerator is not core.value:
            again = centered(numerator, restores=True)
            if again is None and _a_mean(numerator):
                return None  # the shift's product of a batch-norm-style norm, matched from x's
            if again is None or again.x is not x:
                raise CannotFuse(Code.WRONG_NUMERATOR, WRONG_NUMERATOR)
            centers.append(again)
        match = self._matched(node, found, core, centers, first, shift, x)
        require_kernel("LayerNormalization", match.dtype)
        return match

    def _matched(self, node, found, core, centers, first, shift, x) -> NormMatch:
        """The match :meth:`match` found, checked: the axes of every mean, shared values, the
        weight and the bias (the shift's, or those after the norm)."""
        rank = rank_of(x, core.value, node.outputs[0])
        k = check_core(core, x, rank)
        dims = normalized_dims(k, x, core.value, node.outputs[0])
        for center in [*centers, *([core.mean] if core.mean is not None else [])]:
            center.require_mean(k, rank, dims)
        if core.mean is not None and core.factor != 1.0:
            raise CannotFuse(
                Code.WRONG_MEAN_DIVISOR,
                f"E[x^2] - E[x]^2 with E[x^2] scaled by {core.factor:.7g}: not the variance "
                "(its sum is not divided by the number of elements summed)",
            )
        centering = [n for c in centers for n in c.nodes]
        # x - mean(x) read elsewhere too (two norms of one input, made one value by CSE) stays
        # for its other readers: the fused node computes the same value from x itself.
        before = [first[1]] if first is not None else []
        rest = [*before, *core.nodes, *found.nodes, node, *(shift[0] if shift else [])]
        output = shift[2] if shift else node.outputs[0]
        shared = self.check_shared(rest, output, "LayerNorm")
        nodes = list(dict.fromkeys([*centering, *rest]))
        match = NormMatch(x, k, dims, float(core.eps), core.factor, nodes, output, core.dtype)
        match.shared = shared
        weighted = first or found.weighted
        if weighted is not None:
            match.take_weight(weighted, rank)
        if shift is not None:
            if shift[1] is not None:
                match.take_bias(shift[1], rank)
            return match
        if weighted is None:
            match.absorb_casts()
        ops = (("Mul", "weight"), ("Add", "bias"))[weighted is not None :]
        match.absorb_affine(self, rank, ops, "LayerNormalization")
        return match

    def rewrite(self, model: ir.Model, match: NormMatch) -> str:
        """Insert the LayerNormalization, move the readers over, drop the old nodes."""
        graph = model.graph
        hint = label(match.nodes[-1])
        inputs = [match.x, match.scale(graph, hint)]
        if match.bias is not None:
            inputs.append(param_value(graph, *match.bias, f"{hint}_bias"))
        fused = ir.node(
            "LayerNormalization",
            inputs,
            {"axis": -match.k, "epsilon": match.epsilon, "stash_type": 1},
            name=f"{hint}_LayerNormalization",
        )
        match.replace(graph, fused)
        if match.epsilon == 0:
            self.outcomes.note(no_eps_note("LayerNorm", "a constant row"))
            return f"LayerNormalization ({NO_EPS})"
        return "LayerNormalization"
