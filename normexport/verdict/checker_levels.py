"""The ONNX checker's verdict on the input and on the output, at the level the input passes.

Old exporters' files often fail the checker (nodes out of order, initializers not listed as
inputs at IR version 3, ONNX Runtime's own ops): the output is held to the level its input
reaches, and where the input reaches none, ONNX Runtime loading the output is the test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import fusion
from normexport.errors import one_line


@dataclasses.dataclass(frozen=True)
class Checker:
    """How far the ONNX checker accepts the input and the output.

    Attributes:
        input, output: ``"full"`` (with strict shape inference), ``"basic"`` or ``"none"``.
        input_problem, output_problem: the checker's complaint at the first level each failed,
            or None.
    """

    input: str
    input_problem: str | None
    output: str
    output_problem: str | None = None


def checker_level(path: Path) -> tuple[str, str | None]:
    """How far the ONNX checker accepts the model file at ``path``: ``"full"`` (with shape
    inference), ``"basic"`` or ``"none"``, and its complaint at the first level it fails
    (None)."""
    problem = None
    for level, full in (("full", True), ("basic", False)):
        try:
            fusion.check(path, full_check=full)
            return level, problem
        except Exception as err:  # ValidationError, InferenceError: the checker's verdict
            problem = problem or one_line(err)
    return "none", problem


def check_output(path: Path, input_level: str, input_problem: str | None) -> Checker:
    """Check the output file at ``path`` at the level the input passed.

    An output that fails a level its input passed is normexport's bug (the checker's error
    propagates: exit 3). Where the input already fails the checker, the output is checked
    fully anyway and the report says what each got.

    Returns:
        The levels each got, with the checker's complaints.
    """
    if input_level != "none":
        fusion.check(path, full_check=input_level == "full")
        return Checker(input_level, input_problem, input_level)
    return Checker("none", input_problem, *checker_level(path))
