"""Sizes for the symbolic axes of an ONNX model's inputs, by name: ``--dim NAME=SIZE``
(ONNX Runtime's free-dimension override, by name), the sizes of the shapes given, the usual
names' defaults, expressions of names (Optimum writes ``past_sequence_length +
sequence_length``), and the sizes normexport picks where none is given (:func:`tries`: one size
per name across the inputs, larger ones where the model refuses the first);
docs/model-files.md#sizes-normexport-picks.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from normexport.errors import UsageError

if TYPE_CHECKING:  # the CLI checks its options before onnx_ir is imported (half a second)
    import onnx_ir as ir

#: Usual symbolic axis names and the sizes they get where ``--dim`` gives none.
USUAL = {
    "batch": 1,
    "batch_size": 1,
    "sequence": 16,
    "sequence_length": 16,
    "seq_len": 16,
    "encoder_sequence_length": 16,
    "decoder_sequence_length": 16,
    "past_sequence_length": 16,
    "past_seq_len": 16,
    "past_length": 16,
    "total_sequence_length": 32,
}


def parse(texts: Iterable[str]) -> dict[str, int]:
    """``--dim`` values (``NAME=SIZE``) as name -> size.

    Raises:
        UsageError: a value is not ``NAME=SIZE`` with a positive integer size.
    """
    sizes = {}
    for text in texts:
        name, _, size = text.partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise UsageError(
                f"--dim {text!r}: expected NAME=SIZE, a symbolic axis's name and a positive "
                "integer, e.g. --dim sequence_length=16"
            )
        sizes[name.strip()] = int(size)
    return sizes


def _name(dim: object) -> str | None:
    """A symbolic axis's name or expression (None: an int, or an axis with no name)."""
    if isinstance(dim, int) or getattr(dim, "value", dim) is None:
        return None
    return str(dim)


def names(dim: object) -> list[str]:
    """The names a symbolic axis is made of (its own, or those of its expression); none for
    an int or an unnamed axis."""
    if _name(dim) is None:
        return []
    try:
        tree = ast.parse(str(dim), mode="eval")
    except SyntaxError:
        return [str(dim)]
    return [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)] or [str(dim)]


def size(dim: object, given: Mapping[str, int]) -> int | None:
    """The size of axis ``dim`` (an int, or a symbolic one) from ``given`` sizes by name and
    expressions of them; None where it has none (an unknown name, a size below 1, or a negative
    int: Paddle's exporter writes ``-1`` for an axis of any size)."""
    if isinstance(dim, int):
        return dim if dim >= 0 else None
    text = _name(dim)
    if text is None:
        return None
    if text in given:
        return given[text]
    try:
        value = _evaluate(ast.parse(text, mode="eval").body, given)
    except (SyntaxError, KeyError, ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None


_OPS = {
    ast.Add: int.__add__,
    ast.Sub: int.__sub__,
    ast.Mult: int.__mul__,
    ast.FloorDiv: int.__floordiv__,
}


def _evaluate(node: ast.AST, given: Mapping[str, int]) -> int:
    """An axis expression's value. Raises KeyError (an unknown name), ValueError (anything but
    names, integers and ``+ - * //``)."""
    if isinstance(node, ast.Name):
        return given[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, given), _evaluate(node.right, given))
    raise ValueError(ast.dump(node))


def check_given(given: Mapping[str, int], inputs: Sequence[ir.Value], path: str) -> None:
    """Every ``--dim`` name is a symbolic axis of an input (or in one's expression).

    Raises:
        UsageError: one is not, naming the symbolic axes there are.
    """
    known = {n for v in inputs if v.shape is not None for d in v.shape for n in names(d)}
    for name in given:
        if name not in known:
            axes = ", ".join(sorted(known)) or "none"
            raise UsageError(
                f"--dim {name}={given[name]}: no input of {path} has an axis named {name!r}; "
                f"its symbolic axes: {axes}"
            )


#: The sizes tried, in order, for an axis normexport sizes itself: a sequence's or samples'
#: axis, and a spatial axis of an image (axes 2 and 3 of a 4-D input); why these:
#: docs/model-files.md#sizes-normexport-picks.
LADDER = (16, 256, 4096)
IMAGE_LADDER = (64, 256, 1024)
#: After the ladder, the last try divides the first sizes by this: a model that runs at one
#: size below the first only (PaddleOCR v2's text recognizer: an image 32 high, no other).
SMALLER = 2


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One try of sizes for the symbolic axes of an ONNX model's inputs (:func:`tries`).

    Attributes:
        names: axis name -> size, for every name of the inputs' axes (given or not).
        unnamed: ``(input name, axis)`` -> size, for the axes with no name (``None``, ``-1``,
            or an expression with no positive value).
        picked: what normexport chose, as the report says it: ``name`` or ``input[axis]`` ->
            size, the names first (empty where every size was given or fixed by the file).
    """

    names: dict[str, int]
    unnamed: dict[tuple[str, int], int]
    picked: dict[str, int]

    def shape(self, value: ir.Value) -> tuple[int, ...]:
        """``value``'s shape (it has one) with these sizes, in elements per axis."""
        return tuple(
            self.unnamed[(value.name, axis)]
            if (value.name, axis) in self.unnamed
            else size(dim, self.names)
            for axis, dim in enumerate(value.shape)
        )


#: Names exporters write for an axis they leave unnamed (tf2onnx's ``None``, Paddle's ``?``):
#: where no ``--dim`` gives them a size, each such axis is sized on its own.
PLACEHOLDERS = {"None", "?"}


def _image_axis(value: ir.Value, axis: int) -> bool:
    return len(value.shape) == 4 and axis >= 2


def tries(inputs: Sequence[ir.Value], given: Mapping[str, int]) -> list[Sizes]:
    """The sizes to try, in order, for the symbolic axes of ``inputs`` (those with a shape).

    A name has one size wherever it appears: its ``given`` one (``--dim``, the shapes given);
    else 1 for a batch (a usual batch name, or any input's first axis); else a usual name's
    default (:data:`USUAL`); else it is picked: :data:`IMAGE_LADDER`'s first size where it is a
    spatial axis of an image, else :data:`LADDER`'s. An axis with no name (or a
    :data:`PLACEHOLDERS` one) is a batch of 1 first, else picked alike, on its own. Each
    further try multiplies every picked and usual size but the batches' by the next step of its
    ladder (16 times, or 4 times for an image), and the last divides the first ones by
    :data:`SMALLER`: one more try than :data:`LADDER` has sizes, one where nothing grows.

    Args:
        inputs: the graph's inputs (initializers aside).
        given: axis name -> size the user gave.

    Returns:
        the tries, the first the sizes taken unless the model refuses them.
    """
    shaped = [v for v in inputs if v.shape is not None]
    batches = {n for n, s in USUAL.items() if s == 1}
    batches |= {_name(v.shape[0]) for v in shaped if len(v.shape) and names(v.shape[0])}
    keys: dict[str | tuple[str, int], bool] = {}  # name or (input, axis) -> an image's axis
    for v in shaped:
        for axis, dim in enumerate(v.shape):
            named = [n for n in names(dim) if n not in PLACEHOLDERS or n in given]
            for key in named if named or size(dim, given) is not None else [(v.name, axis)]:
                keys[key] = keys.get(key, False) or _image_axis(v, axis)
    fixed, growing = dict(given), {}  # growing: key -> (base, ladder)
    for key, image in keys.items():
        if key in given:
            continue
        if key in batches or (isinstance(key, tuple) and key[1] == 0):
            fixed[key] = 1
        elif key in USUAL:
            growing[key] = (USUAL[key], LADDER)
        else:
            growing[key] = (IMAGE_LADDER[0], IMAGE_LADDER) if image else (LADDER[0], LADDER)
    first = fixed | {key: base for key, (base, _) in growing.items()}
    for v in shaped:  # an expression with no positive value: sized on its own
        for axis, dim in enumerate(v.shape):
            if (v.name, axis) not in keys and size(dim, first) is None:
                keys[(v.name, axis)] = _image_axis(v, axis)
                ladder = IMAGE_LADDER if _image_axis(v, axis) else LADDER
                if axis == 0:
                    fixed[(v.name, axis)] = 1
                else:
                    growing[(v.name, axis)] = (ladder[0], ladder)
    steps: list[dict] = [{}]  # nothing grows: one try
    if growing:  # up the ladder, then half the first: a model that takes one size below only
        ladder = [
            [base * lad[i] // lad[0] for base, lad in growing.values()] for i in range(len(LADDER))
        ]
        smaller = [base // SMALLER for base, _ in growing.values()]
        steps = [dict(zip(growing, sizes, strict=True)) for sizes in [*ladder, smaller]]
    out = []
    for step in steps:
        sized = fixed | step
        picked = {k: sized[k] for k in keys if k not in given}
        out.append(
            Sizes(
                names={k: n for k, n in sized.items() if isinstance(k, str)},
                unnamed={k: n for k, n in sized.items() if isinstance(k, tuple)},
                picked={
                    (k if isinstance(k, str) else f"{k[0]}[{k[1]}]"): n for k, n in picked.items()
                },
            )
        )
    return out
