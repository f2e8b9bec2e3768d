"""Reduced precision. Half precision (``--precision fp16|bf16``): convert the optimized model to
float16 or bfloat16 with the norms kept safe, on ONNX Runtime's converter
(``onnxruntime.transformers.float16``). Int8 (``--precision int8|int8-dynamic``): ONNX
Runtime's quantizer with the norms and Softmax kept float, :mod:`~normexport.precision.int8`
(docs/precision.md#int8). What is kept float32 and why, the 2 GiB refusal
(:class:`normexport.errors.UsageError`) and bfloat16's retyping and refusal:
docs/precision.md#float16 and docs/precision.md#bfloat16.

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
