"""The pass of :mod:`fusion.fuse_sdpa` (:class:`FuseSDPA`) and what it matches
(:class:`SDPAMatch`); the math is in docs/fusions/fuse_sdpa.md.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from fusion._ir import dims, escaping_value, opset_version
from fusion.base import CannotFuse, Code, Kind, NodeFusionPass, Op
from fusion.fuse_gqa import standard
from fusion.fuse_sdpa import build, core, masks, scales
from fusion.fuse_sdpa.codes import SDPACode


@dataclasses.dataclass
class SDPAMatch:
    """One attention to fuse.

    Attributes:
        softmax: the anchor.
        query: ``Q`` as ``Attention`` takes it; key, value: ``K`` and ``V``
            (:class:`.core.Operand`).
        scale: the op's ``scale``.
        heads: the scale of each head (:func:`.scales.per_head`), which the rewrite moves into
            ``Q``, or None.
        mask: the op's ``attn_mask`` (:class:`.masks.Mask`), or None.
        output: the value the op's output replaces.
        transposed: that value is ``(.., Hv, S)``: the op's output transposed.
        rank: 3 or 4.
        nodes: the nodes replaced; side: nodes removed where nothing else reads them.
        lifts: the axes of size 1 put before ``Q``, ``K`` and ``V`` to make them ``rank``-D,
            as the MatMuls broadcast them (:func:`.core.lifted`).
        perm: the output is ``Transpose(Y, perm)`` and ``V`` read through the inverse: the
            weights reach ``@ V`` through that Transpose of their leading axes
            (:class:`.core.Weights`), or None.
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
    heads: np.ndarray | None = None
    lifts: tuple[int, int, int] = (0, 0, 0)
    perm: tuple[int, ...] | None = None


class FuseSDPA(NodeFusionPass):
    """Replace each scaled dot-product attention by ONNX's ``Attention``
    (docs/fusions/fuse_sdpa.md); counted as ``sdpa_fused``, refusals under ``attention``. The
    model's opset is raised to 23 before the first rewrite."""

    kinds = (
        Kind(
            "sdpa_fused",
            "attention",
            (Op("Attention"),),
            norm=False,
            meaning=(
                "scaled dot-product attention however it was decomposed (torch's "
                "`scaled_dot_product_attention`, `nn.MultiheadAttention`, diffusers, open_clip, "
                "whisper, segment-anything, YOLO's C2PSA) made ONNX's `Attention` (opset 23, the "
                "model's raised from 18 and above: said in `notes`; `fusion.fuse_sdpa`), both "
                "targets; with `--target ort` only the attention `attention_fused` leaves"
            ),
        ),
    )
    summary = "attention however decomposed into ONNX's Attention"
    codes = SDPACode
    needs_opset = {"ort": standard.OPSET, "onnx": standard.OPSET}
    option = "sdpa"
    on_by_default = ("ort", "onnx")
    settings = ("threads", "sdpa_transposed")
    #: The policy's ``threads``: an attention whose batch times heads (:func:`core.slices`) is
    #: fewer is left alone (``few_heads``).
    threads: int
    #: The policy's ``sdpa_transposed``: False leaves YOLO's transposed attention (``V @ P^T``)
    #: alone (``transposed_form``).
    sdpa_transposed: bool

    def match(self, model: ir.Model, node: ir.Node) -> SDPAMatch | None:
        """The attention around the Softmax ``node``, or None where it is no attention's.

        Raises:
            CannotFuse: see docs/fusions/fuse_sdpa.md.
        """
        if not core.is_candidate(node):
            return None
        opset = opset_version(model)
        shape = dims(node.inputs[0])
        if shape is None:
            raise CannotFuse(Code.UNKNOWN_SHAPE, "the rank of the scores is not known")
        axis = node.attributes.get_int("axis", -1 if opset >= 13 else 1)
        if axis not in (-1, len(shape) - 1):
            raise CannotFuse(
                SDPACode.SOFTMAX_AXIS, f"the Softmax is over axis {axis}, not the keys"
            )
        reached = core.weights(node)
        pv, transposed, perm = reached.product, reached.transposed, reached.perm
        found = core.scores(node.inputs[0])
        query, q_factor, q_nodes = scales.unscaled(found.matmul.inputs[0])
        key_t, k_factor, k_nodes = scales.unscaled(found.matmul.inputs[1])
        value_in = pv.inputs[0] if transposed else pv.inputs[1]
        value_dims = dims(value_in)
        if transposed and value_dims is not None:
            value_dims = [*value_dims[:-2], value_dims[-1], value_dims[-2]]
        rank = core.check_shapes(query, key_t, value_dims, perm)
        self._provider_gate(query, transposed)
        scale = found.factor * q_factor * k_factor
        if not (math.isfinite(scale) and scale > 0):
            raise CannotFuse(SDPACode.SCALE_NOT_POSITIVE, f"the scale {scale} is not positive")
        product = dims(found.matmul.outputs[0])  # the scores before a mask broadcasts them
        if product is None:
            raise CannotFuse(Code.UNKNOWN_SHAPE, "the shape of Q @ K^T is not known")
        mask = masks.of_scores(found, reached.guard, opset, core.lifted(product, rank))
        nodes = [*found.nodes, node, *reached.nodes, pv]
        if escaping_value(nodes, pv.outputs[0]) is not None:
            raise CannotFuse(Code.SHARED_OUTPUT, "the scores or the weights are read elsewhere")
        key = core.operand(key_t, len(dims(key_t)))
        value = core.Operand(value_in, None)
        if transposed:
            value = core.operand(value_in, len(value_dims))
        side = [*q_nodes, *k_nodes, *key.nodes, *value.nodes]
        lifts = tuple(rank - len(dims(v)) for v in (query, key_t, value_in))
        return SDPAMatch(
            node, query, key, value, scale, mask, pv.outputs[0], transposed, rank, nodes, side,
            found.heads, lifts, None if perm is None else core.lifted_perm(perm, rank),
        )  # fmt: skip

    def _provider_gate(self, query: ir.Value, transposed: bool) -> None:
        """Refuse what the policy's execution provider runs slower fused (its ``threads``,
        ``sdpa_transposed``: the caller's choice per provider).

        Raises:
            CannotFuse: ``few_heads``: batch times heads of ``query`` below :attr:`threads`;
                ``transposed_form``: a ``transposed`` attention where :attr:`sdpa_transposed`
                is False.
        """
        slices = core.slices(query)
        if slices < self.threads:
            raise CannotFuse(
                SDPACode.FEW_HEADS,
                f"batch x heads is {slices}, fewer than the {self.threads} intra-op threads: "
                "ONNX Runtime's CPU Attention runs one thread per batch and head",
            )
        if transposed and not self.sdpa_transposed:
            raise CannotFuse(
                SDPACode.TRANSPOSED_FORM,
                "the attention is transposed (V @ P^T): Attention needs Q, K, V and its output "
                "transposed, copies the MatMuls do not make on this provider",
            )

    #: The opset :meth:`plan` raised the model from, or None.
    _raised_from: int | None = None

    def plan(self, model: ir.Model) -> None:
        """For ``target="onnx"``, raise the opset (:meth:`_raise`) before the norm passes run,
        so that they emit the ops of opset 23 (an RMSNorm its ``RMSNormalization``) in a model
        that ends there; for ``"ort"`` that waits for :meth:`apply`, after FuseAttention has
        taken the attention it fuses (no raise where it took them all)."""
        if self.target == "onnx":
            self._raised_from = self._raise(model)

    def apply(self, model: ir.Model) -> bool:
        """Raise the opset (:meth:`_raise`) unless :meth:`plan` did, say so in the notes,
        then fuse (see :class:`fusion.base.NodeFusionPass`)."""
        self._shared: dict = {}
        raised = self._raised_from if self._raised_from is not None else self._raise(model)
        if raised is not None:
            self.outcomes.note(
                f"the model's ai.onnx opset was raised from {raised} to {standard.OPSET} "
                "(onnxscript's version converter) for ONNX's Attention"
            )
        return super().apply(model)

    def _raise(self, model: ir.Model) -> int | None:
        """Raise the opset to 23 where there is an attention to fuse and the model allows
        (:func:`fusion.fuse_gqa.standard.convertible`); the opset before, or None."""
        opset = opset_version(model)
        if opset < standard.OPSET and standard.convertible(model) and self.candidates(model):
            standard.upgrade(model)
            return opset
        return None

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
