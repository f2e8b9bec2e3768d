"""Fuse a hand-written RMSNorm into ``RMSNormalization`` (opset 23) or ORT's fused op.

The math
--------
RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization") over the trailing axes
``A = (r-k, ..., r-1)`` of ``x``::

    y = x / sqrt(mean_A(x * x) + eps) * w

It is LayerNorm without the centering. Two ops compute it in one node:

* ONNX ``RMSNormalization`` (opset 23, onnx/docs/Operators.md#RMSNormalization):
  ``Normalized = Div(X, Sqrt(Add(ReduceMean(Mul(X, X)), epsilon)))`` over ``[axis, ..., r-1]``,
  computed in float32 under ``stash_type=1`` and cast back to the type of ``X``, then
  ``Y = Mul(Normalized, Scale)``.
* ONNX Runtime's ``SimplifiedLayerNormalization`` (contrib op, onnxruntime
  ``core/graph/contrib_ops/contrib_defs.cc``; the CPU and CUDA kernels accumulate in float32):
  the same ``Y`` with attributes ``axis`` and ``epsilon``. ORT registers it in the default ONNX
  domain (version 1), not in ``com.microsoft``: a ``com.microsoft:SimplifiedLayerNormalization``
  node is rejected when ORT 1.31 loads the model ("not a registered function/op"). ORT's own
  session-time fusion writes it the same way. Being no standard op, it is not accepted by
  ``onnx.checker``; it is what ``target="ort"`` means below opset 23.

Spellings accepted (the LLaMA / HF ``LlamaRMSNorm`` forms as both exporters write them)::

    square       Pow(x, 2) | Mul(x, x)
    divide       Div(n, den) | Mul(n, Reciprocal(den)) | Mul(n, Div(1, den)), the numerator
                 n being x, or Mul(w, x) with w a constant (the weight first: w is the scale)
    den          Sqrt(Add(f * ReduceMean(square), eps)), eps a one-element float32 constant;
                 ReduceSum(square) times or divided by constants for f * ReduceMean (N, the
                 number of elements summed, read from the shape, goes into f); or no Add at
                 all (epsilon 0, which the report notes as for LayerNorm)
    after        [Cast] [Mul by constant w (either operand order)]

A constant factor ``f`` on the mean square moves into the op exactly, as for LayerNorm:
``epsilon = eps / f``, ``Scale = w / sqrt(f)`` (:mod:`fusion.norm_match`). So the sum of squares
over any positive constant is fused, ``sum / N`` as the textbook RMSNorm.

Mixed precision. A Cast to float32 after a float32 norm is a no-op and is absorbed. The HF
round trip ``Cast(x16, float32) ... Cast(back)`` with the weight applied after the cast back in
float16 or bfloat16 (``w * y.to(float16)``: LLaMA, Mistral, Qwen, T5) is fused on the
low-precision ``x`` with ``stash_type=1``: the op computes in float32 and casts the normalized
value back before the weight, as the original does (the tests hold ORT's fused kernels to one
float16 ulp of the unfused graph; on CPU they agreed exactly). Where the weight is applied in
float32 before the cast back (Gemma's ``* (1 + w.float())``), one op on the low-precision ``x``
would round twice where the original rounds once: the norm is fused inside the float32 region,
its Casts left where they are.

Before and after (dynamo export of ``LlamaRMSNorm``)::

    x ─ Pow(., 2) ─ ReduceMean ─ Add(eps) ─ Sqrt ─ Reciprocal ─┐
    x ───────────────────────────────────────────────────────── Mul ─ Mul(w) ─ y

    x ─ RMSNormalization(x, w; axis=-k, epsilon=eps, stash_type=1) ─ y      (opset >= 23)
    x ─ SimplifiedLayerNormalization(x, w; axis=-k, epsilon=eps) ─ y        (opset < 23, "ort")

Left intact, with the reason in the report:

* ``x / (sqrt(mean(x^2)) + eps)``: eps outside the square root is not an RMSNorm; for
  ``|x| ~ 1e-4`` and eps 1e-6 it differs from RMSNorm by orders of magnitude.
* ``F.normalize(x) * sqrt(d)`` (``x / max(ReduceL2(x), eps) * sqrt(d)``, written with Max or
  Clip): it clamps the norm instead of adding eps to the mean square.
* ``target="onnx"`` below opset 23, which has no RMSNormalization (the opset is never raised).
* means over axes that are not trailing, an intermediate value read elsewhere, a non-constant
  eps, a factor that is not positive, or a norm computed in a type other than float32.

A weight that varies along an axis that is not normalized stays a separate Mul (reported).
``x - mean(x)`` normalized this way is a LayerNorm, left to :mod:`fusion.fuse_layernorm`.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import label, opset_version, producer, rank_of
from fusion.base import CannotFuse, Code, Kind, Op
from fusion.norm_match import (
    NO_EPS,
    NormFusionPass,
    NormMatch,
    centered,
    check_core,
    divided,
    match_eps_outside_sqrt,
    no_eps_note,
    normalized_dims,
    variance,
    weight_first,
)

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

    Opset 23 and up: ``RMSNormalization``. Below 23: ORT's ``SimplifiedLayerNormalization``
    for ``target="ort"``; nothing for ``target="onnx"`` (each candidate refused with the reason).
    Fusions are counted as ``"rmsnorm_fused"``; look-alikes and candidates that cannot be fused
    exactly are left intact and recorded as ``"rmsnorm"`` refusals (see the module docstring).
    """

    kinds = (
        Kind(
            "rmsnorm_fused",
            "rmsnorm",
            (Op("RMSNormalization"), Op("SimplifiedLayerNormalization")),
        ),
    )
    needs_opset = {"onnx": 23}

    def match(self, model: ir.Model, node: ir.Node) -> NormMatch | None:
        """Walk up from ``node`` (the division) to ``x``, then down through Cast and weight.

        Returns:
            The match (``x`` float32, or float16 / bfloat16 when a round trip through float32
            was absorbed; ``k`` trailing axes), or None when ``node`` ends no RMSNorm.

        Raises:
            CannotFuse: ``eps_outside_sqrt``, ``f_normalize``, ``wrong_numerator``,
                ``shared_output``, or a code of :func:`fusion.norm_match.check_core`.
        """
        found = divided(node)
        if found is None:
            return None
        if not found.rsqrt:
            outside = match_eps_outside_sqrt(found.root)
            if outside is not None and centered(outside) is None:
                raise CannotFuse(Code.EPS_OUTSIDE_SQRT, EPS_OUTSIDE)
            if _clamped_l2_norm(found.root):
                raise CannotFuse(Code.F_NORMALIZE, F_NORMALIZE)
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
        match.shared = shared
        if weighted is not None:
            match.take_weight(weighted, rank)
            return match
        match.absorb_casts()
        match.absorb_affine(self, rank, (("Mul", "weight"),), "fused RMSNorm")
        return match

    def rewrite(self, model: ir.Model, match: NormMatch) -> str:
        """Insert the fused node, move the readers over, drop the old nodes; return its op."""
        graph = model.graph
        anchor = match.nodes[-1]
        attributes = {"axis": -match.k, "epsilon": match.epsilon}
        if opset_version(model) >= 23:
            op_type = "RMSNormalization"
            attributes["stash_type"] = 1
        else:
            op_type = "SimplifiedLayerNormalization"
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
