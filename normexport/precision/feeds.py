"""The inputs half precision is checked on: the overflow probe set, and feeds cast or rounded to
a model's half type.

The overflow probe (:func:`overflow_set`) gives each float input outliers that a hand-written
norm, squaring them, would overflow float16 with; :func:`rounded_feeds` rounds feeds as the
half-precision parity rule does; :func:`cast_feeds` casts them to the float16 inputs of a model
converted without ``--keep-io-types``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

#: The element type of each half precision, by ``--precision`` value.
HALF_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


def cast_feeds(session, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with each float array cast to the float type ``session`` declares for it
    (float16 inputs of a converted model without ``--keep-io-types``; float32 inputs of a
    block fed the float64 oracle's values)."""
    types = {i.name: _FLOAT_TYPES.get(i.type) for i in session.get_inputs()}
    out = {}
    for name, array in feeds.items():
        wanted = types.get(name)
        if wanted is not None and array.dtype.kind == "f" and array.dtype != wanted:
            array = array.astype(wanted)
        out[name] = array
    return out


#: ONNX Runtime's names of the float input types numpy has.
_FLOAT_TYPES = {
    "tensor(float16)": np.dtype(np.float16),
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
}


#: The overflow probe's input set name.
OVERFLOW_PROBE = "overflow_outliers"


#: One feature in this many on the last axis of an overflow probe's input is an outlier.
OUTLIER_STRIDE = 8
#: The outliers' magnitude: squared, as a hand-written norm squares them, they pass float16's
#: largest finite value 65504 (256**2 = 65536).
OUTLIER_SCALE = 1e3


def with_outliers(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float64 values of ``shape``, one feature in :data:`OUTLIER_STRIDE` on
    the last axis times :data:`OUTLIER_SCALE` (transformer hidden states carry such outliers;
    Dettmers et al. 2022, "LLM.int8()")."""
    out = rng.standard_normal(shape)
    if out.ndim:
        out[..., ::OUTLIER_STRIDE] *= OUTLIER_SCALE
    return out


def overflow_set(example: Mapping[str, np.ndarray], seed: int = 2) -> dict[str, dict]:
    """The overflow probe, ``{OVERFLOW_PROBE: feeds}``: each float input standard normal, with
    one feature in eight on the last axis an outlier of magnitude about 1e3 (transformer hidden
    states carry such outliers): squared, as a hand-written norm squares them, they pass float16's
    65504. Integer inputs as in ``example``; {} where there is no float input."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, array in example.items():
        if np.issubdtype(array.dtype, np.floating):
            array = with_outliers(rng, array.shape).astype(array.dtype)
        feeds[name] = array
    changed = any(feeds[k] is not example[k] for k in feeds)
    return {OVERFLOW_PROBE: feeds} if changed else {}


def rounded_feeds(
    feeds: Mapping[str, np.ndarray], precision: str = "fp16"
) -> dict[str, np.ndarray]:
    """``feeds`` with every float array rounded to the half type of ``precision``
    (:data:`HALF_TYPES`) and back to its own dtype (the half-precision parity rule's input
    rounding, :func:`normexport.verdict.parity.compare`); other arrays as they are. Values beyond
    float16's range become Inf, as the model's own float16 inputs would.
    """
    half = HALF_TYPES[precision].numpy()
    out = {}
    for name, array in feeds.items():
        if np.issubdtype(array.dtype, np.floating):
            with np.errstate(over="ignore"):
                array = array.astype(half).astype(array.dtype)
        out[name] = array
    return out
