"""Half precision (``--precision fp16|bf16``): convert the optimized model to float16 or
bfloat16 with the norms kept safe.

The bulk of the work is ONNX Runtime's own converter,
``onnxruntime.transformers.float16.convert_float_to_float16``. It is chosen over
onnxconverter-common's converter (which it is derived from) because it ships inside the
onnxruntime package normexport already depends on (no new dependency), it is maintained with the
ONNX Runtime ops it must understand (the com.microsoft norms, GroupNorm, Resize's float inputs),
and it takes a node block list and an op block list, casting around blocked nodes. What
normexport adds on top:

- **fused norms** (LayerNormalization, RMSNormalization, SimplifiedLayerNormalization) take
  float16 input and compute their statistics in float32: ``stash_type=1`` is written on each
  (ONNX spec, LayerNormalization: "stash_type: type of Mean and InvStdDev"; it is the default,
  set explicitly so that no later tool reads it otherwise). ONNX Runtime's
  SkipLayerNormalization / SkipSimplifiedLayerNormalization have no such attribute; its CPU
  provider computes their statistics in float32 for float16 input (asked of ONNX Runtime in
  ``tests/normexport/test_precision.py``, inputs of magnitude 1e3 stay finite and exact to
  float16 rounding).
- **norms left decomposed** (a fusion refused them) are kept in float32, with casts around
  them: a hand-written norm in float16 squares its input, and ``x**2`` overflows float16 above
  ``|x| = 256``.
- **constants that float16 cannot hold** (a BatchNorm folded with a tiny running variance
  gives a huge scale, a huge one a tiny scale; the fold computes in float64 and stores
  float32): every node with a float initializer that overflows float16 (``|v| > 65504``), or
  whose float16 copy loses more than float16's own rounding (relative L2 error of the cast
  above :data:`~normexport.precision.kept.FP16_LOSS`: its values are mostly subnormal or flush
  to zero), stays in float32, where the converter would silently clamp it. A few tiny values
  among normal ones (trained weights have them) are no loss: in any product ``w @ x`` their
  flush moves the result by ``||dw|| ||x||``, less than the rounding of the other values,
  ``2**-11 ||w|| ||x||``.
- **ops without a float16 kernel** on the provider stay float32: the converted model is loaded
  in an ONNX Runtime session, and each op type it reports NOT_IMPLEMENTED for is blocked, until
  it loads (the kernel question: :mod:`normexport.precision.kernels`).

The converter works on one ``onnx.ModelProto``: models whose tensors pass protobuf's 2 GiB
limit are refused (:class:`normexport.errors.UsageError`) rather than held in one protobuf.

**bfloat16** (``bf16``) is the float16 conversion above (same block lists, same fixes), then
retyped to bfloat16 (:mod:`normexport.precision.bfloat16`: constants rounded from their float32
originals; decomposed norms stay float32, constants are not kept for their range; inputs and
outputs stay float32). Where the provider has no bfloat16 kernel for the model's linear ops
(the norms where it has none; any op where it has neither), the conversion is refused
(:class:`normexport.errors.UsageError`, :func:`normexport.precision.kernels.bf16_refusal`).

The package's modules, by concern: :mod:`~normexport.precision.convert` (the conversion,
:func:`to_half`), :mod:`~normexport.precision.kept` (the nodes kept float32),
:mod:`~normexport.precision.kernels` (the kernel question), :mod:`~normexport.precision.bfloat16`
(the retyping) and :mod:`~normexport.precision.feeds` (the overflow probe set, feeds cast or
rounded to the half type). The names the rest of normexport uses are imported here.
"""

from normexport.precision.convert import (
    PrecisionReport,
    computes_in,
    model_bytes,
    to_half,
)
from normexport.precision.feeds import (
    OVERFLOW_PROBE,
    cast_feeds,
    overflow_set,
    rounded_feeds,
    with_outliers,
)

__all__ = [
    "OVERFLOW_PROBE",
    "PrecisionReport",
    "cast_feeds",
    "computes_in",
    "model_bytes",
    "overflow_set",
    "rounded_feeds",
    "to_half",
    "with_outliers",
]
