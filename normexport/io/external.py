"""The external data an ONNX model file reads: which files, whether they are there and whole,
and how many bytes of tensors the model holds (read from the tensors' headers: nothing is
loaded). ONNX's external data: onnx/docs/ExternalData.md."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from normexport.errors import InputFileError


def tensor_bytes(model: ir.Model) -> int:
    """Bytes of the model's initializer tensors (external ones included), in bytes."""
    return sum(
        v.const_value.nbytes
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None
    )


def has_external_data(model: ir.Model) -> bool:
    """Whether any initializer of ``model`` lives in an external data file."""
    return any(
        isinstance(v.const_value, ir.ExternalTensor)
        for g in model.graphs()
        for v in g.initializers.values()
    )


def external_files(model: ir.Model) -> dict[Path, list[ir.Value]]:
    """The external data files the initializers of ``model`` live in -> those initializers."""
    found: dict[Path, list[ir.Value]] = {}
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                found.setdefault(Path(tensor.base_dir) / tensor.location, []).append(value)
    return found


def input_files(path: Path, model: ir.Model | None) -> list[Path]:
    """The files a run reads: the model file at ``path`` and, for an ONNX ``model``, the external
    data files its tensors live in."""
    return list(dict.fromkeys([Path(path), *(external_files(model) if model else {})]))


def require_external_data(model: ir.Model, path: Path) -> None:
    """Check that every external data file the ONNX model at ``path`` names is there, and big
    enough for the tensors that say they live in it.

    Raises:
        InputFileError: one is missing or shorter than a tensor in it says.
    """
    for data, values in external_files(model).items():
        size = data.stat().st_size if data.is_file() else -1
        short = [v.name for v in values if size < _external_end(v.const_value)]
        if not short:
            continue
        what = "is missing" if not data.exists() else "is shorter than its tensors say"
        raise InputFileError(
            f"{path}: its external data file {data} {what} (tensors "
            f"{', '.join(short[:3])}{', ...' if len(short) > 3 else ''}); keep the data file "
            "that was written with the model beside it, under the name the model gives"
        )


def _external_end(tensor: ir.ExternalTensor) -> int:
    """Where ``tensor``'s bytes end in its data file: ``offset`` and ``length`` are optional in
    ONNX's external data (onnx/docs/ExternalData.md: ``offset`` defaults to 0, ``length`` to the
    tensor's own size)."""
    return (tensor.offset or 0) + (tensor.length or tensor.nbytes)
