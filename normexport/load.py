"""Load a model file, telling the kinds apart by their contents, never by their names.

Kinds:

- ``onnx``: an ONNX protobuf;
- ``exported_program``: ``torch.export.save`` archive (``.pt2``; carries its example inputs);
- ``torchscript``: ``torch.jit.save`` archive;
- ``state_dict``: ``torch.save`` of a mapping of tensors (needs ``--model-class``);
- ``pickled_module``: ``torch.save`` of a whole nn.Module. Unpickling runs code from the file,
  so it is loaded only with ``--trust-pickle``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch

from normexport.errors import UsageError


@dataclasses.dataclass
class LoadedModel:
    """A model file, loaded.

    Attributes:
        path: the file.
        kind: see the module docstring.
        module: the PyTorch model (eval mode) or None for ONNX; for an exported program, the
            ``torch.export.ExportedProgram`` itself.
        onnx_model: the ONNX model for kind ``onnx``, else None.
        example_inputs: inputs that travel with the file (an exported program's), name ->
            array, or None.
    """

    path: Path
    kind: str
    module: torch.nn.Module | torch.export.ExportedProgram | None = None
    onnx_model: ir.Model | None = None
    example_inputs: dict[str, np.ndarray] | None = None


def detect_kind(path: Path) -> str:
    """The kind of model file at ``path`` (see the module docstring), from its contents.

    Raises:
        UsageError: the file is missing, or is none of the known kinds.
    """
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if any(n.endswith("/archive_format") for n in names):
            return "exported_program"
        if any("/code/" in n for n in names) and any(n.endswith("constants.pkl") for n in names):
            return "torchscript"
        if any(n.endswith("data.pkl") for n in names):
            return "torch_save"
        raise UsageError(f"{path}: a zip archive that is not a PyTorch or ONNX model file")
    with path.open("rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80":  # a pickle protocol marker: legacy (non-zip) torch.save
        return "torch_save"
    try:
        proto = onnx.load_model(str(path), load_external_data=False)
    except Exception:  # protobuf raises DecodeError or RuntimeError; any means "not ONNX"
        proto = None
    if proto is not None and proto.graph.node:
        return "onnx"
    raise UsageError(
        f"{path}: not a model file normexport can read (expected a torch.save'd nn.Module or "
        "state_dict, a TorchScript archive, a torch.export .pt2 program, or an .onnx model)"
    )


def load_model(
    path: str | Path,
    *,
    trust_pickle: bool = False,
    model_class: str | None = None,
    model_kwargs: str | None = None,
) -> LoadedModel:
    """Load the model at ``path`` in eval mode.

    Args:
        path: the model file.
        trust_pickle: allow unpickling a whole nn.Module (runs code from the file).
        model_class: ``package.module:Class`` to build for a state_dict.
        model_kwargs: JSON object of keyword arguments for ``model_class``.

    Raises:
        UsageError: the file cannot be read as a model, a pickled module was not trusted, or a
            state_dict has no (matching) ``--model-class``.
    """
    path = Path(path)
    kind = detect_kind(path)
    if kind == "onnx":
        return LoadedModel(path, kind, onnx_model=ir.load(path))
    if kind == "exported_program":
        program = torch.export.load(path)
        example = None
        if program.example_inputs is not None:
            args, kwargs = program.example_inputs
            example = _named_arrays(program, args, kwargs)
        return LoadedModel(path, kind, module=program, example_inputs=example)
    if kind == "torchscript":
        return LoadedModel(path, kind, module=torch.jit.load(path, map_location="cpu").eval())
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if not trust_pickle:
            raise UsageError(
                f"{path} is a pickled Python object (torch.save of a whole model): loading it "
                "runs code from the file. If you trust its source, add --trust-pickle; or save "
                "its state_dict and pass --model-class package.module:Class"
            ) from None
        obj = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(obj, torch.nn.Module):
            raise UsageError(
                f"{path} holds a {type(obj).__name__}, not an nn.Module or a state_dict"
            ) from None
        return LoadedModel(path, "pickled_module", module=obj.eval())
    state_dict = _state_dict(obj)
    if state_dict is None:
        raise UsageError(f"{path} holds a {type(obj).__name__}, not an nn.Module or state_dict")
    return LoadedModel(
        path, "state_dict", module=_build(path, state_dict, model_class, model_kwargs)
    )


def _state_dict(obj: object) -> Mapping[str, torch.Tensor] | None:
    """The tensor mapping in ``obj``: the object itself or a checkpoint's ``state_dict``."""
    if not isinstance(obj, Mapping):
        return None
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    for key in ("state_dict", "model_state_dict", "model"):
        if key in obj and _state_dict(obj[key]) is not None:
            return obj[key]
    return None


def _build(
    path: Path,
    state_dict: Mapping[str, torch.Tensor],
    model_class: str | None,
    model_kwargs: str | None,
) -> torch.nn.Module:
    if not model_class:
        raise UsageError(
            f"{path} is a state_dict ({len(state_dict)} tensors) with no model code: add "
            "--model-class package.module:Class (and --model-kwargs JSON if its constructor "
            "needs arguments)"
        )
    module_name, _, class_name = model_class.partition(":")
    if not module_name or not class_name:
        raise UsageError(f"--model-class {model_class!r}: expected package.module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise UsageError(f"--model-class {model_class!r}: cannot import it ({err})") from None
    try:
        kwargs = json.loads(model_kwargs) if model_kwargs else {}
    except json.JSONDecodeError as err:
        raise UsageError(f"--model-kwargs is not valid JSON: {err}") from None
    if not isinstance(kwargs, dict):
        raise UsageError("--model-kwargs must be a JSON object, e.g. '{\"depth\": 18}'")
    try:
        module = cls(**kwargs)
    except TypeError as err:
        raise UsageError(f"--model-class {model_class}: cannot build it ({err})") from None
    try:
        result = module.load_state_dict(state_dict, strict=False)
    except RuntimeError as err:  # size mismatches
        raise UsageError(f"{path} does not fit {model_class}: {_first_line(err)}") from None
    if result.missing_keys or result.unexpected_keys:
        raise UsageError(
            f"{path} does not fit {model_class}: missing keys {result.missing_keys[:5]}, "
            f"unexpected keys {result.unexpected_keys[:5]}"
        )
    return module.eval()


def _named_arrays(
    program: torch.export.ExportedProgram, args: tuple, kwargs: dict
) -> dict[str, np.ndarray]:
    """An exported program's example inputs by its user input names."""
    names = program.graph_signature.user_inputs
    flat = [*args, *kwargs.values()]
    return {
        str(name): t.detach().cpu().numpy()
        for name, t in zip(names, flat, strict=False)
        if isinstance(t, torch.Tensor)
    }


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[1].strip() if len(lines) > 1 else (lines[0] if lines else type(err).__name__)
