"""Fuse a decoder's attention, with its rotary embedding, into ONNX Runtime's
``GroupQueryAttention`` (com.microsoft, ContribOperators.md), or, with a KV cache or a mask
computed at run time, into ONNX's ``Attention`` and ``RotaryEmbedding`` (opset 23).

The math
--------
Scaled dot-product attention (Vaswani et al., 2017, eq. 1) over ``N`` query heads that share
``K`` key/value heads, each ``N / K`` times (Ainslie et al., 2023, "GQA"), with the rotary
position embedding of RoFormer (Su et al., 2021) applied to the queries and keys::

    out = softmax(scale * rope(q) @ rope(k)^T + mask) @ v

or, with Gemma 2's soft-capping of the scores before the mask, ``softmax(c * tanh(scale *
rope(q) @ rope(k)^T / c) + mask) @ v``: the ops' ``softcap = c`` (:func:`.core.scores`).

``GroupQueryAttention`` computes this from the projections before they are split into heads
(``query (B, S, N*H)``, ``key`` and ``value (B, T, K*H)``): it splits them, rotates ``q`` and
``k`` with rows of its ``cos_cache`` / ``sin_cache`` (``do_rotary=1``), repeats the key/value
heads itself, and masks causally (``causal=1``) or adds ``attention_bias``.

What is fused, as ``torch.onnx.export`` (dynamo, or TorchScript as Optimum runs it) writes
transformers' ``LlamaAttention`` and the models that copy it (Qwen2/3, Mistral, Gemma, Phi-3),
at a fixed length or with symbolic axes (:mod:`.parts` for each piece, :mod:`.core` for the
Softmax's surroundings):
``Softmax(scale * Q @ K^T [+ mask])`` anchored at the Softmax, the NaN guard of the dynamo export
(``Where(IsNaN(p), 0, p)``: no row of a constant mask fused is all masked, and the rows of a
run-time mask that are go to the model's own branch, so no NaN arises),
``@ V``, and the merge of the heads back into ``(B, S, N*H)``; ``Q`` a split into heads,
rotated; ``K`` the same with its heads repeated; ``V`` likewise; and the nodes that only feed
these (the ``Shape`` arithmetic of a symbolic-length export). Attention with no rotation and no
causal mask (an encoder's) is left to :mod:`fusion.fuse_attention`. The op runs in float32 on
ONNX Runtime's CPU provider; its CUDA kernel takes float16 and bfloat16 only, so the pass is off
for CUDA runs (:func:`fusion.registry.provider_options`).

Exactness. Without a past, the query at position ``i`` of the call reads row ``i`` of the
op's caches. So the rotation is the op's own exactly when the model's ``cos`` and ``sin`` have
one row per position of the call, alike for every batch and head, with equal halves
(``cat(freqs, freqs)``, as transformers builds them): constant tables (the first halves become
the caches), or values computed at run time whose leading axes are 1 and which are
``cat(f, f)`` put through elementwise ops (:func:`.parts.runtime_table`; the caches are then
those ops applied to the model's own ``f``, so the op rotates by the very numbers the model
does). Tables of one row per batch row and position (the model's ``position_ids`` input) are
taken by ONNX's ``RotaryEmbedding`` alone, as ``(B, S, H/2)`` caches: with a KV cache or a
run-time mask, below (else refused, :func:`_check_per_batch`). The
mask (:mod:`.masks`) is evaluated where it comes from constants and the inputs' shapes alone:
0 on and below the diagonal and masked above it (``-inf``, or at most ``-1e30``, as
transformers' ``finfo.min``) gives ``causal=1``; all zeros, ``causal=0``; another constant mask
with no row all masked becomes ``attention_bias`` with ``causal=0``. The scale is the product of
every scalar factor on ``Q``, ``K`` and the scores.

With a KV cache (``present = Concat(past, rope(k))`` along the length, :func:`.parts.with_past`;
Optimum's and onnxruntime-genai's layout ``(B, K, P, H)``), or a mask computed at run time
without one (an ``attention_mask`` input to a prefill, a sliding window), the attention becomes
ONNX's own ``Attention`` with ``RotaryEmbedding`` of the query and the key (opset 23, the
model's opset raised to it, :mod:`.standard`): ONNX Runtime's CPU kernel of ``Attention``
computes every input the model accepts, where GroupQueryAttention's refuses a batch of several
sequences of several tokens after a past and gives NaN for a query all masked; the model's mask,
as the model computes it from its ``attention_mask`` (padding, the causal offset of the past), is
its ``attn_mask``, and the ``present`` outputs keep the model's names. A sliding-window cache
(Mistral's, Gemma 2's) crops the past before the new keys join it: the op's past is the cropped
one, and the mask, which the model adds to the scores, spans the keys wherever the model runs,
though its length is not provably theirs (:func:`.masks.mask_spans_keys`; only this op takes
it). In a decode step the three projections become one MatMul and a Split
(:func:`.build.projected`). Where the model's
opset is below 18 (onnxscript's version converter starts there) or its mask is not of a form
:func:`.standard.bias` takes, GroupQueryAttention takes the past (every key valid to it,
``seqlens_k = P + S - 1``) and the mask as its ``attention_bias`` (``causal=0``), rotating by the
model's ``S`` rows of ``cos``/``sin`` through ``position_ids = 0 .. S-1``
(:func:`.build.positions`), behind an ``If`` whose other branch is the model's own attention
(:mod:`.guard`), for the inputs its CPU kernel refuses or computes otherwise; the projections of
a decode step are then its packed query.

Left intact, with the reason in the report: a mask computed at run time that is not of the op's
``attention_bias`` shape ``(B | 1, N | 1, S, T)``; a mask computed from the inputs' sizes with
no rotation (an encoder's, :mod:`fusion.fuse_attention`'s); ``cos``/``sin`` not of the form
above; only one of ``Q`` and ``K`` rotated; a value inside read elsewhere; a split into heads of
unknown count or size (the TorchScript exporter's ``-1`` heads where neither ONNX's shape
inference nor ONNX Runtime's symbolic one computes them, :class:`fusion.FillShapes`); keys of
another length than the queries and no past (cross-attention); a value head size other than the
key's; head counts that do not group. Only a decoder's attention is a candidate (rotated, with a
past, or masked causally, :func:`.trace.heads_of`): an encoder's (no rotation, no causal mask,
as in a cross-attention of a UNet or an encoder-decoder) is left to :mod:`fusion.fuse_attention`
with no refusal here.
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
    """One attention to fuse (see the module docstring).

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
    ``Attention`` and ``RotaryEmbedding`` (see the module docstring); counted as
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
        ),
    )
    targets = ("ort",)
    option = "gqa"
    on_by_default = ("ort",)

    def match(self, model: ir.Model, node: ir.Node) -> GQAMatch | None:
        """The attention whose Softmax is ``node``, or None.

        Raises:
            CannotFuse: see the module docstring.
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
