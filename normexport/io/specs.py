"""``--input-shape`` specs, parsed without importing onnx or onnx-ir (a mistake answers at once).

A spec is ``[NAME=]DIMS[:DTYPE]`` where DIMS is ``1,3,224,224`` or ``2x16`` and DTYPE a numpy
dtype name (float32 by default), e.g. ``input_ids=2x16:int64``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from normexport.errors import UsageError

_SPEC = re.compile(
    r"^(?:(?P<name>[A-Za-z_][\w.:/-]*)=)?(?P<dims>\d+(?:[x,]\d+)*)(?::(?P<dtype>\w+))?$"
)


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One example input: optional name, concrete shape and numpy dtype."""

    name: str | None
    shape: tuple[int, ...]
    dtype: np.dtype


def parse_input_shape(text: str) -> InputSpec:
    """Parse one ``--input-shape`` value.

    Raises:
        UsageError: the text is not ``[NAME=]DIMS[:DTYPE]`` or the dtype is unknown.
    """
    match = _SPEC.match(text.strip())
    if not match:
        raise UsageError(
            f"--input-shape {text!r}: expected [NAME=]DIMS[:DTYPE], e.g. 1,3,224,224 or "
            "input_ids=2x16:int64"
        )
    dims = tuple(int(d) for d in re.split(r"[x,]", match["dims"]))
    try:
        dtype = np.dtype(match["dtype"] or "float32")
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biuf":
        raise UsageError(
            f"--input-shape {text!r}: {match['dtype']!r} is not a tensor dtype; use a number "
            "type such as float32, float16, int64, int32 or bool"
        )
    return InputSpec(match["name"], dims, dtype)
