"""The pass of :mod:`fusion.fuse_gqa` (:class:`FuseGroupQueryAttention`) and what it matches
(:class:`GQAMatch`); the math is in docs/fusions/fuse_gqa.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    add_initializer,
    escaping_value,
    label,
    opset_version,
    remove_nodes,
    replace_output,
)
from fusion.base import MS_DOMAIN, CannotFuse, Code, Kind, NodeFusionPass, Op
from fusion.fuse_gqa import build, core, guard, masks, parts, standard, trace


@dataclasses.dataclass
class GQAMatch:
    """One attention to fuse (see docs/fusions/fuse_gqa.md).

    Attributes:
        query, key, value: the heads, traced back to their split (:class:`parts.Heads`).
        scale: the factor on ``Q @ K^T``.
        tables: the op's ``(cos_cache, sin_cache)`` as arrays, or the model's run-time ``cos``
            and ``sin`` values they are cut from, or None where nothing is rotated.
        causal: the op's ``causal``.
        bias: the op's ``attention_bias``: a constant array, the model's mask computed at run
            time (then the op is guarded, :mod:`.guard`), or None.
        output: the ``(B, S, N*H)`` value the op's output replaces.
        nodes: the nodes it replaces.
        past: ``(past key, past value, present key, present value)``
            (:func:`.trace.past_of`), or None.
        nan_guard: the model maps NaN attention weights to 0 (the dynamo export's guard).
        softcap: the soft-capping of the scores (:func:`core.scores`), 0 where there is none.
    """

    query: parts.Heads
    key: parts.Heads
    value: parts.Heads
    scale: float
    tables: tuple[np.ndarray, np.ndarray] | tuple[ir.Value, ir.Value] | None
    causal: bool
    bias: np.ndarray | ir.Value | None
    output: ir.Value
    nodes: list[ir.Node]
    past: tuple[ir.Value, ir.Value, ir.Value, ir.Value] | None
    nan_guard: bool
    softcap: float = 0.0

    @property
    def guarded(self) -> bool:
        """Whether the op goes behind an ``If`` (:mod:`.guard`): with a past, or a run-time
        mask."""
        return self.past is not None or isinstance(self.bias, ir.Value)


def _check_standard_only(model: ir.Model, match: GQAMatch) -> None:
    """Refuse what only ONNX's ``Attention`` and ``RotaryEmbedding`` take (:mod:`.standard`)
    where the match would not become them: rotary tables of one row per batch row (the model's
    ``position_ids``), and a mask not provably as long as the keys (:func:`masks.mask_spans_keys`:
    a sliding-window cache), which GroupQueryAttention's ``attention_bias`` must be.

    Raises:
        CannotFuse: such a match, and no KV cache nor run-time mask ONNX's ``Attention`` takes,
            or a model below opset 18.
    """
    tables = match.tables
    runtime = tables is not None and not isinstance(tables[0], np.ndarray)
    per_batch = runtime and parts.runtime_table(tables[0], match.query) == "per_batch"
    spans = masks.mask_spans_keys(match.bias, match.past)
    if (per_batch or not spans) and (
        not standard.convertible(model) or FuseGroupQueryAttention._standard_mask(match) is None
    ):
        raise CannotFuse(
            Code.NOT_CONSTANT if per_batch else Code.SHAPE_MISMATCH,
            (
                "the rotary tables differ per batch row (the model's position_ids)"
                if per_batch
                else "the mask is not provably as long as the keys (a sliding-window cache)"
            )
            + ": only ONNX's Attention takes it, with a KV cache or a run-time mask, at opset "
            "18 or above",
        )


class FuseGroupQueryAttention(NodeFusionPass):
    """Replace each decoder attention of the main graph by one ``GroupQueryAttention``, or by
    ``Attention`` and ``RotaryEmbedding`` (see docs/fusions/fuse_gqa.md); counted as
    ``"gqa_fused"``, refusals under ``"gqa"``. The model's opset is raised to 23 before the
    first rewrite that needs it.

    Runs for ``target="ort"``, by default or when ``optimize(gqa=True)``.
    """

    kinds = (
        Kind(
            "gqa_fused",
            "gqa",
            (Op("GroupQueryAttention", MS_DOMAIN), Op("Attention"), Op("RotaryEmbedding")),
            norm=False,
            meaning=(
                "decoder attention (grouped or not, with its rotary embedding) made com.microsoft "
                "`GroupQueryAttention` (`--target ort`, CPU provider; `fusion.fuse_gqa`), or, with "
                "a KV cache or a mask computed at run time, ONNX's `Attention` and "
                "`RotaryEmbedding` (opset 23, `fusion.fuse_gqa.standard`; GroupQueryAttention "
                "behind an `If` on the inputs its kernel takes where the model cannot be raised to "
                "opset 23, `fusion.fuse_gqa.guard`)"
            ),
        ),
    )
    summary = (
        "a decoder's attention into GroupQueryAttention or ONNX's Attention with RotaryEmbedding"
    )
    targets = ("ort",)
    option = "gqa"
    on_by_default = ("ort",)

    def match(self, model: ir.Model, node: ir.Node) -> GQAMatch | None:
        """The attention whose Softmax is ``node``, or None.

        Raises:
            CannotFuse: see docs/fusions/fuse_gqa.md.
        """
        if node.op_type != "Softmax" or node.domain != "":
            return None
        scores, after = core.scores(node), core.weights_reader(node)
        if scores is None or after is None:
            return None
        qk, mask, factor, softcap, nodes = scores
        pv, guard = after
        traced = trace.heads_of(qk, pv, mask, opset_version(model))
        if traced is None:
            return None
        (query, key, value), (q_rot, k_rot), more, qk_factor, past = traced
        merged = core.merged(pv, query.count * query.size)
        if merged is None:
            return None
        output, merge = merged
        tables = parts.tables(q_rot, k_rot, query)
        masking = masks.masking(mask, opset_version(model), tables, query, key, past)
        if masking is None:  # neither rotated nor causal: an encoder's, FuseAttention's
            return None
        matched = [node, *nodes, *more, *guard, pv, *query.nodes, *key.nodes, *value.nodes, *merge]
        matched = core.with_helpers(matched)
        presents = past[2:] if past is not None else ()
        if escaping_value(matched, output, *presents) is not None:
            raise CannotFuse(Code.SHARED_OUTPUT, "a value inside the attention is read elsewhere")
        found = GQAMatch(
            query, key, value, factor * qk_factor, tables, *masking, output, matched, past,
            bool(guard), softcap,
        )  # fmt: skip
        _check_standard_only(model, found)
        return found

    def apply(self, model: ir.Model) -> bool:
        """Fuse in place (see :class:`fusion.base.NodeFusionPass`); layers whose rotary tables
        are the same share the op's caches, those of one batch and length its lengths."""
        self._shared: dict = {}
        self._standard = standard.convertible(model) and any(
            self._standard_mask(m) is not None for m in self.candidates(model)
        )
        opset = opset_version(model)
        if self._standard and opset < standard.OPSET:
            standard.upgrade(model)
            self.outcomes.note(
                f"the model's ai.onnx opset was raised from {opset} to {standard.OPSET} "
                "(onnxscript's version converter) for ONNX's Attention and RotaryEmbedding"
            )
        return super().apply(model)

    @staticmethod
    def _standard_mask(match: GQAMatch) -> str | None:
        """How ONNX's ``Attention`` takes the mask of a match that GroupQueryAttention would
        take behind an ``If`` (:func:`standard.bias`), or None (not guarded, or a mask it cannot
        take)."""
        if not match.guarded:
            return None
        return standard.bias(
            match.bias if isinstance(match.bias, ir.Value) else None, match.nan_guard
        )

    def rewrite(self, model: ir.Model, match: GQAMatch) -> str:
        """Insert the op before the last matched node (where :attr:`GQAMatch.guarded`, ONNX's
        ``Attention`` when the model is at opset 23 and takes the mask, else GroupQueryAttention
        behind an ``If``), move the readers over, drop or move the old nodes."""
        graph = model.graph
        order = {n: i for i, n in enumerate(graph)}
        anchor = max(match.nodes, key=order.__getitem__)
        how = self._standard_mask(match) if self._standard else None
        if how is not None:
            return standard.rewrite(graph, match, anchor, how, self._shared)
        name = label(match.nodes[0])
        inserted: list[ir.Node] = []
        flat = [build.flat(graph, h, inserted) for h in (match.query, match.key, match.value)]
        widths = [h.count * h.size for h in (match.query, match.key, match.value)]
        qkv = build.packed(flat, widths)
        if qkv is None and match.past is not None:  # a decode step: one MatMul, not three
            qkv = (build.projected(graph, flat, inserted, opset_version(model)) or (None,))[0]
        if qkv is not None:
            flat = [qkv, None, None]
        past = match.past or (None,) * 4
        seqlens, total = build.lengths(graph, flat[0], past[0], inserted, self._shared)
        inputs: list[ir.Value | None] = [*flat, *past[:2], seqlens, total]
        attributes = {
            "num_heads": match.query.count,
            "kv_num_heads": match.key.count,
            "scale": match.scale,
            "causal": int(match.causal),
        }
        if match.softcap:
            attributes["softcap"] = match.softcap
        if match.tables is not None:
            inputs += self._caches(graph, match, flat[0], inserted)
            attributes["do_rotary"] = 1
        bias = match.bias
        if isinstance(bias, np.ndarray):
            bias = add_initializer(graph, f"{name}_bias", bias)
        if bias is not None:
            inputs += [None] * (10 - len(inputs)) + [bias]
        outputs = [match.output, *past[2:]] if match.past is not None else [match.output]
        fused = ir.node(
            "GroupQueryAttention",
            inputs,
            attributes,
            domain=MS_DOMAIN,
            name=f"{name}_GroupQueryAttention",
            num_outputs=len(outputs),
        )
        described = "GroupQueryAttention" + (" (rotary inside)" if match.tables else "")
        if match.guarded:
            runtime = bias if isinstance(match.bias, ir.Value) else None
            opset = opset_version(model)
            cond = guard.condition(graph, flat[0], past[0], runtime, opset, inserted, self._shared)
            guard.branch(graph, anchor, inserted, fused, cond, match.nodes, outputs)
            return described + " behind an If (" + ("KV cache" if match.past else "mask") + ")"
        graph.insert_before(anchor, [*inserted, fused])
        replace_output(graph, match.output, fused.outputs[0])
        fused.outputs[0].type = match.output.type
        remove_nodes(graph, match.nodes[::-1])
        return described

    def _caches(self, graph: ir.Graph, match: GQAMatch, query: ir.Value, inserted: list):
        """The op's ``cos_cache`` and ``sin_cache`` for the ``(B, S, .)`` ``query``, and with a
        past its ``position_ids`` (:func:`build.positions`); nodes appended to ``inserted``."""
        size = match.query.size
        caches = build.caches(graph, match.tables, size, inserted, self._shared)
        if match.past is None:
            return caches
        read = build.sizes(graph, query, match.past[0], inserted, self._shared)
        return build.positions(graph, caches, size // 2, read, inserted, self._shared)
