"""Fuse an encoder's attention into ONNX Runtime's contrib ``Attention`` /
``MultiHeadAttention`` with onnxscript's own rules, then expand a bias to the shape the kernels
take, pack the projections (:mod:`fusion.pack_attention`) and pass a key and value already in
heads as they are (:class:`FuseAttention`; ``target="ort"`` only).

Which rules are applied and which left out, what is left to FuseSDPA, and the measurements: see
docs/fusions/fuse_attention.md.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.rewriter import RewriteRuleSet
from onnxscript.rewriter.ort_fusions import (
    attention,
    mha,
    mha_bias,
    mha_scale,
    sdpa,
    sdpa_via_mha,
    shape_optimization,
)

from fusion import pack_attention
from fusion._inference import infer_shapes
from fusion._ir import (
    add_initializer,
    const_array,
    dims,
    label,
    opset_version,
    producer,
    same_dim,
)
from fusion._scopes import scopes
from fusion.base import MS_DOMAIN, FusionPass, Kind, Op
from fusion.fuse_sdpa import layout

#: onnxscript's rule sets in fuse_xformers' order (those its ``fuse_sdpa``, ``fuse_mha1``,
#: ``fuse_mha2``, ``fuse_mha_scale``, ``fuse_mha_bias``, ``fuse_attention`` and
#: ``replace_sdpa_by_mha`` apply; not its GELU rules, see above; two are private names of
#: onnxscript 0.7, which the project pins), each with whether shape inference follows it (the
#: sdpa rule adds nodes whose shapes the mha rules check).
_RULES = (
    (sdpa.sdpa_rules, True),
    (mha.mha_rules_with_past, False),
    (mha.mha_rules_no_past, False),
    (mha_scale._mha_scale_rules, False),
    (mha_bias.mha_bias_rules, False),
    (attention.attention_rules, False),
    (sdpa_via_mha._rules, False),
)

#: The domain of the intermediate ops onnxscript's rules make and consume (its sdpa rule's
#: ``SDPA``).
_FUSION_DOMAIN = "ai.onnxruntime._fusion"

#: ``node.meta`` key of the nodes a rule made: ``(op_type, label)`` of every node of the graph
#: before the pass that the rewrites leading to it replaced.
_ORIGIN = "fusion.origin"

#: The op of the input graph that anchors each kind's rewrite (:attr:`Fused.node`): an
#: attention's Softmax, a GELU's Erf or Tanh; stable from run to run, where the names of the
#: nodes onnxscript makes are not.
_ANCHOR_OPS = {"attention_fused": ("Softmax",)}

# Shape inference that fails (an op ONNX does not know, a model over 2 GB) leaves the model as
# it is and the rules that need shapes do not match; its warning and traceback are not a
# user's concern.
_shape_log = logging.getLogger("onnx_ir.passes.common.shape_inference")


class FuseAttention(FusionPass):
    """Rewrite attention subgraphs into com.microsoft contrib ops (in place).

    Records one ``attention_fused`` per Attention / MultiHeadAttention node that the pass
    added.

    Runs for ``target="ort"``, by default or when ``optimize(attention=True)``. With the
    policy's ``threads`` above 1 (the CPU provider), an attention whose batch times heads is
    fewer is not made one of these ops; FuseSDPA then leaves it too, with the code
    ``few_heads`` (docs/fusions/fuse_attention.md). onnxscript's rule sets rewrite the subgraphs
    of the graph they are given too: the pass runs once, on the main graph
    (:attr:`~fusion.base.FusionPass.reaches_subgraphs`), and records each op it added with the
    path of the subgraph it is in; an anchor excluded in any graph is excluded in all.
    """

    kinds = (
        Kind(
            "attention_fused",
            "attention",
            (Op("Attention", MS_DOMAIN), Op("MultiHeadAttention", MS_DOMAIN)),
            norm=False,
            meaning=(
                "attention made com.microsoft `Attention` / `MultiHeadAttention` (`--target ort`)"
            ),
        ),
    )
    summary = (
        "an encoder's attention into ONNX Runtime's contrib Attention with onnxscript's rules, ORT "
        "only"
    )
    targets = ("ort",)
    option = "attention"
    on_by_default = ("ort",)
    settings = ("threads",)
    reaches_subgraphs = True
    #: The policy's ``threads``: no Attention / MultiHeadAttention of fewer (batch, head) pairs.
    threads: int

    def apply(self, model: ir.Model) -> bool:
        """Fuse in place; return whether a contrib op was added."""
        before = set(self._fused_nodes(model))
        level = _shape_log.level
        _shape_log.setLevel(logging.ERROR)
        try:
            infer_shapes(model)  # the attention rules check shapes
            shape_optimization.rules.apply_to_model(model)
            excluded = frozenset(node for _, node in self.exclude)
            for rules, reinfer in _RULES:
                traced = [_Traced(rule, excluded, self.threads) for rule in rules.rules]
                RewriteRuleSet(traced).apply_to_model(model)
                if reinfer:
                    infer_shapes(model)
        finally:
            _shape_log.setLevel(level)
        # the sdpa rule makes onnxscript functions; those no later rule consumed are inlined
        common_passes.InlinePass()(model)
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.domain == MS_DOMAIN and node.op_type in ("Attention", "MultiHeadAttention"):
                _bias_for_kernel(model, node)
            if node.domain == MS_DOMAIN and node.op_type == "MultiHeadAttention":
                _pass_kv_in_heads(node)
                pack_attention.pack(node.graph, node)
        common_passes.RemoveUnusedNodesPass()(model)
        common_passes.RemoveUnusedFunctionsPass()(model)
        paths = {scope.graph: scope.path for scope in scopes(model)}
        added = [n for n in self._fused_nodes(model) if n not in before]
        for node in added:
            kind = next(k for k in self.kinds if Op(node.op_type, node.domain) in k.ops)
            path = paths.get(node.graph)
            self.fused(_anchor(node, kind.name), node.op_type, kind=kind.name, path=path)
        return bool(added)

    def _fused_nodes(self, model: ir.Model) -> list[ir.Node]:
        """The nodes of :attr:`kinds`' ops in ``model``'s graph and its subgraphs, in order."""
        ops = {op for kind in self.kinds for op in kind.ops}
        nodes = ir.traversal.RecursiveGraphIterator(model.graph)
        return [n for n in nodes if Op(n.op_type, n.domain) in ops]


class _Traced:
    """One of onnxscript's rewrite rules, as its rule set calls it, that records where the nodes
    it makes come from (:data:`_ORIGIN`) and refuses a match that would replace a node whose
    label is in ``excluded`` (or a node made from one), make an attention op of fewer
    (batch, head) pairs than ``threads`` (:func:`_few_heads`), or take a query that is part of
    a packed projection (:func:`_packed`)."""

    def __init__(self, rule, excluded: frozenset[str], threads: int = 1):
        self._rule = rule
        self._excluded = excluded
        self._threads = threads

    def __getattr__(self, name: str):
        return getattr(self._rule, name)

    def try_rewrite(self, model, graph_or_function, node, **kwargs):
        """The rule's replacement for the match at ``node``, or None (no match, or excluded)."""
        delta = self._rule.try_rewrite(model, graph_or_function, node, **kwargs)
        if delta is None:
            return None
        origin = frozenset().union(*map(_origin, delta.match.nodes))
        if any(name in self._excluded for _, name in origin) or any(
            _few_heads(new, self._threads) or _packed(new) for new in delta.new_nodes
        ):
            for new in delta.new_nodes:  # made, never inserted: no longer a reader of the graph
                for index in range(len(new.inputs)):
                    new.replace_input_with(index, None)
            return None
        for new in delta.new_nodes:
            new.meta[_ORIGIN] = origin
        return delta


def _few_heads(node: ir.Node, threads: int) -> bool:
    """Whether ``node`` is the scaled dot-product attention onnxscript's sdpa rule makes (the
    op every attention rule after it consumes) on a 4-D query ``(B, N, S, H)`` whose batch (1
    where unknown) times heads is below ``threads``; a query of unknown heads is not."""
    if node.domain != _FUSION_DOMAIN or node.op_type != "SDPA" or threads <= 1:
        return False
    shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
    if shape is None or len(shape) != 4 or not isinstance(shape[1], int):
        return False
    batch = shape[0] if isinstance(shape[0], int) else 1
    return batch * shape[1] < threads


def _packed(node: ir.Node) -> bool:
    """Whether ``node`` is onnxscript's scaled dot-product attention on a query that is a part
    of a packed projection (timm's ``qkv``, :mod:`fusion.fuse_sdpa.layout`): left to FuseSDPA
    (why: docs/fusions/fuse_attention.md)."""
    if node.domain != _FUSION_DOMAIN or node.op_type != "SDPA" or not node.inputs:
        return False
    view = layout.of(node.inputs[0]) if node.inputs[0] is not None else None
    return view is not None and view.packed is not None


def _origin(node: ir.Node) -> frozenset[tuple[str, str]]:
    """``(op_type, label)`` of the nodes of the input graph that ``node`` stands for."""
    return node.meta.get(_ORIGIN) or frozenset({(node.op_type, label(node))})


def _anchor(node: ir.Node, kind: str) -> str:
    """The anchor of the rewrite that made ``node``: the label of the input graph's node of
    :data:`_ANCHOR_OPS` it replaced (the first by name), else the first label it replaced."""
    origin = sorted(_origin(node), key=lambda o: o[1])
    ops = _ANCHOR_OPS[kind]
    return next((name for op, name in origin if op in ops), origin[0][1])


def _bias_for_kernel(model: ir.Model, node: ir.Node) -> None:
    """Expand the ``attention_bias`` of ``node``, a MultiHeadAttention or Attention
    (com.microsoft), to ``(.., S, L)`` where it may be broadcast along the query's length ``S``
    or the key's ``L`` (a padding mask of one column, ``(B, 1, S, 1)``): onnxscript's rules pass
    the model's bias as it is, ONNX Runtime's kernels refuse one whose last two axes are not
    ``(S, L)``. Exact: the op adds the bias broadcast to the scores, the Expand only repeats it
    (docs/fusions/fuse_attention.md). Left as it is with a past key (the total length is then
    the past's too), or a query or key of unknown shape or other than a 3-D query and a 3-D or
    4-D key."""
    inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
    mha = node.op_type == "MultiHeadAttention"
    bias, query, past = inputs[5], inputs[0], inputs[6 if mha else 4]
    key = inputs[1] if mha else query  # Attention: self-attention on its one input
    if bias is None or past is not None or opset_version(model) < 15:
        return
    q, k, b = dims(query), dims(key), dims(bias)
    if q is None or len(q) != 3 or k is None or len(k) not in (3, 4):
        return
    axis = len(k) - 2  # the key's length: (B, L, D) or (B, N, L, H)
    rows = [q[1], k[axis]]
    if b is not None and len(b) == 4 and all(map(same_dim, b[2:], rows)):
        return
    graph, made = model.graph, []  # the main graph's initializers: a subgraph reads them too
    if all(isinstance(r, int) for r in rows):
        shape = add_initializer(graph, "attention_bias_shape", np.array([1, 1, *rows], np.int64))
    else:
        made += [
            ir.node("Shape", [query], {"start": 1, "end": 2}),
            ir.node("Shape", [key], {"start": axis, "end": axis + 1}),
        ]
        ones = add_initializer(graph, "attention_bias_ones", np.ones(2, np.int64))
        made.append(ir.node("Concat", [ones, *(n.outputs[0] for n in made)], {"axis": 0}))
        shape = made[-1].outputs[0]
    made.append(ir.node("Expand", [bias, shape]))
    node.graph.insert_before(node, made)
    node.replace_input_with(5, made[-1].outputs[0])


def _pass_kv_in_heads(mha: ir.Node) -> None:
    """Feed a MultiHeadAttention the ``(B, N, L, H)`` key and value its 3-D ones were made from.

    Rewrites only when both key and value are ``Reshape(Transpose(x, perm=[0, 2, 1, 3]),
    [0, 0, -1 or N*H])`` of a rank-4 ``x`` whose axis 1 is the op's ``num_heads`` and whose
    head size is known, the op has no bias, past key or past value, and key and value have one
    shape (why that is exact, and the sources: docs/fusions/fuse_attention.md).
    """
    inputs = list(mha.inputs) + [None] * (8 - len(mha.inputs))
    if any(inputs[i] is not None for i in (3, 6, 7)):  # bias, past_key, past_value
        return
    num_heads = mha.attributes.get_int("num_heads")
    sources = [_split_heads_source(inputs[i], num_heads) for i in (1, 2)]
    if None in sources or not _same_shape(*sources):
        return
    for index, source in zip((1, 2), sources, strict=True):
        mha.replace_input_with(index, source)


def _split_heads_source(value: ir.Value | None, num_heads: int | None) -> ir.Value | None:
    """``x`` when ``value`` is ``Reshape(Transpose(x, perm=[0, 2, 1, 3]), [0, 0, -1 or N*H])``
    with ``x`` of shape ``(B, num_heads, L, H)`` and H known; else None."""
    reshape = producer(value, "Reshape")
    if reshape is None or reshape.attributes.get_int("allowzero", 0) != 0:
        return None
    transpose = producer(reshape.inputs[0], "Transpose")
    if transpose is None or list(transpose.attributes.get_ints("perm", ())) != [0, 2, 1, 3]:
        return None
    source = transpose.inputs[0]
    shape = source.shape
    if shape is None or len(shape) != 4 or shape[1] != num_heads or not isinstance(shape[3], int):
        return None
    target = const_array(reshape.inputs[1]) if len(reshape.inputs) > 1 else None
    if target is None or target.tolist() not in ([0, 0, -1], [0, 0, num_heads * shape[3]]):
        return None
    return source


def _same_shape(key: ir.Value, value: ir.Value) -> bool:
    """Whether ``key`` and ``value`` have one shape, axis by axis: equal sizes, or symbolic axes
    of one name (an axis with no name may differ)."""
    if key.shape is None or value.shape is None or len(key.shape) != len(value.shape):
        return False
    return all(
        a == b and (isinstance(a, int) or a.value is not None)
        for a, b in zip(key.shape, value.shape, strict=True)
    )
