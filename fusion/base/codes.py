"""Why a candidate was left alone: the stable refusal :class:`Code` and :class:`CannotFuse`,
which a matcher raises with one of them.
"""

from __future__ import annotations

import enum


class Code(enum.StrEnum):
    """Stable codes for why a candidate was left alone (the report's ``refused[].code``).

    Tests and tools match these; the detail sentence beside them is for people and may change.
    """

    # Shared by the norm and BatchNorm passes.
    OPSET_TOO_LOW = "opset_too_low"
    SHARED_OUTPUT = "shared_output"
    TRAINING_MODE = "training_mode"
    NOT_CONSTANT = "not_constant"
    UNKNOWN_SHAPE = "unknown_shape"
    UNSUPPORTED_DTYPE = "unsupported_dtype"

    # LayerNorm / RMSNorm.
    #: ``v / (sqrt(ms) + eps)``: eps added outside the square root, a different function.
    EPS_OUTSIDE_SQRT = "eps_outside_sqrt"
    #: A weight or bias that varies along an axis that is not normalized (kept as its own op).
    AXIS_NOT_NORMALIZED = "axis_not_normalized"
    #: ``F.normalize(x) * sqrt(d)``: the L2 norm clamped at eps, not eps added to the mean square.
    F_NORMALIZE = "f_normalize"
    #: The division's numerator is not the tensor whose (centered) mean square is taken.
    WRONG_NUMERATOR = "wrong_numerator"
    #: A mean over axes that are not the trailing axes of the input.
    AXES_NOT_TRAILING = "axes_not_trailing"
    #: A ReduceMean with keepdims=0 whose result is not put back into its keepdims shape.
    KEEPDIMS_ZERO = "keepdims_zero"
    #: The mean and the variance reduce over different axes.
    DIFFERENT_AXES = "different_axes"
    #: eps is a constant of more than one element: it cannot become the epsilon attribute.
    EPS_NOT_SCALAR = "eps_not_scalar"
    #: The mean square is scaled by a factor that is zero, negative or not finite.
    FACTOR_NOT_POSITIVE = "factor_not_positive"
    #: The variance is reshaped to a shape other than its keepdims shape, or to one not known.
    VARIANCE_RESHAPED = "variance_reshaped"
    #: ``x - sum(x) / c`` with ``c`` not the number of elements summed (or a scaled mean):
    #: not x minus its mean.
    WRONG_MEAN_DIVISOR = "wrong_mean_divisor"
    #: ``Max(E[x^2] - E[x]^2, c)`` with ``c`` not 0: a clamp the variance does not imply.
    CLAMP_NOT_ZERO = "clamp_not_zero"

    # BatchNorm and affine folding.
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
    #: The channel counts of the map and of the layer (or of the BatchNorm input) differ.
    CHANNEL_MISMATCH = "channel_mismatch"
    #: The map's channels land on another axis of the layer than its channel axis.
    WRONG_CHANNEL_AXIS = "wrong_channel_axis"
    #: A reshape regroups the channels across dimensions of unknown size.
    CHANNELS_REGROUPED = "channels_regrouped"
    #: A constant that varies along an axis other than the channels (or over a pool window).
    NOT_PER_CHANNEL = "not_per_channel"
    #: Shapes that do not fit: a constant that does not broadcast against the shape around a
    #: reshape (BatchNorm), Add operands that are not a pair the Skip op accepts.
    SHAPE_MISMATCH = "shape_mismatch"
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
    #: A constant with more axes than the value it applies to (broadcasting grows the output).
    BROADCAST_CHANGES_SHAPE = "broadcast_changes_shape"
    #: An op with a constant operand that is not an affine map of the tensor (constant / x).
    NOT_AFFINE = "not_affine"
    #: A division by a constant with a zero element.
    ZERO_DIVISOR = "zero_divisor"
    #: The Conv after a BatchNorm pads its input (a padded zero is not ``s * 0 + t``).
    PADDED_CONV = "padded_conv"
    #: The Gemm after a BatchNorm has ``transA=1``.
    GEMM_TRANS_A = "gemm_trans_a"

    # Re-parameterized blocks (fusion.merge_branches).
    #: A branch of the sum reads the block's input through an op that is no Conv, identity or
    #: BatchNorm (a ReLU in a branch).
    BRANCH_NOT_CONV = "branch_not_conv"
    #: The Conv branches have different strides, or an identity sits beside a strided Conv.
    STRIDE_MISMATCH = "stride_mismatch"
    #: The Conv branches differ in group or channels, or an identity beside Convs that change
    #: the channel count.
    GROUP_MISMATCH = "group_mismatch"
    #: The branches read different windows of the input (pads and kernels that do not line up,
    #: or auto_pad SAME).
    PADS_NOT_ALIGNED = "pads_not_aligned"
    #: The merged Conv would do more multiply-adds than the convolutions it replaces.
    MORE_WORK = "more_work"

    # InstanceNorm / GroupNorm / channels-first LayerNorm.
    #: The fused op has no ONNX Runtime kernel on the provider measured (ORT expands it into
    #: its function body, measured slower than the form the graph has), or none for the
    #: norm's type (a bfloat16 RMSNormalization): that form is kept.
    NO_ORT_KERNEL = "no_ort_kernel"
    #: The exact rewrite was measured slower than the form the graph has on the provider
    #: (``benchmarks/forms.py --set conv``): that form is kept.
    SLOWER_MEASURED = "slower_measured"

    # GELU.
    #: A constant of a GELU-shaped subgraph is not the formula's (``x / 2`` inside the erf,
    #: ``0.0447`` for the cubic coefficient): a different function.
    GELU_CONSTANT = "gelu_constant"

    # Skip (residual Add + norm).
    #: A Cast between the residual Add and the norm (the Skip op would add in another type).
    CAST_BETWEEN = "cast_between"
    #: The model imports com.microsoft at a version other than the Skip ops' 1.
    MS_OPSET_VERSION = "ms_opset_version"
    #: The norm's mean / inverse-std outputs are read (the Skip kernels do not compute them).
    STATS_OUTPUTS_USED = "stats_outputs_used"
    #: The norm normalizes more than the last axis.
    NOT_LAST_AXIS = "not_last_axis"
    #: The fused op takes no tensors of this rank: Add operands neither 2-D nor 3-D (Skip);
    #: an attention's Q, K and V not all 3-D or all 4-D.
    UNSUPPORTED_RANK = "unsupported_rank"
    #: A float16 norm with stash_type=0 (statistics in float16; the Skip op uses float32).
    STASH_TYPE_ZERO = "stash_type_zero"
    #: epsilon < 0, which the Skip kernels reject.
    NEGATIVE_EPSILON = "negative_epsilon"
    #: The norm's scale or bias has a type other than the data's.
    PARAM_DTYPE = "param_dtype"
    #: The norm's scale or bias is not a 1-D vector as long as the last axis.
    PARAM_SHAPE = "param_shape"

    # Scaled dot-product attention (fusion.fuse_sdpa).
    #: The Softmax of the scores is not over their last axis (the keys).
    SOFTMAX_AXIS = "softmax_axis"
    #: Between Q @ K^T and the Softmax, an op that is no constant scale, mask or bias; a mask
    #: scaled with the scores; a boolean mask beside another mask or bias.
    SCORES_FORM = "scores_form"
    #: The scores are scaled by a constant of several values that varies along another axis than
    #: the heads' (a constant per head moves into Q): the op's scale is one number.
    SCALE_NOT_SCALAR = "scale_not_scalar"
    #: The scale is zero, negative or not finite (ONNX Runtime's kernel requires scale > 0), or
    #: a head's scale is not finite.
    SCALE_NOT_POSITIVE = "scale_not_positive"
    #: A mask that the op would apply otherwise than the model: a row masked at every key (the
    #: op's zeros, the model's NaN or mean of the values), or a fill that leaves a weight.
    MASK_NOT_EXACT = "mask_not_exact"
    #: Batch times heads below the CPU provider's intra-op threads: ONNX Runtime's CPU kernel
    #: of ``Attention`` runs one thread per batch and head, the MatMuls it would replace use
    #: every thread (measured slower).
    FEW_HEADS = "few_heads"
    #: YOLO's transposed attention (``q^T @ k``, ``v @ attn^T``) where the policy's provider
    #: leaves it (the CPU's): ``Attention`` of it needs Q, K, V and its output transposed,
    #: copies that the MatMuls, which ONNX Runtime fuses with the Transposes, do not make.
    TRANSPOSED_FORM = "transposed_form"

    # Rows nobody reads (fusion.prune_rows).
    #: A mean or sum over the rows of a tail that computes row by row: every row is read,
    #: nothing to prune.
    EVERY_ROW_READ = "every_row_read"

    # Rewrites a caller undoes after the passes (its rollback), any family.
    #: The ONNX checker rejects the model with this rewrite.
    REJECTED_BY_CHECKER = "rejected_by_checker"
    #: ONNX Runtime cannot load or run the model with this rewrite on the provider.
    REJECTED_BY_RUNTIME = "rejected_by_runtime"
    #: With this rewrite the model fails the parity rule where the raw model does not.
    CHANGED_THE_FUNCTION = "changed_the_function"

    # Rewrites a caller undoes after timing the model (its latency verdict), any family.
    #: With this rewrite the model ran slower than the raw model on the provider, beyond the
    #: spread of an A/A control timed in the same run.
    SLOWER_HERE = "slower_here"


class CannotFuse(Exception):
    """Raised by a matcher for a candidate that cannot be rewritten exactly.

    Args:
        code: the stable reason code.
        detail: one sentence for the report that says why, naming nodes where it helps.
    """

    def __init__(self, code: Code, detail: str):
        super().__init__(code, detail)
        self.code = Code(code)
        self.detail = detail
