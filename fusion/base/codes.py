"""Why a candidate was left alone: the refusal codes several passes share (:class:`Code`), and
:class:`CannotFuse`, which a matcher raises with a code.

A code one pass alone raises is declared in that pass's module, an enum given as the pass's
:attr:`fusion.base.FusionPass.codes`; :data:`fusion.registry.CODES` collects them all, each
value once, and ``fusion.Code`` names every one.
"""

from __future__ import annotations

import enum


class Code(enum.StrEnum):
    """Stable codes for why a candidate was left alone (the report's ``refused[].code``) that
    several passes raise, or that a caller gives the rewrites it undoes.

    Tests and tools match these; the detail sentence beside them is for people and may change.
    """

    # Any pass.
    OPSET_TOO_LOW = "opset_too_low"
    SHARED_OUTPUT = "shared_output"
    NOT_CONSTANT = "not_constant"
    UNKNOWN_SHAPE = "unknown_shape"
    UNSUPPORTED_DTYPE = "unsupported_dtype"

    # The norms' matcher (fusion.norm_match), shared by the norm passes.
    #: ``v / (sqrt(ms) + eps)``: eps added outside the square root, a different function.
    EPS_OUTSIDE_SQRT = "eps_outside_sqrt"
    #: A weight or bias that varies along an axis that is not normalized (kept as its own op).
    AXIS_NOT_NORMALIZED = "axis_not_normalized"
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

    # BatchNorm and affine folding, re-parameterized blocks, attention, Skip.
    #: The channel counts of the map and of the layer (or of the BatchNorm input) differ.
    CHANNEL_MISMATCH = "channel_mismatch"
    #: A constant that varies along an axis other than the channels (or over a pool window).
    NOT_PER_CHANNEL = "not_per_channel"
    #: Shapes that do not fit: a constant that does not broadcast against the shape around a
    #: reshape (BatchNorm), Add operands that are not a pair the Skip op accepts.
    SHAPE_MISMATCH = "shape_mismatch"
    #: A constant with more axes than the value it applies to (broadcasting grows the output).
    BROADCAST_CHANGES_SHAPE = "broadcast_changes_shape"

    # The norm passes.
    #: The fused op has no ONNX Runtime kernel on the provider measured (ORT expands it into
    #: its function body, measured slower than the form the graph has), or none for the
    #: norm's type (a bfloat16 RMSNormalization): that form is kept.
    NO_ORT_KERNEL = "no_ort_kernel"

    # Skip and attention.
    #: The fused op takes no tensors of this rank: Add operands neither 2-D nor 3-D (Skip);
    #: an attention's Q, K and V not all 3-D or all 4-D.
    UNSUPPORTED_RANK = "unsupported_rank"

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
        code: the stable reason code: a :class:`Code`, or one of the codes the raising pass
            declares (:attr:`fusion.base.FusionPass.codes`).
        detail: one sentence for the report that says why, naming nodes where it helps.

    Raises:
        TypeError: ``code`` is no member of a code enum (a plain string).
    """

    def __init__(self, code: enum.StrEnum, detail: str):
        if not isinstance(code, enum.StrEnum):
            raise TypeError(f"{code!r} is no refusal code: give a member of a code enum")
        super().__init__(code, detail)
        self.code = code
        self.detail = detail
