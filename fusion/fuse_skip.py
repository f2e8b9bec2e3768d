"""Fuse a residual ``Add`` and the norm after it (and a dense layer's bias Add before it) into
ONNX Runtime's ``com.microsoft`` SkipLayerNormalization or SkipSimplifiedLayerNormalization.

The math, the kernels' conditions (:mod:`fusion._skip_norm` checks the norm's), the numerics
and the measurements behind where it runs: see docs/fusions/fuse_skip.md.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import (
    KnownShapes,
    const_array,
    label,
    replace_output,
    same_dim,
    same_shape,
    shape_text,
    sole_consumer,
)
from fusion._skip_norm import SkipCode, check_norm
from fusion.base import MS_DOMAIN, CannotFuse, Code, FusionPass, Kind, Op

#: Norm op (default domain) -> the com.microsoft op that adds the residual first.
SKIP_OPS = {
    "LayerNormalization": "SkipLayerNormalization",
    "SimplifiedLayerNormalization": "SkipSimplifiedLayerNormalization",
    "RMSNormalization": "SkipSimplifiedLayerNormalization",
}


def _is_bias(value: ir.Value) -> bool:
    """Whether ``value`` is a constant of rank < 2: a bias added to a layer, not a residual."""
    array = const_array(value)
    return array is not None and array.ndim < 2


def _is_residual(node: ir.Node | None) -> bool:
    """Whether ``node`` is an ``Add`` of two tensors, neither a bias (:func:`_is_bias`)."""
    return (
        node is not None
        and node.op_type == "Add"
        and node.domain == ""
        and not any(v is None or _is_bias(v) for v in node.inputs)
    )


def _bias_add(value: ir.Value, shapes: KnownShapes) -> tuple[ir.Node, ir.Value, ir.Value] | None:
    """``(add, x, bias)`` where ``value = Add(x, bias)`` (either order), ``bias`` a constant 1-D
    vector as long as the last axis of ``value`` and of its type, ``x`` of the shape of
    ``value``, and ``value`` read by one node only (no graph output); None otherwise."""
    node = value.producer()
    if node is None or (node.op_type, node.domain) != ("Add", "") or sole_consumer(value) is None:
        return None
    shape, dtype = shapes(value), shapes.dtype(value)
    for x, bias in (node.inputs, node.inputs[::-1]):
        array, x_shape = const_array(bias), shapes(x) if x is not None else None
        if (
            array is not None
            and array.ndim == 1
            and x_shape is not None
            and shape is not None
            and same_dim(shape[-1], array.shape[0])
            and shapes.dtype(bias) == dtype
            and same_shape(x_shape, shape)
        ):
            return node, x, bias
    return None


def _absorb_bias(
    data: ir.Value, skip: ir.Value, shapes: KnownShapes
) -> tuple[ir.Value, ir.Value, tuple[ir.Node, ir.Value] | None]:
    """``(input, skip, (add, bias))``: the Skip op's operands with the bias Add
    (:func:`_bias_add`) that makes ``data``, or else ``skip``, looked through; ``(data, skip,
    None)`` when neither is one."""
    for operand in (data, skip):
        if (found := _bias_add(operand, shapes)) is not None:
            add, x, bias = found
            return (x, skip, (add, bias)) if operand is data else (data, x, (add, bias))
    return data, skip, None


def _residual_before(norm: ir.Node, shapes: KnownShapes) -> tuple[ir.Node | None, ir.Node | None]:
    """``(add, cast)``: the node that makes the norm's input, looking through a Cast to the type
    it already has (``cast``, a no-op; None when there is no Cast).

    Raises:
        CannotFuse: ``cast_between``: a Cast that changes the type lies between a residual Add
            (:func:`_is_residual`) and the norm; moving it is not exact
            (docs/fusions/fuse_skip.md).
    """
    value = norm.inputs[0]
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Cast" or node.domain != "":
        return node, None
    before = node.inputs[0].producer() if node.inputs[0] is not None else None
    if not _is_residual(before):
        return None, None
    source, to = shapes.dtype(node.inputs[0]), ir.DataType(node.attributes.get_int("to"))
    if source == to:
        return before, node
    name = source.name if source is not None else "a type not recorded"
    raise CannotFuse(
        SkipCode.CAST_BETWEEN,
        f"a Cast from {name} to {to.name} lies between the residual Add and the norm: the Add "
        f"rounds its sum to {name} before the Cast, and the Skip op would add in the norm's type "
        "without that rounding (moving the Cast changes how the sum rounds)",
    )


def _order(a: ir.Value, b: ir.Value, shapes: KnownShapes) -> tuple[ir.Value, ir.Value]:
    """``(input, skip)``: the Add operands in the roles the Skip op accepts.

    Raises:
        CannotFuse: ``unknown_shape``, ``unsupported_rank`` (neither is 2-D or 3-D) or
            ``shape_mismatch`` (no pair the Skip op accepts).
    """
    shape_a, shape_b = shapes(a), shapes(b)
    if shape_a is None or shape_b is None:
        unknown = a if shape_a is None else b
        raise CannotFuse(
            Code.UNKNOWN_SHAPE, f"the shape of the Add operand '{unknown.name}' is unknown"
        )
    for data, skip, data_shape, skip_shape in ((a, b, shape_a, shape_b), (b, a, shape_b, shape_a)):
        if len(data_shape) not in (2, 3):
            continue
        if same_shape(data_shape, skip_shape):
            return data, skip
        rows = data_shape.dims[1:]  # (S, H) of a 3-D input
        if len(data_shape) == 3 and (
            same_shape(skip_shape.dims, rows) or same_shape(skip_shape.dims, (1, *rows))
        ):
            return data, skip
    ranks = {len(shape_a), len(shape_b)}
    if not ranks & {2, 3}:
        raise CannotFuse(
            Code.UNSUPPORTED_RANK,
            f"the Add operands have rank {max(ranks)}: the Skip op takes 2-D or 3-D inputs",
        )
    raise CannotFuse(
        Code.SHAPE_MISMATCH,
        f"the Add operands have shapes {shape_text(shape_a)} and {shape_text(shape_b)}: the Skip "
        "op needs equal shapes, or for a 3-D input (B, S, H) a skip of (1, S, H) or (S, H)",
    )


class FuseSkip(FusionPass):
    """Fuse ``norm(Add(a, b))`` into ``com.microsoft`` SkipLayerNormalization or
    SkipSimplifiedLayerNormalization (the math and the conditions: docs/fusions/fuse_skip.md).

    Only the main graph is rewritten. The model's ``com.microsoft`` opset import (version 1) is
    added when a fusion needs it. Running the pass twice changes nothing the second time.

    Each fusion is a ``skip_fused`` outcome; each candidate left alone a ``skip`` refusal.
    Runs for ``target="ort"`` only, when ``optimize(skip=True)``; with ``skip="kv_cache"``
    (:attr:`skip`) every candidate in a model with a KV cache, and in a model without one only
    those that absorb a dense layer's bias and whose sum the norm alone reads.
    """

    kinds = (
        Kind(
            "skip_fused",
            "skip",
            (
                Op("SkipLayerNormalization", MS_DOMAIN),
                Op("SkipSimplifiedLayerNormalization", MS_DOMAIN),
            ),
            meaning="residual Add + norm made com.microsoft `Skip(Simplified)LayerNormalization`",
        ),
    )
    summary = "a residual Add and the norm after it into Skip(Simplified)LayerNormalization"
    codes = SkipCode
    targets = ("ort",)
    option = "skip"
    settings = ("skip",)
    #: The policy's ``skip``: ``"kv_cache"`` fuses everything only in a model with a KV cache
    #: (:func:`has_kv_cache`), elsewhere only the candidates that absorb a bias, their sum read
    #: by the norm alone; True (or False, the policy's default, where the pass is made directly)
    #: fuses every candidate.
    skip: bool | str

    def apply(self, model: ir.Model) -> bool:
        """Fuse in place; return whether anything was fused."""
        graph = model.graph
        shapes = KnownShapes(model)
        # CPU mode without a KV cache: only the candidates that absorb a bias (two Adds go) and
        # do not keep the sum (output 3).
        bias_only = self.skip == "kv_cache" and not has_kv_cache(model)
        version = model.opset_imports.get(MS_DOMAIN, 1)
        modified = False
        for norm in [n for n in graph if n.domain == "" and n.op_type in SKIP_OPS]:
            if label(norm) in self.excluded:
                continue
            add = None
            try:
                add, cast = _residual_before(norm, shapes)
                if not _is_residual(add):
                    continue
                check_norm(norm, shapes)
                data, skip = _order(*add.inputs, shapes)
                if version != 1:
                    raise CannotFuse(
                        SkipCode.MS_OPSET_VERSION,
                        f"the model imports com.microsoft version {version}; the Skip ops are "
                        "version 1",
                    )
            except CannotFuse as refusal:
                if not bias_only or (
                    add is not None and any(_bias_add(v, shapes) for v in add.inputs)
                ):
                    self.refused(norm, refusal)
                continue
            data, skip, bias = _absorb_bias(data, skip, shapes)
            reader = sole_consumer(add.outputs[0])  # the norm (or the no-op Cast) alone, or None
            if bias_only and (bias is None or reader is None or reader not in (norm, cast)):
                continue  # no bias, or the sum read elsewhere too (a pre-norm residual stream)
            if cast is not None:  # a no-op: its readers read the sum itself
                replace_output(graph, cast.outputs[0], cast.inputs[0])
                graph.remove(cast, safe=True)
            became = self._fuse(graph, add, norm, (data, skip), bias)
            model.opset_imports[MS_DOMAIN] = 1
            self.fused(norm, became)
            modified = True
        if modified:
            graph.sort()
        return modified

    @staticmethod
    def _fuse(
        graph: ir.Graph,
        add: ir.Node,
        norm: ir.Node,
        operands: tuple[ir.Value, ir.Value],
        bias: tuple[ir.Node, ir.Value] | None,
    ) -> str:
        """Replace ``add`` and ``norm`` (and the bias Add of ``bias``, whose vector becomes the
        Skip op's ``bias`` input) by one Skip node; return what it became."""
        op_type = SKIP_OPS[norm.op_type]
        params: list[ir.Value | None] = [v for v in norm.inputs[1:3] if v is not None]
        removed = [norm, add]
        if bias is not None:  # input 4 of SkipLayerNormalization, 3 of the Simplified one
            slots = 2 if op_type == "SkipLayerNormalization" else 1
            params = [*params, *[None] * (slots - len(params)), bias[1]]
            removed.append(bias[0])
        total = add.outputs[0]
        keeps_sum = sole_consumer(total) is not norm
        fused = ir.Node(
            MS_DOMAIN,
            op_type,
            [*operands, *params],
            attributes=[ir.AttrFloat32("epsilon", norm.attributes.get_float("epsilon", 1e-5))],
            num_outputs=4 if keeps_sum else 1,
            name=f"{label(norm)}_skip",
        )
        graph.insert_after(add, fused)
        replace_output(graph, norm.outputs[0], fused.outputs[0])
        if keeps_sum:
            fused.outputs[1].name = fused.outputs[2].name = ""  # mean, inv_std_var: not computed
            replace_output(graph, total, fused.outputs[3])
        graph.remove(removed, safe=True)
        with_bias = " with the bias" if bias is not None else ""
        return op_type + with_bias + (" (with the sum as output 3)" if keeps_sum else "")


def has_kv_cache(model: ir.Model) -> bool:
    """Whether ``model`` holds an attention op that takes a past key (ONNX's ``Attention``, its
    input 4; com.microsoft ``GroupQueryAttention`` or ``MultiHeadAttention``, input 3 or 6), in
    a subgraph too: a decode step's model, as the attention passes leave it."""
    inputs = {("", "Attention"): 4, (MS_DOMAIN, "GroupQueryAttention"): 3}
    inputs[(MS_DOMAIN, "MultiHeadAttention")] = 6
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        index = inputs.get((node.domain, node.op_type))
        if index is not None and len(node.inputs) > index and node.inputs[index] is not None:
            return True
    return False
