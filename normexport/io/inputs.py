"""Example inputs: arrays made from ``--input-shape`` specs (:mod:`normexport.io.specs`),
inputs read off an ONNX graph, and the parity probes."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from normexport.errors import UsageError
from normexport.io import dims as dims_mod
from normexport.io.specs import InputSpec


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


#: How many input sets parity holds in memory at once: the example, random ones, the probes.
N_INPUT_SETS = 1 + 3 + 4


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    raise AssertionError


def memory_bytes() -> int | None:
    """This machine's physical memory, or None where it cannot be told."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_size(specs: list[InputSpec], names: list[str], memory: int | None = None) -> None:
    """Refuse, before anything is allocated, example inputs that cannot fit in memory:
    parity holds :data:`N_INPUT_SETS` sets of them at once.

    Raises:
        UsageError: naming the largest input, its size, the total and the memory there is.
    """
    memory = memory_bytes() if memory is None else memory
    if memory is None:
        return
    sizes = [math.prod(s.shape) * s.dtype.itemsize for s in specs]
    total = sum(sizes) * N_INPUT_SETS
    if total <= memory:
        return
    i = max(range(len(specs)), key=sizes.__getitem__)
    shape = "x".join(map(str, specs[i].shape))
    raise UsageError(
        f"--input-shape: input {names[i]!r} of shape {shape} ({specs[i].dtype}) takes "
        f"{_size(sizes[i])}, and parity holds {N_INPUT_SETS} sets of inputs ({_size(total)}); "
        f"this machine has {_size(memory)} of memory: give a smaller shape"
    )


def conform(
    arrays: dict[str, np.ndarray], expected: dict[str, np.dtype], source: str
) -> dict[str, np.ndarray]:
    """Cast each array to the dtype its input expects where that changes no value.

    Args:
        arrays: ``--inputs`` arrays by name.
        expected: input name -> the dtype the model takes (inputs left out are not checked).
        source: the option and file, for the message.

    Raises:
        UsageError: an array's values do not survive the cast: names the input and dtypes.
    """
    out = dict(arrays)
    for name, dtype in expected.items():
        a = arrays.get(name)
        if a is None or a.dtype == dtype or dtype.kind not in "biuf":
            continue
        cast = a.astype(dtype)
        with np.errstate(all="ignore"):
            exact = np.array_equal(cast.astype(a.dtype), a, equal_nan=a.dtype.kind in "fc")
        if not exact:
            raise UsageError(
                f"{source}: input {name!r} is {a.dtype} but the model takes {dtype}, and its "
                f"values change when cast: save it as {dtype} (e.g. a.astype(np.{dtype}))"
            )
        out[name] = cast
    return out


def declared_dtypes(model, arrays: dict[str, np.ndarray]) -> dict[str, np.dtype]:
    """The dtype each of ``arrays`` should have: for an ONNX model (onnx_ir) its graph
    inputs' (by name, else by position); for a PyTorch model, its parameters' float dtype for
    the float arrays (when the model has one)."""
    if isinstance(model, ir.Model):
        inputs = [v for v in model.graph.inputs if not v.is_initializer()]
        names = [v.name for v in inputs]
        if not set(names) <= set(arrays) and len(names) == len(arrays):
            names = list(arrays)
        return {
            name: v.dtype.numpy()
            for name, v in zip(names, inputs, strict=False)
            if v.dtype is not None and _has_numpy(v.dtype)
        }
    try:
        import torch

        params = [p for p in model.parameters() if p.is_floating_point()]
        floats = {p.dtype for p in params}
        dtype = np.dtype(torch.empty(0, dtype=floats.pop()).numpy().dtype)
    except Exception:  # no parameters, several float dtypes, or one numpy lacks (bfloat16)
        return {}
    if floats:
        return {}
    return {k: dtype for k, a in arrays.items() if a.dtype.kind == "f"}


def _has_numpy(dtype: ir.DataType) -> bool:
    try:
        dtype.numpy()
    except TypeError:
        return False
    return True


def onnx_input_specs(
    model: ir.Model, given: list[InputSpec], path: str, dims: Mapping[str, int] | None = None
) -> tuple[list[InputSpec], dict[str, int]]:
    """Concrete specs for an ONNX model's graph inputs, and the usual axis names given their
    default size (:data:`normexport.io.dims.USUAL`), for the report.

    Each input's shape comes from ``given`` (matched by name, else by position) or from the
    graph, its symbolic axes sized by ``dims`` (``--dim``) and :mod:`normexport.io.dims`.

    Raises:
        UsageError: a named spec or a ``--dim`` matches no graph input or axis; an input has no
            shape; symbolic axes have no size (one error naming every input's axes).
    """
    inputs = [v for v in model.graph.inputs if not v.is_initializer()]
    names = {v.name for v in inputs}
    for spec in given:
        if spec.name is not None and spec.name not in names:
            raise UsageError(
                f"--input-shape names {spec.name!r}, but {path} has inputs {sorted(names)}"
            )
    sizes = dict(dims or {})
    dims_mod.check_given(sizes, inputs, path)
    by_name = {s.name: s for s in given if s.name is not None}
    unnamed = [s for s in given if s.name is None]
    specs, defaulted, unknown, nameless = [], {}, [], []
    for i, value in enumerate(inputs):
        if value.dtype is not None and not _has_numpy(value.dtype):
            raise UsageError(
                f"{path}: input {value.name!r} is of element type {value.dtype.name}, which no "
                "example input can be made of: the file is damaged, or give --inputs FILE.npz"
            )
        dtype = value.dtype.numpy() if value.dtype is not None else np.dtype("float32")
        spec = by_name.get(value.name) or (unnamed[i] if i < len(unnamed) else None)
        if spec is not None:
            specs.append(InputSpec(value.name, spec.shape, dtype))
            continue
        if value.shape is None:
            raise UsageError(
                f"{path}: input {value.name!r} has no shape in the file; give it, e.g. "
                f"--input-shape {value.name}=1,3,224,224"
            )
        shape = []
        for axis, dim in enumerate(value.shape):
            found = dims_mod.size(dim, sizes, defaulted)
            if found is None and axis > 0:
                unknown += [n for n in dims_mod.names(dim) if n not in sizes]
                nameless += [value] if not dims_mod.names(dim) else []
            shape.append(found or 1)  # a first axis of another name: a batch of 1
        specs.append(InputSpec(value.name, tuple(shape), dtype))
    if unknown or nameless:
        raise dims_mod.missing(path, inputs, unknown, list(dict.fromkeys(nameless)))
    return specs, defaulted


#: Probe name -> how it transforms a random float input. Probes hit eps: a constant input
#: has zero variance, so a lost eps divides by zero.
PROBES = {
    "constant": lambda a, rng: np.full_like(a, 0.5),
    "zeros": lambda a, rng: np.zeros_like(a),
    "tiny_1e-4": lambda a, rng: (rng.standard_normal(a.shape) * 1e-4).astype(a.dtype),
    "huge_1e3": lambda a, rng: (rng.standard_normal(a.shape) * 1e3).astype(a.dtype),
}


#: Ops that carry an input's values to a Gather unchanged (for :func:`id_ranges`).
_PASS_THROUGH = {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Expand"}


def id_ranges(model: ir.Model) -> dict[str, int]:
    """Graph input name -> how many rows the embedding table it indexes has: for each Gather
    whose data is an initializer and whose indices come from a graph input (through casts and
    reshapes), the table's size on the gathered axis (the smallest, where several)."""
    inputs = {v for v in model.graph.inputs if not v.is_initializer()}
    found: dict[str, int] = {}
    for node in model.graph.all_nodes() if hasattr(model.graph, "all_nodes") else model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        data, value = node.inputs[0], node.inputs[1]
        if data is None or data.const_value is None or value is None:
            continue
        while value not in inputs and value.producer() is not None:
            producer = value.producer()
            if producer.op_type not in _PASS_THROUGH or not producer.inputs:
                break
            value = producer.inputs[0]
        if value in inputs:
            axis = node.attributes.get_int("axis", 0)
            rows = data.const_value.shape[axis]
            found[value.name] = min(found.get(value.name, rows), rows)
    return found


def _is_mask(name: str, a: np.ndarray) -> bool:
    return a.dtype == np.bool_ or "mask" in name.lower()


def _random_integers(
    name: str, a: np.ndarray, i: int, rng: np.random.Generator, ranges: dict[str, int]
) -> np.ndarray:
    """Random set ``i``'s value of integer input ``name`` (example ``a``): a mask is all ones in
    even sets and ones then trailing zeros along its last axis in odd sets (at least one one);
    ids are drawn in [0, rows of the embedding it indexes), else in [0, max(example) + 1)."""
    if _is_mask(name, a):
        mask = np.ones(a.shape, dtype=a.dtype)
        if i % 2 == 1 and a.ndim and a.shape[-1] > 1:
            mask[..., (a.shape[-1] + 1) // 2 :] = 0
        return mask
    high = ranges.get(name) or (int(a.max()) + 1 if a.size else 1)
    return rng.integers(0, max(high, 1), size=a.shape).astype(a.dtype)


def input_sets(
    example: dict[str, np.ndarray],
    n_random: int = 3,
    seed: int = 1,
    id_ranges: dict[str, int] | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """The named input sets that parity runs: the example, random ones, then the probes.

    Random sets redraw every input: floats standard normal, integer inputs as token ids in a
    valid range (see :func:`id_ranges`) and masks of ones or with trailing zeros. Probes
    change float inputs only (integer inputs as in the example); a model with no float input
    gets none.

    Args:
        example: input name -> array; the first set, as given.
        n_random: how many random sets to add.
        seed: seed of the random generator; not 0, the seed generated example inputs are
            drawn with, so that no random set repeats the example.
        id_ranges: integer input name -> number of valid ids (embedding rows).

    Returns:
        ``{set_name: {input_name: array}}``, insertion-ordered.
    """
    rng = np.random.default_rng(seed)
    ranges = id_ranges or {}
    floats = [k for k, a in example.items() if np.issubdtype(a.dtype, np.floating)]
    sets = {"example": dict(example)}
    for i in range(n_random):
        sets[f"random_{i}"] = {
            k: (
                rng.standard_normal(a.shape).astype(a.dtype)
                if k in floats
                else _random_integers(k, a, i, rng, ranges)
            )
            for k, a in example.items()
        }
    if not floats:
        return sets
    for probe, make in PROBES.items():
        sets[probe] = {k: (make(a, rng) if k in floats else a) for k, a in example.items()}
    return sets
