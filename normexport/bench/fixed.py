"""Swept axes that the model fixes: a batch or sequence sweep cannot run a model at sizes its
inputs do not take (an ONNX file exported at one size; a ``torch.export`` program, which is
specialized to its example unless exported with ``dynamic_shapes``, and which no re-export
makes dynamic). ``normexport bench`` then times the model's own size only and says so in one
line before any timing (:func:`fixed_line`), with what would sweep it; docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence

import onnx_ir as ir

#: The axes a sweep resizes (:func:`normexport.bench.measure.resize_inputs`): ``(word of
#: --dynamic, bench's flag, axis of every input that has it)``.
SWEPT = (("batch", "--batch", 0), ("sequence", "--seq", 1))


@dataclasses.dataclass(frozen=True)
class FixedAxis:
    """A swept axis that an input of the model has as a number.

    Attributes:
        word: ``"batch"`` or ``"sequence"`` (as ``--dynamic`` names it).
        flag: the sweep's flag, ``--batch`` or ``--seq``.
        axis: the input axis, 0 or 1.
        input: the first graph input that fixes it.
        size: its size there.
    """

    word: str
    flag: str
    axis: int
    input: str
    size: int


def fixed_axes(
    model: ir.Model,
    fed: Collection[str],
    batches: Sequence[int | None],
    seqs: Sequence[int | None],
) -> list[FixedAxis]:
    """The swept axes that an input of ``model`` (among ``fed``, the names fed) has as a number
    other than a size the sweep asks for: the batch (axis 0) where ``batches`` asks for another,
    the sequence (axis 1 of inputs of rank 2 or more) where ``seqs`` does (None in either, the
    example's own size, asks for nothing). An axis left symbolic, or a size asked for that is
    the input's own, is not listed."""
    found = []
    for (word, flag, axis), sizes in zip(SWEPT, (batches, seqs), strict=True):
        asked = {s for s in sizes if s is not None}
        for value in model.graph.inputs:
            shape = value.shape
            if value.name not in fed or shape is None or len(shape) <= axis:
                continue
            dim = shape[axis]
            if isinstance(dim, int) and asked - {dim}:
                found.append(FixedAxis(word, flag, axis, value.name, dim))
                break
    return found


def fixed_line(
    fixed: Sequence[FixedAxis], model: str, kind: str, dynamic: str | None, asked: dict[str, str]
) -> str:
    """One line: which axes ``model`` (a file of :func:`normexport.io.load.detect_kind`'s
    ``kind``, exported with ``--dynamic`` ``dynamic`` where it is PyTorch) fixes, that its own
    size only is timed instead of the sizes ``asked`` (flag -> its value), and what would sweep
    them."""
    what = " and ".join(f"{f.word} to {f.size} (input '{f.input}', axis {f.axis})" for f in fixed)
    flags = " ".join(f"{f.flag} {asked[f.flag]}" for f in fixed)
    return (
        f"{model} fixes {what}: timing its own size only, not {flags}; {_how(fixed, kind, dynamic)}"
    )


def _how(fixed: Sequence[FixedAxis], kind: str, dynamic: str | None) -> str:
    """What would sweep the ``fixed`` axes of a model of ``kind`` (see :func:`fixed_line`)."""
    axes = "that axis" if len(fixed) == 1 else "those axes"
    if kind == "onnx":
        return f"to sweep, export the model with {axes} symbolic, or give bench the PyTorch model"
    if kind == "exported_program":
        return (
            f"to sweep, export the program with dynamic_shapes for {axes} (torch.export.Dim), "
            "or give bench the nn.Module"
        )
    named, fixed_words = set(re.split("[,;]", dynamic or "")), {f.word for f in fixed}
    if not fixed_words <= named:
        wanted = ",".join(w for w, _, _ in SWEPT if w in named | fixed_words)
        return f"to sweep, export it with --dynamic {wanted}"
    return (
        f"the export fixed {axes} although --dynamic {dynamic} asks for symbolic ones (the "
        "model's code specializes them)"
    )
