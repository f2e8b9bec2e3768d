"""Example inputs: ``--input-shape`` specs, inputs read off an ONNX graph, and the parity probes.

A spec is ``[NAME=]DIMS[:DTYPE]`` where DIMS is ``1,3,224,224`` or ``2x16`` and DTYPE a numpy
dtype name (float32 by default), e.g. ``input_ids=2x16:int64``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx_ir as ir

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
        raise UsageError(
            f"--input-shape {text!r}: unknown dtype {match['dtype']!r} (use e.g. float32, int64)"
        ) from None
    return InputSpec(match["name"], dims, dtype)


def random_array(spec: InputSpec, rng: np.random.Generator) -> np.ndarray:
    """A random input for ``spec``.

    Floats are standard normal. Integers are taken as token ids in [0, 100), except inputs whose
    name contains "mask", which are all ones; pass real data with ``--inputs`` where that guess
    does not fit the model.
    """
    if np.issubdtype(spec.dtype, np.floating):
        return rng.standard_normal(spec.shape).astype(spec.dtype)
    if spec.dtype == np.bool_ or (spec.name and "mask" in spec.name.lower()):
        return np.ones(spec.shape, dtype=spec.dtype)
    return rng.integers(0, 100, size=spec.shape).astype(spec.dtype)


def specs_from_arrays(arrays: dict[str, np.ndarray]) -> list[InputSpec]:
    """Specs that describe the given example arrays (name, shape, dtype)."""
    return [InputSpec(name, a.shape, a.dtype) for name, a in arrays.items()]


def onnx_input_specs(model: ir.Model, given: list[InputSpec], path: str) -> list[InputSpec]:
    """Concrete specs for an ONNX model's graph inputs.

    Each input's shape comes from ``given`` (matched by name, else by position) or from the
    graph; a symbolic first axis (batch) becomes 1. Any other symbolic axis needs a spec.

    Raises:
        UsageError: an input has a symbolic axis other than the first and no spec, or a named
            spec matches no graph input.
    """
    inputs = [v for v in model.graph.inputs if not v.is_initializer()]
    names = {v.name for v in inputs}
    for spec in given:
        if spec.name is not None and spec.name not in names:
            raise UsageError(
                f"--input-shape names {spec.name!r}, but {path} has inputs {sorted(names)}"
            )
    by_name = {s.name: s for s in given if s.name is not None}
    unnamed = [s for s in given if s.name is None]
    specs = []
    for i, value in enumerate(inputs):
        dtype = value.dtype.numpy() if value.dtype is not None else np.dtype("float32")
        spec = by_name.get(value.name) or (unnamed[i] if i < len(unnamed) else None)
        if spec is not None:
            specs.append(InputSpec(value.name, spec.shape, dtype))
            continue
        dims = list(value.shape) if value.shape is not None else []
        shape = []
        for axis, dim in enumerate(dims):
            if isinstance(dim, int):
                shape.append(dim)
            elif axis == 0:
                shape.append(1)
            else:
                example = "x".join(str(d) if isinstance(d, int) else "1" for d in dims)
                raise UsageError(
                    f"{path}: input {value.name!r} has symbolic axis {axis} ({dim}); give "
                    f"its shape, e.g. --input-shape {value.name}={example}"
                )
        specs.append(InputSpec(value.name, tuple(shape), dtype))
    return specs


#: Probe name -> how it transforms a random float input. Probes hit eps: a constant input
#: has zero variance, so a lost eps divides by zero.
PROBES = {
    "constant": lambda a, rng: np.full_like(a, 0.5),
    "zeros": lambda a, rng: np.zeros_like(a),
    "tiny_1e-4": lambda a, rng: (rng.standard_normal(a.shape) * 1e-4).astype(a.dtype),
    "huge_1e3": lambda a, rng: (rng.standard_normal(a.shape) * 1e3).astype(a.dtype),
}


def input_sets(
    example: dict[str, np.ndarray], n_random: int = 3, seed: int = 0
) -> dict[str, dict[str, np.ndarray]]:
    """The named input sets that parity runs: the example, random ones, then the probes.

    Random sets redraw float inputs and keep integer inputs (token ids, masks) from the
    example. Probes apply to float inputs only; a model with no float input gets none.

    Args:
        example: input name -> array; the first set, as given.
        n_random: how many random sets to add.
        seed: seed of the random generator.

    Returns:
        ``{set_name: {input_name: array}}``, insertion-ordered.
    """
    rng = np.random.default_rng(seed)
    floats = [k for k, a in example.items() if np.issubdtype(a.dtype, np.floating)]
    sets = {"example": dict(example)}
    if not floats:
        return sets
    for i in range(n_random):
        sets[f"random_{i}"] = {
            k: (rng.standard_normal(a.shape).astype(a.dtype) if k in floats else a)
            for k, a in example.items()
        }
    for probe, make in PROBES.items():
        sets[probe] = {k: (make(a, rng) if k in floats else a) for k, a in example.items()}
    return sets
