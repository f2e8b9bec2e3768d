"""Load a model file, telling the kinds apart by their contents, never by their names:
:func:`load_model` returns a :class:`LoadedModel`, whose ``kind`` is one of ``onnx``,
``exported_program`` (a ``torch.export.save`` archive, :func:`normexport.io.program.load_program`),
``torchscript``, ``state_dict`` and ``pickled_module`` (the last two read by
:mod:`normexport.io.pickles`). What each is, and which need ``--trust-pickle`` or
``--model-class``: docs/model-files.md#what-model-may-be.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from normexport.errors import InputFileError, one_line
from normexport.io.kinds import detect_kind
from normexport.io.pickles import load_torch_save
from normexport.io.program import example_inputs, load_program
from normexport.io.quiet import quiet


@dataclasses.dataclass
class LoadedModel:
    """A model file, loaded.

    Attributes:
        path: the file.
        kind: ``onnx``, ``exported_program``, ``torchscript``, ``state_dict`` or
            ``pickled_module`` (docs/model-files.md#what-model-may-be).
        module: the PyTorch model (eval mode) or None for ONNX; for an exported program, the
            ``torch.export.ExportedProgram`` itself.
        onnx_model: the ONNX model for kind ``onnx``, else None.
        example_inputs: inputs that travel with the file (an exported program's), name ->
            array, or None.
        notes: what the user should know about how it was loaded (for the report), e.g. that
            a model saved in training mode was put in eval mode.
    """

    path: Path
    kind: str
    module: torch.nn.Module | torch.export.ExportedProgram | None = None
    onnx_model: ir.Model | None = None
    example_inputs: dict[str, np.ndarray] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def load_model(
    path: str | Path,
    *,
    trust_pickle: bool = False,
    model_class: str | None = None,
    model_kwargs: dict | None = None,
) -> LoadedModel:
    """Load the model at ``path`` in eval mode.

    Args:
        path: the model file.
        trust_pickle: allow unpickling a whole nn.Module, or the pickles in a ``.pt2`` archive
            (both run code from the file).
        model_class: ``package.module:Class`` to build for a state_dict.
        model_kwargs: keyword arguments for ``model_class``.

    Raises:
        InputFileError: the file cannot be read as a model (or is not what it claims to be), or
            holds pickles that were not trusted.
        UsageError: a state_dict has no (matching) ``--model-class``, or bad
            ``--model-kwargs``.
    """
    path = Path(path)
    kind = detect_kind(path)
    if kind == "onnx":
        return _load_onnx(path)
    if kind == "exported_program":
        return _load_exported_program(path, trust_pickle)
    if kind == "torchscript":
        return _load_torchscript(path)
    return _load_torch_save(path, trust_pickle, model_class, model_kwargs)


def _load_onnx(path: Path) -> LoadedModel:
    try:
        with quiet("onnx_ir"):  # its warning on a dangling input: ORT's refusal says it once
            model = ir.load(path)
    except Exception as err:  # onnx_ir's and protobuf's error types
        raise InputFileError(f"{path}: cannot read this ONNX model ({one_line(err)})") from None
    return LoadedModel(path, "onnx", onnx_model=model)


def _load_exported_program(path: Path, trust_pickle: bool) -> LoadedModel:
    program = load_program(path, trust_pickle=trust_pickle)
    example = example_inputs(program)
    return LoadedModel(path, "exported_program", module=program, example_inputs=example)


def _load_torchscript(path: Path) -> LoadedModel:
    try:
        module = torch.jit.load(path, map_location="cpu")
    except Exception as err:  # torch's own error types for a damaged archive
        raise InputFileError(
            f"{path}: a TorchScript archive torch cannot load ({one_line(err)})"
        ) from None
    notes = _eval_note(module, path)
    return LoadedModel(path, "torchscript", module=module.eval(), notes=notes)


def _load_torch_save(
    path: Path, trust_pickle: bool, model_class: str | None, model_kwargs: dict | None
) -> LoadedModel:
    """A ``torch.save`` file: a state_dict (built with ``model_class``), or a whole pickled
    module when ``trust_pickle``."""
    kind, module = load_torch_save(
        path, trust_pickle=trust_pickle, model_class=model_class, model_kwargs=model_kwargs
    )
    notes = _eval_note(module, path) if kind == "pickled_module" else []
    return LoadedModel(path, kind, module=module.eval(), notes=notes)


def _eval_note(module: torch.nn.Module, path: Path) -> list[str]:
    """A note for the report when ``module`` (or a submodule) was saved in training mode."""
    if not any(m.training for m in module.modules()):
        return []
    return [
        f"{path} was saved in training mode; it was exported in eval mode (BatchNorm with its "
        "running statistics, no dropout), which is what inference runs"
    ]
