"""Fuse a hand-written LayerNorm into one ``LayerNormalization`` node (ONNX opset 17 and up, or
ONNX Runtime at any opset).

The math
--------
Layer normalization (Ba, Kiros & Hinton 2016) over the trailing axes ``A = (r-k, ..., r-1)``
of an input ``x`` of rank ``r``::

    mu  = mean_A(x)
    d   = x - mu
    var = mean_A(d * d)                      (the biased variance)
    y   = d / sqrt(var + eps) * w + b

ONNX ``LayerNormalization`` (opset 17, onnx/docs/Operators.md#LayerNormalization) is defined
as the function ``Normalized = Mul(D, Reciprocal(Sqrt(Add(ReduceMean(Mul(D, D)), epsilon))))``,
``Y = Add(Mul(Normalized, Scale), B)`` with ``D = Sub(X, ReduceMean(X))``, both means over
``[axis, ..., r-1]``, computed in float32 under ``stash_type=1``. With ``axis = -k``,
``Scale = w``, ``B = b`` and ``epsilon`` the model's own float32 eps constant, that is the
subgraph above, up to float rounding (one division becomes a reciprocal and a product).

A variance scaled by a positive constant ``f`` is exact too (docs/fusions.md, "Every
spelling, and only the exact ones")::

    d / sqrt(f * var + eps) = f^(-1/2) * d / sqrt(var + eps / f)

so the fused op takes ``epsilon = eps / f`` and ``Scale = w / sqrt(f)``. The unbiased
``x.var()`` is the case ``f = N / (N-1)`` (N the number of normalized elements; both exporters
write it as ``mean(d * d) * N / (N-1)``): epsilon ``eps (N-1)/N``, scale ``w sqrt((N-1)/N)``.

Spellings accepted (as the dynamo and TorchScript exporters write them after
:func:`fusion.cleanup.cleanup` has merged the two copies of ``x - mean``)::

    square       Pow(d, 2) | Mul(d, d)
    var          ReduceMean(square) with keepdims=1, or keepdims=0 and then Reshape [Expand] back
                 to the keepdims shape (the dynamo export of x.var()); times or divided by
                 one-element constants (the factor f); or ReduceSum(square) times or divided
                 by constants (f is then N times their product: sum / N is the variance,
                 sum / (N - 1) the unbiased one)
    center       d = Sub(x, mean) [Cast to the type of x, a no-op]; mean = ReduceMean(x), or
                 ReduceSum(x) divided by N or times 1/N (x.sum(-1, keepdim=True) / d); the
                 variance may center x a second time, over the same axes spelled differently
                 (the dynamo export of x.var() does: axes [2] where the mean has [-1])
    divide       Div(n, den) | Mul(n, Reciprocal(den)) | Mul(n, Div(1, den)), where the
                 numerator n is d, or Mul(w, d) with w a constant (the tutorials' order
                 w * (x - m) / sqrt(var + eps): w is the scale, and only a bias follows)
    den          Sqrt(Add(var, eps)), eps a one-element float32 constant (either Add order),
                 or Sqrt(var) with no eps at all (epsilon 0, below)
    after        [Cast] [Mul by constant w] [Add of constant b]
                 (either operand order; w and b may vary along the normalized axes only)

Other frameworks' exporters (docs/model-files.md, "Files from other frameworks"): the mean as
``GlobalAveragePool`` (the mean over every axis after the first two: tf2onnx's mean over the
last axis of a 3-D tensor); the variance from the moments, ``max(0, E[x^2] - E[x]^2)``
(Flax through jax2onnx; :mod:`fusion.norm_match.moments`); the inverse root as ``Pow(., -0.5)``;
and TensorFlow's batch-norm-style affine, ``x * g + (beta - mean * g)`` with ``g = w /
sqrt(var + eps)`` (tf2onnx; :mod:`fusion.norm_match.folded`).

N, the number of elements a ReduceSum adds up, is read from the shape of ``x``. A mean whose sum
is divided by anything else (``sum / (N - 1)``, a wrong constant) is refused: ``x`` minus it is
not ``x`` minus its mean. Constants count as ``1 / N`` within a few float32 roundings
(:data:`fusion.norm_match.axes.EXACT`).

No eps. ``torch.onnx.export``'s own optimizer (on by default) removes an ``Add`` of 1e-8 as if
it were 0 (docs/model-files.md, "How the export is done"), so files from the field hold
``(x - m) / sqrt(var)``. That is LayerNormalization with ``epsilon=0``, the file's own function
(both give NaN on a constant row, where the variance is 0), and it is fused so; the report gets a
note that says what happened and the fix (export from the PyTorch file again with
``optimize=False``), and what the rewrite became says ``epsilon 0``. An eps of 0 written
as a constant gets the same note.

Mixed precision. A Cast to float32 after a float32 norm is a no-op and is absorbed. A float16
or bfloat16 round trip, ``Cast(x, float32)``, the norm, ``Cast`` back to the type of ``x``,
then weight and bias in that type (the Hugging Face habit), is exactly ``LayerNormalization``
on the low-precision ``x`` with ``stash_type=1``: its function body normalizes in float32,
casts the result to the input type, and only then applies ``Scale`` and ``B``. It is fused so.
Where the weight is applied in float32 before the cast back, one op on the low-precision ``x``
would round twice where the original rounds once: the norm is fused inside the float32 region
and the Casts stay.

Before and after::

    x ─ ReduceMean ─┐
    x ────────────── Sub ─ d ─ Pow(., 2) ─ ReduceMean ─ Add(eps) ─ Sqrt ─┐
                           d ─────────────────────────────────────────── Div ─ Mul(w) ─ Add(b) ─ y

    x ─ LayerNormalization(x, w, b; axis=-k, epsilon=eps, stash_type=1) ─ y

Below opset 17, ``target="ort"`` still fuses into a default-domain ``LayerNormalization``:
ONNX Runtime registers it there at every opset (its own LayerNormFusion emits it into opset-10
to 12 models); :func:`fusion.check` checks it as an ONNX Runtime op.

``x - mean(x)`` may be read elsewhere (two norms of one input, whose centering CSE has made one
value): the fused node computes it from ``x`` again, and the ReduceMean and Sub stay for their
other readers (they go when the other norm is fused too). Other intermediate values (the square,
the variance of two norms that differ in eps only) may be shared among norms that are all
fused (:class:`fusion.norm_match.NormFusionPass`); read by anything else, they block the fusion.

Left intact, with the reason in the report: for ``target="onnx"``, a model whose opset has no
LayerNormalization (below 17); means over axes that are not the trailing axes of ``x``, or over
different axes for the mean and the variance; an intermediate value read outside the subgraph; a
non-constant eps; a variance scaled by a factor that is not positive, or reshaped to a shape
other than its keepdims shape; a norm computed in a type other than float32 (the fused op would
compute it in float32: a different function); ``eps`` added outside the square root
(``d / (sqrt(var) + eps)`` is a different function). A weight or bias that varies along an axis
that is not normalized stays a separate ``Mul`` / ``Add`` after the fused node (reported).

The matching helpers are in :mod:`fusion.norm_match`, shared with :mod:`fusion.fuse_rmsnorm`:
RMSNorm is this computation without the centering.
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
    reduced_trailing,
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
    refusal with its reason (see the module docstring).
    """

    kinds = (Kind("layernorm_fused", "layernorm", (Op("LayerNormalization"),)),)
    needs_opset = {"onnx": 17}

    def match(self, model: ir.Model, node: ir.Node) -> NormMatch | None:
        """Walk up from ``node`` (the division, or the product by the inverse root) to ``x``,
        then down through the affine part.

        Returns:
            The match (``x`` float32, or float16 / bfloat16 when a round trip through float32
            was absorbed; ``k`` trailing axes), or None when ``node`` ends no LayerNorm.

        Raises:
            CannotFuse: ``eps_outside_sqrt``, ``wrong_numerator``, ``different_axes``,
                ``shared_output``, a code of :func:`fusion.norm_match.check_core` or
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
        if found.weighted is None and centered(found.numerator) is None:
            first = weight_first(found.numerator)
        numerator = first[0] if first is not None else found.numerator
        x = center.x if center is not None else core.value
        centers, shift = [center] if center is not None else [], None
        if numerator is x:  # the mean subtracted after the product, batch-norm style
            mean = (center.reduce if center is not None else core.mean).outputs[0]
            shift = subtracted_mean(node.outputs[0], mean, found.scaled)
            if shift is None:
                raise CannotFuse(Code.WRONG_NUMERATOR, WRONG_NUMERATOR)
        elif numerator is not core.value:
            again = centered(numerator)
            if again is None and _a_mean(numerator):
                return None  # the shift's product of a batch-norm-style norm, matched from x's
            if again is None or again.x is not x:
                raise CannotFuse(Code.WRONG_NUMERATOR, WRONG_NUMERATOR)
            centers.append(again)
        return self._matched(node, found, core, centers, first, shift, x)

    def _matched(self, node, found, core, centers, first, shift, x) -> NormMatch:
        """The match :meth:`match` found, checked: the axes of every mean, shared values, the
        weight and the bias (the shift's, or those after the norm)."""
        rank = rank_of(x, core.value, node.outputs[0])
        k = check_core(core, x, rank)
        dims = normalized_dims(k, x, core.value, node.outputs[0])
        for center in centers:
            center.require_mean(k, rank, dims)
        if core.mean is not None and reduced_trailing(core.mean, rank) != k:
            raise CannotFuse(
                Code.DIFFERENT_AXES, "the mean and the mean square reduce over different axes"
            )
        centering = [n for c in centers for n in c.nodes]
        # x - mean(x) read elsewhere too (two norms of one input, made one value by CSE) stays
        # for its other readers: the fused node computes the same value from x itself.
        before = [first[1]] if first is not None else []
        rest = [*before, *core.nodes, *found.nodes, node, *(shift[0] if shift else [])]
        output = shift[2] if shift else node.outputs[0]
        shared = self.check_shared(rest, output, "LayerNorm")
        nodes = list(dict.fromkeys([*centering, *rest]))
        match = NormMatch(x, k, dims, float(core.eps), core.factor, nodes, output)
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
