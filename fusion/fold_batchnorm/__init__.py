"""Fold eval-mode BatchNorm (and hand-written per-channel affine chains) into a linear layer.

The math
--------
ONNX ``BatchNormalization`` in inference mode (https://onnx.ai/onnx/operators/onnx__BatchNormalization.html,
opsets 9 to 15 alike when ``training_mode`` is 0) computes, per channel ``c`` of axis 1::

    Y = (X - input_mean) / sqrt(input_var + epsilon) * scale + B

which is a per-channel affine map ``y = s * x + t`` with::

    s = scale / sqrt(input_var + epsilon)
    t = B - input_mean * s

Constant ``Mul`` / ``Add`` / ``Sub`` / ``Div`` ops whose constant varies only along the channel
axis are affine maps of the same kind (``x / c`` is ``x * (1/c)``, exact only where no element of
``c`` is 0), and affine maps compose: ``a2 * (a1 * x + b1) + b2 = (a2 * a1) * x + (a2 * b1 + b2)``.
So a whole chain (a BatchNorm written by hand, ``(x - mean) / sqrt(var + eps) * gamma + beta``;
torchvision's FrozenBatchNorm2d ``x * scale + shift``; a Conv or ConvTranspose bias exported as a
separate Add) reduces to one ``(s, t)``.

A linear layer ``z = W x + b`` with output channel ``c`` absorbs it as ``W'[c] = s[c] * W[c]``,
``b'[c] = s[c] * b[c] + t[c]`` (a missing bias is 0). Where the channel sits in ``W``:

- Conv: ``W`` is ``(C_out, C_in/group, k...)``: scale axis 0 (any group count).
- ConvTranspose: ``W`` is ``(C_in, C_out/group, k...)``: output channel ``g * C_out/group + j``
  is ``W[g * C_in/group : (g+1) * C_in/group, j]``, so the scale goes on axis 1, per group.
- Gemm ``alpha * A @ B' + beta * C`` (``B' = B^T`` when ``transB``): scale the columns of ``B'``;
  ``C' = beta * C * s + t`` and ``beta`` becomes 1. The BatchNorm channel is axis 1 of ``(N, C)``.
- MatMul ``x @ W`` with a constant 2-D ``W``: the channel is the last axis of the output; scale
  the columns of ``W`` and add the bias with a new ``Add`` (MatMul has no bias input).

Every new weight is computed in float64 and cast back to the weight's dtype.

A BatchNorm *before* a layer folds into it too, when every output of the layer sees only
BatchNorm outputs: ``W (s x + t) + b = (W s) x + (W t + b)``, with ``s`` on the layer's input
channel axis and ``W t`` summed over the input channels and kernel taps. That holds for a Conv
with no padding (a padded Conv pads *after* the BatchNorm in the original, and a zero there is
not ``s * 0 + t``), for a Gemm with ``transA = 0`` and for a MatMul, whose input channels are
the last axis of its input.

Ops between the layer and the BatchNorm
---------------------------------------
A per-element affine map ``s * x + t`` (``s``, ``t`` broadcast against ``x``) moves across an
op ``f`` when ``f(s * x + t) = s' * f(x) + t'`` for constants ``s'``, ``t'``:

- Transpose, Reshape, Flatten, Squeeze, Unsqueeze, Identity only move elements: ``s'`` and
  ``t'`` are ``s`` and ``t`` moved the same way (transposed; for a reshape, the axes that the
  reshape regroups must have static sizes unless the map is constant along them).
- MaxPool: ``max_i(s * x_i + t) = s * max_i(x_i) + t`` when ``s > 0`` and ``s``, ``t`` are the
  same over the pooling window (per channel). A negative scale turns the max into a min, so
  a BatchNorm with any negative scale does not move across a MaxPool (MaxPool's padding is
  ignored by the max, and its Indices output must be unused). GlobalMaxPool and ReduceMax
  alike, over axes along which ``s`` and ``t`` are constant.
- Global mean pooling (GlobalAveragePool; ReduceMean over axes given as an attribute below
  opset 18 or as a constant input from 18, ``keepdims`` 0 or 1): ``mean_i(s * x_i + t) =
  s * mean_i(x_i) + t`` for any sign of ``s``, when ``s`` and ``t`` are constant along the
  reduced axes, i.e. the mean is not over the channels. Neither pads.

So ``Linear -> Transpose -> BatchNorm1d -> Transpose`` (``bn(linear(x).transpose(1, 2))
.transpose(1, 2)`` on a (B, T, C) input), ``Linear -> Reshape(-1, C) -> BatchNorm1d ->
Reshape`` and ``Conv -> MaxPool -> BatchNorm`` fold into the layer before, and CREPE's last
``BatchNorm -> MaxPool -> Transpose -> Reshape -> Linear`` folds into the classifier after it
(channel ``c`` of the BatchNorm becomes input features ``f`` with ``(f // inner) % C == c``).
After a MaxPool, the combined scale of everything folded across it must stay positive.

A ResNet's head, ``residual Add -> BatchNorm -> global mean pooling -> Flatten -> Linear``, has
no layer before the BatchNorm (the Add sums two branches), but the map passes through the mean
and folds into the classifier: ``W (s * mean(x) + t) + b = (W s) mean(x) + (W t + b)``. The
values after the BatchNorm may branch (a pooled tensor read by two heads): it folds when every
reader, through the ops above, ends at a layer that can absorb it, into each of them; a reader
that cannot (another op, a graph output) leaves it in place.

What is counted as a BatchNorm
------------------------------
``batchnorm_folded`` counts BatchNormalization nodes, and BatchNorms written by hand: a chain of
constant ops (no BatchNormalization) that scales per channel (Mul or Div by a constant of more
than one element) and shifts per channel as a BatchNorm does, subtracting a per-channel
constant (the running mean: ``(x - mean) / sqrt(var + eps) * gamma + beta``) or adding one
after the scale (beta: FrozenBatchNorm2d's ``x * scale + shift``). Any other fold is an
``affine_folded``: scalar scalings (attention's ``1/sqrt(d)``) and per-channel "layer scales"
without a shift after them (ConvNeXt's and PoolFormer's ``gamma * x``, CaiT's LayerScale, also
after the layer's own bias Add), which are no normalization.

The graph
---------
::

    before                                     after

    x ─ Conv(W, b) ─ BatchNormalization ─ y    x ─ Conv(W', b') ─ y
    x ─ Conv(W, b) ─ Sub ─ Div ─ Mul ─ Add ─ y x ─ Conv(W', b') ─ y
    x ─ MatMul(W) ─ Add(b) ─ BatchNorm ─ y     x ─ MatMul(W') ─ Add(b') ─ y
    x ─ BatchNorm ─ Conv(W, b, pads=0) ─ y     x ─ Conv(W', b', pads=0) ─ y
    x ─ MatMul ─ Add ─ Transpose ─ BN ─ T ─ y  x ─ MatMul(W') ─ Add(b') ─ Transpose ─ T ─ y
    x ─ BN ─ MaxPool ─ Transpose ─ Reshape ─ Gemm(W, b) ─ y
                                               x ─ MaxPool ─ Transpose ─ Reshape ─ Gemm(W', b') ─ y
    a ─ Add ─ BN ─ GlobalAveragePool ─ Flatten ─ Gemm(W, b) ─ y
                                          a ─ Add ─ GlobalAveragePool ─ Flatten ─ Gemm(W', b') ─ y

Everything else is left alone and recorded in the :class:`~fusion.base.FusionReport` with a
stable :class:`~fusion.base.Code` and the reason: a BatchNorm after a ReLU (``no_linear_layer``;
CREPE's conv -> ReLU -> BN -> max-pool -> conv, its zero pad the Conv's after the clean-up, is
``padded_conv``: the reason of the layer after it), a layer whose output has another
consumer (``shared_output``), a constant that is not per-channel (``not_per_channel``), a
division by a constant with a zero element (``zero_divisor``), a BatchNorm in training mode
(``training_mode``), a padded Conv after a BatchNorm (``padded_conv``), a MaxPool between a
layer and a BatchNorm with a scale that is not positive (``maxpool_negative_scale``), a reshape
that regroups the channels across dimensions of unknown size (``channels_regrouped``), a mean
or max over the channel axis (``pools_over_channels``), channels that reach the layer on
another axis than its input features (``wrong_channel_axis``). Only the main graph is
rewritten (not If / Loop bodies). A constant Add or Sub that follows a layer with no scale
before it (a Mul, a Div, a BatchNorm) is a bias or an embedding (a ViT's positional embedding
after its patch Conv), no candidate: left alone with no refusal, as a chain of shifts alone
is not folded either.

The code
--------
:mod:`~fusion.fold_batchnorm.algebra` (BatchNorm and constant ops as ``(s, t)``, the layers,
the per-channel checks), :mod:`~fusion.fold_batchnorm.across` (moving a map across Transpose /
Reshape / MaxPool ...), :mod:`~fusion.fold_batchnorm.after` (fold into the layer before the
BatchNorm: the walk down its readers), :mod:`~fusion.fold_batchnorm.before` (fold into the
layer after it).
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import KnownShapes, label
from fusion.base import CannotFuse, Code, FusionPass, Kind, Op
from fusion.fold_batchnorm.across import ACROSS
from fusion.fold_batchnorm.after import chain_after, explain, fold_chain_after
from fusion.fold_batchnorm.algebra import LINEAR, batchnorm_affine
from fusion.fold_batchnorm.before import fold_into_next

__all__ = ["FoldBatchNorm"]


class FoldBatchNorm(FusionPass):
    """Fold inference-mode BatchNormalization and per-channel affine chains into linear layers.

    See the package docstring for the math and the cases. Weights may be float16, float32 or
    float64; folding is computed in float64 and cast back. Graph outputs keep their names.

    Outcomes: each fold is a ``batchnorm_folded`` that counts one per BatchNormalization
    folded, or one for a BatchNorm written by hand (a per-channel scale with the mean
    subtracted or a shift added after it: the package docstring, "What is counted as a
    BatchNorm"); any other chain of constants (a scalar, a per-channel layer scale) is an
    ``affine_folded``. Each candidate left alone
    (every BatchNormalization still in the graph, and every constant Mul / Div after a
    linear layer, or Add / Sub after a scale, that could not be folded) is a ``batchnorm``
    refusal with a code of
    the "BatchNorm and affine folding" section of :class:`~fusion.base.Code` or a shared one.

    Running the pass a second time changes nothing. It raises no errors of its own: a graph it
    cannot read as foldable is left as it is and explained in the report.
    """

    kinds = (
        Kind("batchnorm_folded", "batchnorm", (Op("BatchNormalization"),)),
        Kind("affine_folded", "affine", norm=False),
    )

    def apply(self, model: ir.Model) -> bool:
        """Fold in place; return whether anything was folded."""
        graph = model.graph
        shapes = KnownShapes(model)
        # candidate (or op on the way) -> why it was not folded
        stops: dict[ir.Node, CannotFuse] = {}
        left: set[ir.Node] = set()  # the chains of the layers excluded: left as they are
        modified = False
        for node in [n for n in graph if n.op_type in LINEAR]:
            if label(node) in self.excluded:
                left.update(chain_after(node, stops, shapes))
                continue
            folded = fold_chain_after(graph, node, stops, shapes)
            if folded is not None:
                self.fused(folded.node, folded.became, kind=folded.kind, count=folded.count)
                modified = True
        for bn in [n for n in graph if n.op_type == "BatchNormalization" and n not in left]:
            if label(bn) not in self.excluded:
                modified |= self._fold_into_next(graph, bn, stops, shapes)
        for node in graph:
            if node in stops and node.op_type not in ACROSS and node not in left:
                self.refused(node, stops[node])
        return modified

    def _fold_into_next(
        self,
        graph: ir.Graph,
        bn: ir.Node,
        stops: dict[ir.Node, CannotFuse],
        shapes: KnownShapes,
    ) -> bool:
        """Fold ``bn`` into the layer after it, or record in ``stops`` why not; True if folded."""
        try:
            batchnorm_affine(bn)
        except CannotFuse as refusal:
            stops[bn] = refusal
            return False
        name = label(bn)
        try:
            became = fold_into_next(graph, bn, shapes)
        except CannotFuse as after:
            before = stops.get(bn) or explain(bn.inputs[0], stops, shapes)
            stops[bn] = _both(before, after)
            return False
        stops.pop(bn, None)
        self.fused(name, became)
        return True


def _both(before: CannotFuse, after: CannotFuse) -> CannotFuse:
    """One refusal for a BatchNorm that folds neither into the layer before it (``before``)
    nor into the layer after it (``after``): both details, and one code."""
    # The code is the more informative of the two: the reason from the layer before, unless
    # there is none before (no_linear_layer) and there is one after that refused (any code but
    # no_linear_layer): then that layer's reason, e.g. padded_conv or maxpool_negative_scale.
    no_layer = Code.NO_LINEAR_LAYER
    code = after.code if before.code == no_layer and after.code != no_layer else before.code
    detail = f"{before.detail}; and it cannot fold into the layer after it: {after.detail}"
    return CannotFuse(code, detail)
