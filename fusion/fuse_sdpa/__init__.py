"""Fuse scaled dot-product attention, however a library or an exporter decomposed it, into
ONNX's ``Attention`` (opset 23, Operators.md).

The math
--------
Scaled dot-product attention (Vaswani et al., 2017, eq. 1), with a mask or bias on the scores::

    Y = softmax(scale * Q @ K^T + mask) @ V        # Q (B, N, S, H), K (B, N, L, H), V (B, N, L, Hv)

is what ``Attention`` computes from 4-D ``Q``, ``K``, ``V`` and ``attn_mask`` with its
``scale`` attribute (for 3-D ``(B*N, S, H)`` tensors, the heads folded into the batch, with
``q_num_heads = kv_num_heads = 1``). The op takes the tensors as they are, so the projections
and the split into heads (Reshape / Transpose, Split, Slice, a packed in-projection,
cross-attention from other tensors, with or without bias) are not matched: only the core
around each Softmax (:mod:`.core`).

What is fused
-------------
* the scale: constant scalars on the scores (``Mul`` / ``Div`` after the MatMul), on ``Q`` and
  on ``K^T`` (torch's decomposition of ``F.scaled_dot_product_attention`` scales each by
  ``sqrt(scale)``, through a ``CastLike`` at the dynamo exporter's default opset), multiplied
  into one ``scale``; none is scale 1;
* ``K^T``: ``Transpose(K, perm=[0, 1, 3, 2])``, a Transpose of another layout (``K`` is then one
  Transpose of the composed perm), the dynamo exporter's ``Reshape -> Transpose -> Reshape``,
  or any ``(B, N, H, L)`` tensor (``K`` its Transpose: YOLO's ``q^T @ k``, whose ``q^T`` is
  ``Q`` as it is);
* the weights' product: ``P @ V`` (maybe behind the NaN guard ``Where(IsNaN(p), 0, p)``), or
  YOLO's ``V @ P^T`` (``Attention`` of ``V``'s Transpose, its output transposed back: Transposes
  are exact);
* masks and biases (:mod:`.masks`): additive ones (torch's causal mask, a padding mask, relative
  positions, ALiBi, T5's bias), segment-anything's relative positions added through a 5-D view of
  the scores (``Reshape -> Add -> Add -> Reshape``), boolean ``Where(c, scores, -inf or a large
  negative)`` either way round, ``Not(c)`` too.

Left alone, with the reason (refusals only for a Softmax whose input comes from a MatMul and
whose output feeds one): a Softmax over another axis than the keys' (``softmax_axis``), an op
between ``Q @ K^T`` and the Softmax that is no scale or mask, a mask scaled with the scores, a
boolean mask beside another (``scores_form``), a scale computed at run time (``not_constant``),
per head (``scale_not_scalar``) or not positive (``scale_not_positive``: the kernel requires
``scale > 0``), a mask under which a row masked at every key would come out otherwise
(``mask_not_exact``), tensors other than float32 (``unsupported_dtype``), not all 3-D or 4-D,
of batches, head counts or lengths not provably alike (``shape_mismatch``), the weights read
elsewhere (``shared_output``). ``Attention`` needs opset 23: a model at 18 or above is raised to
it by onnxscript's version converter (:func:`fusion.fuse_gqa.standard.upgrade`, said in the
report's notes) before the first rewrite; below 18 every candidate is refused
(``opset_too_low``).

It runs after :class:`fusion.fuse_attention.FuseAttention`, so that the transformers encoders keep
ONNX Runtime's contrib attention, measured faster on them; for both targets.
"""

from __future__ import annotations

import dataclasses
import math

import onnx_ir as ir

from fusion._ir import dims, escaping_value, opset_version
from fusion.base import CannotFuse, Code, Kind, NodeFusionPass, Op
from fusion.fuse_gqa import standard
from fusion.fuse_sdpa import build, core, masks


@dataclasses.dataclass
class SDPAMatch:
    """One attention to fuse.

    Attributes:
        softmax: the anchor.
        query: ``Q`` as ``Attention`` takes it; key, value: ``K`` and ``V``
            (:class:`.core.Operand`).
        scale: the op's ``scale``.
        mask: the op's ``attn_mask`` (:class:`.masks.Mask`), or None.
        output: the value the op's output replaces.
        transposed: that value is ``(.., Hv, S)``: the op's output transposed.
        rank: 3 or 4.
        nodes: the nodes replaced; side: nodes removed where nothing else reads them.
    """

    softmax: ir.Node
    query: ir.Value
    key: core.Operand
    value: core.Operand
    scale: float
    mask: masks.Mask | None
    output: ir.Value
    transposed: bool
    rank: int
    nodes: list[ir.Node]
    side: list[ir.Node]


class FuseSDPA(NodeFusionPass):
    """Replace each scaled dot-product attention by ONNX's ``Attention`` (see the module
    docstring); counted as ``sdpa_fused``, refusals under ``attention``. The model's opset is
    raised to 23 before the first rewrite."""

    kinds = (Kind("sdpa_fused", "attention", (Op("Attention"),), norm=False),)
    needs_opset = {"ort": standard.OPSET, "onnx": standard.OPSET}

    def match(self, model: ir.Model, node: ir.Node) -> SDPAMatch | None:
        """The attention around the Softmax ``node``, or None where it is no attention's.

        Raises:
            CannotFuse: see the module docstring.
        """
        if not core.is_candidate(node):
            return None
        opset = opset_version(model)
        shape = dims(node.inputs[0])
        if shape is None:
            raise CannotFuse(Code.UNKNOWN_SHAPE, "the rank of the scores is not known")
        axis = node.attributes.get_int("axis", -1 if opset >= 13 else 1)
        if axis not in (-1, len(shape) - 1):
            raise CannotFuse(Code.SOFTMAX_AXIS, f"the Softmax is over axis {axis}, not the keys")
        pv, after, transposed, guard = core.weights(node)
        found = core.scores(node.inputs[0])
        query, q_factor, q_nodes = core.unscaled(found.matmul.inputs[0])
        key_t, k_factor, k_nodes = core.unscaled(found.matmul.inputs[1])
        value_in = pv.inputs[0] if transposed else pv.inputs[1]
        value_dims = dims(value_in)
        if transposed and value_dims is not None:
            value_dims = [*value_dims[:-2], value_dims[-1], value_dims[-2]]
        rank = core.check_shapes(query, key_t, value_dims)
        scale = found.factor * q_factor * k_factor
        if not (math.isfinite(scale) and scale > 0):
            raise CannotFuse(Code.SCALE_NOT_POSITIVE, f"the scale {scale} is not positive")
        product = dims(found.matmul.outputs[0])  # the scores before a mask broadcasts them
        if product is None:
            raise CannotFuse(Code.UNKNOWN_SHAPE, "the shape of Q @ K^T is not known")
        mask = masks.of_scores(found, guard, opset, product)
        nodes = [*found.nodes, node, *after, pv]
        if escaping_value(nodes, pv.outputs[0]) is not None:
            raise CannotFuse(Code.SHARED_OUTPUT, "the scores or the weights are read elsewhere")
        key = core.operand(key_t, rank)
        value = core.operand(value_in, rank) if transposed else core.Operand(value_in, None)
        side = [*q_nodes, *k_nodes, *key.nodes, *value.nodes]
        return SDPAMatch(
            node, query, key, value, scale, mask, pv.outputs[0], transposed, rank, nodes, side
        )

    def apply(self, model: ir.Model) -> bool:
        """Raise the opset to 23 where there is an attention to fuse and the model allows
        (:func:`fusion.fuse_gqa.standard.convertible`), then fuse (see
        :class:`fusion.base.NodeFusionPass`)."""
        self._shared: dict = {}
        opset = opset_version(model)
        if opset < standard.OPSET and standard.convertible(model) and self.candidates(model):
            standard.upgrade(model)
            self.outcomes.note(
                f"the model's ai.onnx opset was raised from {opset} to {standard.OPSET} "
                "(onnxscript's version converter) for ONNX's Attention"
            )
        return super().apply(model)

    def opset_gate(self, model: ir.Model) -> CannotFuse | None:
        """Why ``Attention`` cannot be emitted into ``model``: an opset below 23 that the
        version converter does not raise (below 18)."""
        opset = opset_version(model)
        if opset >= standard.OPSET:
            return None
        return CannotFuse(
            Code.OPSET_TOO_LOW,
            f"opset {opset} has no Attention (needs {standard.OPSET}, raised from 18 and above):"
            " export with --opset 18 or above",
        )

    def rewrite(self, model: ir.Model, match: SDPAMatch) -> str:
        """Insert ``Attention`` (:func:`.build.rewrite`), drop the old nodes."""
        return build.rewrite(model.graph, match, self._shared)
