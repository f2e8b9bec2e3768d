"""The refusal codes of :class:`~fusion.fold_batchnorm.FoldBatchNorm` (families ``batchnorm`` and
``affine``; :class:`~fusion.merge_branches.MergeBranches` meets them in the folds it makes)."""

from __future__ import annotations

import enum


class BatchNormCode(enum.StrEnum):
    """Why FoldBatchNorm left a candidate alone (the report's ``refused[].code``; the codes every
    pass shares are :class:`fusion.base.Code`)."""

    TRAINING_MODE = "training_mode"
    #: No Conv / ConvTranspose / Gemm / MatMul before it (or after it) to fold into.
    NO_LINEAR_LAYER = "no_linear_layer"
    #: The layer before it folds nothing, for no reason found on the way (a fallback).
    CHAIN_NOT_FOLDED = "chain_not_folded"
    #: The layer's weight has a shape it cannot have (not 2-D for Gemm / MatMul, < 3-D for Conv).
    WEIGHT_SHAPE = "weight_shape"
    #: The layer's bias does not fit its output channels.
    BIAS_SHAPE = "bias_shape"
    #: The BatchNorm parameters are not four vectors of one (C,) shape.
    PARAMETER_SHAPE = "parameter_shape"
    #: BatchNorm ``spatial=0`` (opset < 9): statistics per element, not per channel.
    SPATIAL_ZERO = "spatial_zero"
    #: ``input_var + epsilon`` is not positive for some channel.
    NONPOSITIVE_VARIANCE = "nonpositive_variance"
    #: The map's channels land on another axis of the layer than its channel axis.
    WRONG_CHANNEL_AXIS = "wrong_channel_axis"
    #: A reshape regroups the channels across dimensions of unknown size.
    CHANNELS_REGROUPED = "channels_regrouped"
    #: A Transpose ``perm`` that does not fit the rank of its input.
    PERM_MISMATCH = "perm_mismatch"
    #: A MaxPool on the way has its Indices output in use.
    MAXPOOL_INDICES_USED = "maxpool_indices_used"
    #: A MaxPool (GlobalMaxPool, ReduceMax) on the way, and a scale that is not positive: the
    #: max would become a min.
    MAXPOOL_NEGATIVE_SCALE = "maxpool_negative_scale"
    #: A mean or max (GlobalAveragePool, ReduceMean, ...) over an axis along which the map
    #: varies, such as the channels: the pooled map is no affine map of the pooled tensor.
    POOLS_OVER_CHANNELS = "pools_over_channels"
    #: A BatchNorm on a value of rank < 2.
    NO_CHANNEL_AXIS = "no_channel_axis"
    #: An op with a constant operand that is not an affine map of the tensor (constant / x).
    NOT_AFFINE = "not_affine"
    #: A division by a constant with a zero element.
    ZERO_DIVISOR = "zero_divisor"
    #: The Conv after a BatchNorm pads its input (a padded zero is not ``s * 0 + t``).
    PADDED_CONV = "padded_conv"
    #: The Gemm after a BatchNorm has ``transA=1``.
    GEMM_TRANS_A = "gemm_trans_a"
