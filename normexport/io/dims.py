"""Sizes for the symbolic axes of an ONNX model's inputs, by name: ``--dim NAME=SIZE``
(ONNX Runtime's free-dimension override, by name), the usual names' defaults, and expressions
of them (Optimum writes ``past_sequence_length + sequence_length``).

A symbolic axis gets, in order: the size ``--dim`` gives its name; the size of an expression of
names (``+``, ``-``, ``*``, ``//`` and integers) whose names have sizes; the default of a usual
name (:data:`USUAL`: the batch, sequence and past sequence axes as Optimum, ONNX Runtime's
tools and ``torch.onnx.export``'s ``dynamic_axes`` name them; the report says which it used);
a first axis of any other name is 1 (a batch). Any other axis has no size, and one error names
every input with its symbolic axes and gives a command to copy.
"""

from __future__ import annotations

import ast
import shlex
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


def _shown(dim: object) -> str:
    """An axis as the error lists it: its size, name or expression, ``?`` where unnamed."""
    return str(dim) if isinstance(dim, int) else _name(dim) or "?"


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


def size(dim: object, given: Mapping[str, int], defaulted: dict[str, int]) -> int | None:
    """The size of axis ``dim`` (an int, or a symbolic one) from ``given`` sizes, expressions
    of them and :data:`USUAL` (each default used is recorded in ``defaulted``); None where it
    has none (a negative size, as Paddle's exporter writes ``-1`` for an axis of any size)."""
    if isinstance(dim, int):
        return dim if dim >= 0 else None
    text = _name(dim)
    if text is None:
        return None
    if text in given:
        return given[text]
    try:
        value = _evaluate(ast.parse(text, mode="eval").body, given, defaulted)
    except (SyntaxError, KeyError, ValueError):
        return None
    return value if value > 0 else None


_OPS = {
    ast.Add: int.__add__,
    ast.Sub: int.__sub__,
    ast.Mult: int.__mul__,
    ast.FloorDiv: int.__floordiv__,
}


def _evaluate(node: ast.AST, given: Mapping[str, int], defaulted: dict[str, int]) -> int:
    """An axis expression's value. Raises KeyError (an unknown name), ValueError (anything but
    names, integers and ``+ - * //``)."""
    if isinstance(node, ast.Name):
        if node.id in given:
            return given[node.id]
        defaulted[node.id] = USUAL[node.id]
        return USUAL[node.id]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = (
            _evaluate(node.left, given, defaulted),
            _evaluate(node.right, given, defaulted),
        )
        return _OPS[type(node.op)](left, right)
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


#: The size suggested for a spatial axis of an image (axes 2 and 3 of a 4-D input): networks
#: downsample by up to 32 (ResNet, MobileNet, YOLO's P5), so 16 or 32 leaves an empty tensor (the
#: PaddleOCR classifier's outputs came out constant at 16 and 32), 64 a 2 x 2 grid; any other
#: axis gets :data:`SUGGESTED_SIZE`.
SUGGESTED_IMAGE_SIZE = 64
SUGGESTED_SIZE = 16


def _suggested(value: ir.Value, axis: int) -> int:
    """The size suggested for ``value``'s ``axis``: a batch of 1, an image's
    :data:`SUGGESTED_IMAGE_SIZE`, else :data:`SUGGESTED_SIZE`."""
    if axis == 0:
        return 1
    return SUGGESTED_IMAGE_SIZE if len(value.shape) == 4 and axis >= 2 else SUGGESTED_SIZE


def _axes(value: ir.Value, name: str) -> list[int]:
    """The axes of ``value`` whose size is or depends on the symbolic ``name``."""
    shape = value.shape if value.shape is not None else ()
    return [axis for axis, d in enumerate(shape) if name in names(d)]


def missing(
    path: str, inputs: Sequence[ir.Value], unknown: Iterable[str], unnamed: Sequence[ir.Value]
) -> UsageError:
    """The one error for axes with no size: every input with its symbolic axes, and a
    command that gives each unknown name a size (``--dim``) and each input with an unnamed
    axis its shape (``--input-shape``), quoted for a POSIX shell (Paddle names axes ``?``)."""
    listed = [
        f"{v.name} ({', '.join(_shown(d) for d in v.shape)})"
        for v in inputs
        if v.shape is not None and any(not isinstance(d, int) for d in v.shape)
    ]
    sizes = {
        name: max(
            (_suggested(v, axis) for v in inputs for axis in _axes(v, name)), default=SUGGESTED_SIZE
        )
        for name in dict.fromkeys(unknown)
    }
    flags = [f"--dim {shlex.quote(f'{name}={n}')}" for name, n in sizes.items()]
    for value in unnamed:  # no name to size it by: its whole shape
        shape = "x".join(
            str(d) if isinstance(d, int) and d >= 0 else str(_suggested(value, axis))
            for axis, d in enumerate(value.shape)
        )
        flags.append(f"--input-shape {shlex.quote(f'{value.name}={shape}')}")
    what = (
        "axes with no size" if not unnamed else "axes with no size (give its shape where unnamed)"
    )
    return UsageError(
        f"{path}: symbolic {what}; its inputs: {'; '.join(listed)}. Give each a size, e.g.: "
        f"normexport {shlex.quote(path)} {' '.join(flags)}"
    )
