"""Example inputs: arrays made from ``--input-shape`` specs (:mod:`normexport.io.specs`),
inputs read off an ONNX graph, and the parity probes."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from fusion.graph import const_array
from normexport.errors import UsageError
from normexport.io import dims as dims_mod
from normexport.io.specs import InputSpec


def random_array(spec: InputSpec, rng: np.random.Generator, rows: int | None = None) -> np.ndarray:
    """A random input for ``spec``.

    Floats are standard normal. Integers are taken as token ids in [0, ``rows``) (the rows of
    the table they index, :func:`id_ranges`), [0, 100) where that is not known, except inputs
    whose name contains "mask", which are all ones; pass real data with ``--inputs`` where that
    guess does not fit the model.
    """
    if np.issubdtype(spec.dtype, np.floating):
        return rng.standard_normal(spec.shape).astype(spec.dtype)
    if spec.dtype == np.bool_ or (spec.name and "mask" in spec.name.lower()):
        return np.ones(spec.shape, dtype=spec.dtype)
    return rng.integers(0, rows or 100, size=spec.shape).astype(spec.dtype)


def example_arrays(
    specs: list[InputSpec], rows: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """The example inputs of ``specs`` by name (an unnamed one ``input``, or ``input_i`` among
    several), drawn by :func:`random_array` with seed 0; ``rows``: input name -> the rows of
    the table its ids index (:func:`id_ranges`)."""
    rng = np.random.default_rng(0)
    return {
        name: random_array(dataclasses.replace(s, name=name), rng, (rows or {}).get(name))
        for name, s in zip(_names(specs), specs, strict=True)
    }


def _names(specs: list[InputSpec]) -> list[str]:
    """The specs' input names (an unnamed one ``input``, or ``input_i`` among several)."""
    return [s.name or (f"input_{i}" if len(specs) > 1 else "input") for i, s in enumerate(specs)]


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


def _bytes(specs: list[InputSpec]) -> list[int]:
    return [math.prod(s.shape) * s.dtype.itemsize for s in specs]


def fits(specs: list[InputSpec], memory: int | None = None) -> bool:
    """Whether :data:`N_INPUT_SETS` sets of inputs of ``specs`` fit in ``memory`` bytes (this
    machine's where None; True where it cannot be told)."""
    memory = memory_bytes() if memory is None else memory
    return memory is None or sum(_bytes(specs)) * N_INPUT_SETS <= memory


def check_size(specs: list[InputSpec], memory: int | None = None) -> None:
    """Refuse, before anything is allocated, example inputs that cannot fit in memory:
    parity holds :data:`N_INPUT_SETS` sets of them at once.

    Raises:
        UsageError: naming the largest input, its size, the total and the memory there is.
    """
    memory = memory_bytes() if memory is None else memory
    if memory is None or fits(specs, memory):
        return
    names, sizes = _names(specs), _bytes(specs)
    total = sum(sizes) * N_INPUT_SETS
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


@dataclasses.dataclass(frozen=True)
class Sizing:
    """An ONNX model's example input specs, try by try (:func:`onnx_input_specs`): the sizes
    normexport picked for the axes given none, and the larger ones it tries where the model
    refuses them (docs/model-files.md#sizes-normexport-picks).

    Attributes:
        tries: ``(specs, sizes)`` per try, in order (:func:`normexport.io.dims.tries`); the
            first always, the larger ones only where they fit in memory (:func:`check_size`).
        at: the try in use (those before it were refused).
    """

    tries: tuple[tuple[list[InputSpec], dims_mod.Sizes], ...]
    at: int = 0

    @property
    def specs(self) -> list[InputSpec]:
        """The specs of the try in use."""
        return self.tries[self.at][0]

    @property
    def picked(self) -> dict[str, int]:
        """What normexport chose at the try in use (``name`` or ``input[axis]`` -> size)."""
        return self.tries[self.at][1].picked

    def larger(self) -> Sizing | None:
        """The next try, or None where there is none."""
        return dataclasses.replace(self, at=self.at + 1) if self.at + 1 < len(self.tries) else None

    def note(self) -> str | None:
        """The line the report's notes give (None where nothing was picked): the sizes in use
        and those the model refused."""
        if not self.picked:
            return None
        line = "sizes normexport picked for the inputs' symbolic axes: " + _listed(self.picked)
        if self.at:
            line += f" (the model refused {self.tried(self.at)})"
        return line + "; --dim NAME=SIZE or --input-shape chooses them"

    def grown(self) -> list[str]:
        """The picked axes whose size grows from try to try (all picked where none grows)."""
        grew = [k for k in self.picked if len({t[1].picked.get(k) for t in self.tries}) > 1]
        return grew or list(self.picked)

    def tried(self, upto: int | None = None) -> str:
        """The sizes of :meth:`grown` in the tries before ``upto`` (all where None), as
        ``name=16, 256`` per axis."""
        tries = self.tries[: len(self.tries) if upto is None else upto]
        return "; ".join(
            f"{k}={', '.join(str(t[1].picked[k]) for t in tries)}" for k in self.grown()
        )

    def flags(self) -> str:
        """The flags that give :meth:`grown`'s axes a size: ``--dim NAME=SIZE`` for a name,
        ``--input-shape INPUT=DIMS`` for an unnamed axis's input."""
        named = [f"--dim {k}=SIZE" for k in self.grown() if not k.endswith("]")]
        shapes = dict.fromkeys(k.rsplit("[", 1)[0] for k in self.grown() if k.endswith("]"))
        return " ".join([*named, *(f"--input-shape {v}=DIMS" for v in shapes)])


def _listed(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def onnx_input_specs(
    model: ir.Model,
    given: list[InputSpec],
    path: str,
    dims: Mapping[str, int] | None = None,
    memory: int | None = None,
) -> Sizing:
    """Concrete specs for an ONNX model's graph inputs, try by try (:class:`Sizing`).

    Each input's shape comes from ``given`` (matched by name, else by position) or from the
    graph, its symbolic axes sized by :func:`normexport.io.dims.tries`: ``dims`` (``--dim``)
    and the axes of the shapes given keep their size, the others are picked.

    Args:
        memory: bytes the example inputs may take (:func:`check_size`; this machine's where
            None): larger tries that do not fit are left out.

    Raises:
        UsageError: a named spec or a ``--dim`` matches no graph input or axis; an input has no
            shape; an input's element type has no numpy type; the first try does not fit in
            memory (:func:`check_size`).
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
    chosen: dict[str, InputSpec] = {}
    for i, value in enumerate(inputs):
        if value.dtype is not None and not _has_numpy(value.dtype):
            raise UsageError(
                f"{path}: input {value.name!r} is of element type {value.dtype.name}, which no "
                "example input can be made of: the file is damaged, or give --inputs FILE.npz"
            )
        spec = by_name.get(value.name) or (unnamed[i] if i < len(unnamed) else None)
        if spec is not None:
            chosen[value.name] = spec
            if value.shape is not None and len(value.shape) == len(spec.shape):
                for dim, n in zip(value.shape, spec.shape, strict=True):  # one size per name
                    if dims_mod.names(dim) == [str(dim)]:
                        sizes.setdefault(str(dim), n)
        elif value.shape is None:
            raise UsageError(
                f"{path}: input {value.name!r} has no shape in the file; give it, e.g. "
                f"--input-shape {value.name}=1,3,224,224"
            )
    open_inputs = [v for v in inputs if v.name not in chosen]
    tries = []
    for step, tried in enumerate(dims_mod.tries(open_inputs, sizes)):
        specs = [
            InputSpec(
                v.name,
                chosen[v.name].shape if v.name in chosen else tried.shape(v),
                v.dtype.numpy() if v.dtype is not None else np.dtype("float32"),
            )
            for v in inputs
        ]
        if step == 0:
            check_size(specs, memory)
        elif not fits(specs, memory):
            break
        tries.append((specs, tried))
    return Sizing(tuple(tries))


#: Probe name -> how it transforms a random float input. Probes hit eps: a constant input
#: has zero variance, so a lost eps divides by zero.
PROBES = {
    "constant": lambda a, rng: np.full_like(a, 0.5),
    "zeros": lambda a, rng: np.zeros_like(a),
    "tiny_1e-4": lambda a, rng: (rng.standard_normal(a.shape) * 1e-4).astype(a.dtype),
    "huge_1e3": lambda a, rng: (rng.standard_normal(a.shape) * 1e3).astype(a.dtype),
}


#: Ops that carry an input's values to a Gather unchanged (for :func:`id_ranges`); an ``Add``
#: of a constant carries them shifted.
_PASS_THROUGH = {
    "Cast",
    "Unsqueeze",
    "Squeeze",
    "Reshape",
    "Flatten",
    "Identity",
    "Expand",
    "Transpose",
    "Slice",
}
#: Ops between a table and its Gather that keep its rows (a float16 table cast, an int8 one
#: dequantized).
_SAME_ROWS = {"Cast", "Identity", "DequantizeLinear"}


def _rows(data: ir.Value, axis: int) -> int | None:
    """The rows of the table ``data`` on ``axis``: an initializer's or a constant's (through
    :data:`_SAME_ROWS`), else its static size there, else None."""
    source = data
    while source.const_value is None and source.producer() is not None:
        producer = source.producer()
        if producer.op_type not in _SAME_ROWS or not producer.inputs or not producer.inputs[0]:
            break
        source = producer.inputs[0]
    tensor = ir.convenience.get_const_tensor(source)
    shape = tensor.shape if tensor is not None else data.shape
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    rows = shape[axis]
    return rows if isinstance(rows, int) and rows > 0 else None


def _source(value: ir.Value, inputs: set[ir.Value]) -> tuple[ir.Value, int]:
    """The value ``value`` carries, walked up through :data:`_PASS_THROUGH` and ``Add`` of a
    constant, and the largest constant added on the way (0 where none)."""
    shift = 0
    while value not in inputs and value.producer() is not None:
        producer = value.producer()
        if producer.op_type in _PASS_THROUGH and producer.inputs and producer.inputs[0]:
            value = producer.inputs[0]
            continue
        if producer.op_type != "Add" or len(producer.inputs) != 2:
            break
        consts = [const_array(v) for v in producer.inputs]
        if (consts[0] is None) == (consts[1] is None) or not all(producer.inputs):
            break
        k = 1 if consts[1] is not None else 0
        shift += max(int(np.max(consts[k])), 0) if consts[k].size else 0
        value = producer.inputs[1 - k]
    return value, shift


def id_ranges(model: ir.Model) -> dict[str, int]:
    """Graph input name -> how many ids it may take: for each Gather whose indices come from a
    graph input (directly, or through casts, reshapes and ``Add`` of a constant), the rows of
    the table it indexes on the gathered axis (an initializer, a constant, or a table of static
    size), less the constant added; the smallest, where it reaches several."""
    inputs = {v for v in model.graph.inputs if not v.is_initializer()}
    found: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        data, value = node.inputs[0], node.inputs[1]
        if data is None or value is None:
            continue
        rows = _rows(data, node.attributes.get_int("axis", 0))
        value, shift = _source(value, inputs)
        if value in inputs and rows is not None and rows - shift > 0:
            found[value.name] = min(found.get(value.name, rows - shift), rows - shift)
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
