"""Load a model file, telling the kinds apart by their contents, never by their names.

Kinds:

- ``onnx``: an ONNX protobuf;
- ``exported_program``: ``torch.export.save`` archive (``.pt2``; carries its example inputs).
  Its tensors are read without unpickling anything; an archive that holds pickles is loaded
  only with ``--trust-pickle`` (see :func:`load_program`). Outputs of a pytree type torch does
  not know (transformers ``ModelOutput``s) load as a :class:`StandIn` mapping;
- ``torchscript``: ``torch.jit.save`` archive;
- ``state_dict``: ``torch.save`` of a mapping of tensors (needs ``--model-class``);
- ``pickled_module``: ``torch.save`` of a whole nn.Module. Unpickling runs code from the file,
  so it is loaded only with ``--trust-pickle``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
import torch.utils._pytree as pytree
from torch.export.pt2_archive import constants as _pt2

from normexport.errors import InputFileError, UsageError, one_line
from normexport.io.quiet import quiet_torch


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
        notes: what the user should know about how it was loaded (for the report), e.g. that
            a model saved in training mode was put in eval mode.
    """

    path: Path
    kind: str
    module: torch.nn.Module | torch.export.ExportedProgram | None = None
    onnx_model: ir.Model | None = None
    example_inputs: dict[str, np.ndarray] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def detect_kind(path: Path) -> str:
    """The kind of model file at ``path`` (see the module docstring), from its contents.

    Raises:
        UsageError: the file is missing, or is none of the known kinds.
    """
    if path.is_dir():
        raise InputFileError(f"{path} is a folder, not a model file: give the model file in it")
    if not path.exists():
        raise InputFileError(f"{path}: no such file")
    if not path.is_file():
        raise InputFileError(f"{path} is not a regular file (a device, a pipe?): give a model file")
    if path.stat().st_size == 0:
        raise InputFileError(f"{path} is empty (0 bytes): was it written completely?")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if any(n.endswith("/archive_format") for n in names):
            return "exported_program"
        if any("/code/" in n for n in names) and any(n.endswith("constants.pkl") for n in names):
            return "torchscript"
        if any(n.endswith("data.pkl") for n in names):
            return "torch_save"
        raise InputFileError(f"{path}: a zip archive that is not a PyTorch or ONNX model file")
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
    if proto is not None and proto.HasField("graph") and proto.opset_import:
        raise InputFileError(
            f"{path}: an ONNX model with no nodes (graph {proto.graph.name!r} computes "
            "nothing): nothing to optimize; export the model again"
        )
    raise InputFileError(
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
        trust_pickle: allow unpickling a whole nn.Module, or the pickles in a ``.pt2`` archive
            (both run code from the file).
        model_class: ``package.module:Class`` to build for a state_dict.
        model_kwargs: JSON object of keyword arguments for ``model_class``.

    Raises:
        UsageError: the file cannot be read as a model, a pickled module was not trusted, or a
            state_dict has no (matching) ``--model-class``.
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
        model = ir.load(path)
    except Exception as err:  # onnx_ir's and protobuf's error types
        raise InputFileError(f"{path}: cannot read this ONNX model ({one_line(err)})") from None
    return LoadedModel(path, "onnx", onnx_model=model)


def _load_exported_program(path: Path, trust_pickle: bool) -> LoadedModel:
    program = load_program(path, trust_pickle=trust_pickle)
    example = None
    if program.example_inputs is not None:
        args, kwargs = program.example_inputs
        example = _named_arrays(program, args, kwargs)
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
    path: Path, trust_pickle: bool, model_class: str | None, model_kwargs: str | None
) -> LoadedModel:
    """A ``torch.save`` file: a state_dict (built with ``model_class``), or a whole pickled
    module when ``trust_pickle``."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if not trust_pickle:
            raise InputFileError(
                f"{path} is a pickled Python object (torch.save of a whole model): loading it "
                "runs code from the file. If you trust its source, add --trust-pickle; or save "
                "its state_dict and pass --model-class package.module:Class"
            ) from None
        obj = _load_trusted(path)
        if not isinstance(obj, torch.nn.Module):
            raise InputFileError(
                f"{path} holds a {type(obj).__name__}, not an nn.Module or a state_dict"
            ) from None
        notes = _eval_note(obj, path)
        return LoadedModel(path, "pickled_module", module=obj.eval(), notes=notes)
    except Exception as err:  # a damaged file: EOFError, RuntimeError from the zip reader
        raise InputFileError(
            f"{path}: torch.load cannot read it ({one_line(err)}); is the file complete?"
        ) from None
    state_dict = _state_dict(obj)
    if state_dict is None:
        raise UsageError(f"{path} holds a {type(obj).__name__}, not an nn.Module or state_dict")
    return LoadedModel(
        path, "state_dict", module=_build(path, state_dict, model_class, model_kwargs)
    )


def _load_trusted(path: Path) -> object:
    """``torch.load(path, weights_only=False)`` (the user passed --trust-pickle), with modules
    importable from the current folder as under ``python -m normexport``.

    Raises:
        InputFileError: the pickle is damaged, or names a class that cannot be found.
    """
    _import_from_cwd()
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (AttributeError, ImportError) as err:
        where = (
            "its script's __main__ module, which only exists while that script runs"
            if "__main__" in str(err)
            else "a module that cannot be imported here"
        )
        raise InputFileError(
            f"{path}: the pickled model's class is in {where} ({one_line(err)}); move the "
            "class into a module on the Python path (or the current folder) and save it again, "
            "or save its state_dict and pass --model-class package.module:Class"
        ) from None
    except Exception as err:  # EOFError, UnpicklingError, RuntimeError: a damaged file
        raise InputFileError(
            f"{path}: cannot unpickle it ({one_line(err)}); is the file complete?"
        ) from None


def _eval_note(module: torch.nn.Module, path: Path) -> list[str]:
    """A note for the report when ``module`` (or a submodule) was saved in training mode."""
    if not any(m.training for m in module.modules()):
        return []
    return [
        f"{path} was saved in training mode; it was exported in eval mode (BatchNorm with its "
        "running statistics, no dropout), which is what inference runs"
    ]


def _import_from_cwd() -> None:
    """Put the current folder on ``sys.path`` as ``python -m normexport`` does, so that the
    ``normexport`` script finds the user's modules (``--model-class mymod:Net``) too."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


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
    _import_from_cwd()
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
        raise UsageError(f"{path} does not fit {model_class}: {_mismatch(err)}") from None
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


def _mismatch(err: BaseException) -> str:
    """What ``load_state_dict`` says does not fit: the line after its "Error(s) in loading
    state_dict for X:" header (the first line when there is no other)."""
    lines = str(err).strip().splitlines()
    return lines[1].strip() if len(lines) > 1 else (lines[0] if lines else type(err).__name__)


# --- torch.export programs -------------------------------------------------------------------


class StandIn(dict):
    """A pytree node of a type torch does not know, loaded as a mapping key -> value.

    ``torch.export.save`` writes a program's input and output structure (its pytree specs)
    with each node type's ``serialized_type_name``, e.g.
    ``transformers.modeling_outputs.BaseModelOutputWithPast``; ``torch.export.load`` can rebuild
    only the types registered in this process under that name. transformers registers a
    ``ModelOutput`` subclass when the module defining it is imported, which
    ``import transformers`` alone does not do (its submodules load lazily). Rather than import
    a module named by the file (which runs that module's code, chosen by whoever wrote the
    file), :func:`load_program` registers one subclass of this class per unknown name: flatten
    gives the values with the keys as context (the context such a node was saved with, a JSON
    list of keys, as transformers' own registration writes it), unflatten gives the mapping
    back. A program's outputs then come out as ``BaseModelOutputWithPast({'last_hidden_state':
    tensor})``: the same tensors in the same order (``tree_leaves``), read by key or attribute.
    A context that is not a list of distinct keys, one per child, gives keys 0, 1, ...
    """

    serialized_type_name: str = ""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"


_STAND_INS: dict[str, type[StandIn]] = {}


def _stand_in(name: str) -> type[StandIn]:
    """The :class:`StandIn` subclass registered with torch's pytree under ``name``."""
    if name in _STAND_INS:
        return _STAND_INS[name]
    short = re.sub(r"\W", "_", name.rpartition(".")[2]) or "StandIn"
    doc = f"Stand-in for pytree type {name} (see :class:`StandIn`)."
    attrs = {"serialized_type_name": name, "__module__": __name__, "__doc__": doc}
    cls = type(short, (StandIn,), attrs)

    def unflatten(values, context) -> StandIn:
        values = list(values)
        keys = context if isinstance(context, list) else []
        if not (
            len(keys) == len(values)
            and all(isinstance(k, (str, int)) for k in keys)
            and len(set(keys)) == len(keys)
        ):
            keys = list(range(len(values)))
        return cls(zip(keys, values, strict=True))

    def load_context(text: str):
        try:
            return json.loads(text)  # plain JSON: no object hooks, nothing imported
        except (TypeError, ValueError):
            return text

    pytree.register_pytree_node(
        cls,
        lambda d: (list(d.values()), list(d.keys())),
        unflatten,
        serialized_type_name=name,
        to_dumpable_context=json.dumps,
        from_dumpable_context=load_context,
        flatten_with_keys_fn=lambda d: (
            [(pytree.MappingKey(k), v) for k, v in d.items()],
            list(d.keys()),
        ),
    )
    _STAND_INS[name] = cls
    return cls


def load_program(path: str | Path, *, trust_pickle: bool = False) -> torch.export.ExportedProgram:
    """``torch.export.load(path)``, with no code from the file run, quietly.

    torch 2.13's loader unpickles with ``weights_only=False`` a weight or tensor constant saved
    as a pickle (``use_pickle`` in the archive's payload configs), ``pickle.loads`` an opaque
    object constant, ``torch._C._pickle_load_obj`` a TorchBind one, retries the example inputs
    with ``weights_only=False`` when the safe unpickler refuses them, loads the shared
    libraries of an AOTInductor package, and imports the module named by an ``__enum__`` in a
    pytree context. Unless ``trust_pickle``, the archive is read first and any of these is
    refused, and the load runs with ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` so that a path missed
    here still cannot unpickle code. Pytree types the process does not know get a
    :class:`StandIn`. torch's warnings and log lines are kept from the user; the first error
    among them is what a failure reports.

    Raises:
        UsageError: the archive holds pickles and ``trust_pickle`` is false, or torch cannot
            load it (the message names the file and the reason).
    """
    path = Path(path)
    from torch.export.pt2_archive import PT2ArchiveReader

    try:
        with quiet_torch():
            reader = PT2ArchiveReader(str(path))
            names = reader.get_file_names()
            # every file under models/ is a program to torch, whatever its name ends with
            models = [n for n in names if n.startswith(_pt2.MODELS_DIR)]
            specs = [spec for m in models for spec in _specs(json.loads(reader.read_bytes(m)))]
            if not trust_pickle:
                _refuse_code(path, reader, names, models, specs)
    except UsageError:
        raise
    except Exception as err:
        raise UsageError(
            f"{path}: not a torch.export archive that this torch can read ({one_line(err)})"
        ) from None
    try:
        for spec in specs:
            for name in _type_names(spec):
                if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
                    _stand_in(name)
            pytree.treespec_loads(spec)
    except Exception as err:
        raise UsageError(
            f"{path}: cannot rebuild its input/output structure ({one_line(err)}); "
            "re-export the model so that it takes and returns tensors, or tuples, lists or "
            "dicts of them"
        ) from None
    try:
        with quiet_torch() as errors, _weights_only(not trust_pickle):
            return torch.export.load(path)
    except Exception as err:
        cause = errors[0] if errors else err
        raise UsageError(f"{path}: torch.export.load cannot load it ({one_line(cause)})") from None


_PICKLE_HINT = "loading it runs code from the file; if you trust its source, add --trust-pickle"


def _refuse_code(path: Path, reader, names: list[str], models: list[str], specs: list[str]) -> None:
    """Raise UsageError if loading the archive would unpickle or import anything from it."""
    if any(n.startswith(_pt2.AOTINDUCTOR_DIR) for n in names):
        raise UsageError(f"{path} holds AOTInductor shared libraries: {_PICKLE_HINT}")
    for model_file in models:
        model = model_file[len(_pt2.MODELS_DIR) : -len(".json")]  # as torch computes it
        for kind, directory, config_format, prefix in (
            (
                "weight",
                _pt2.WEIGHTS_DIR,
                _pt2.WEIGHTS_CONFIG_FILENAME_FORMAT,
                _pt2.WEIGHT_FILENAME_PREFIX,
            ),
            (
                "constant",
                _pt2.CONSTANTS_DIR,
                _pt2.CONSTANTS_CONFIG_FILENAME_FORMAT,
                _pt2.TENSOR_CONSTANT_FILENAME_PREFIX,
            ),
        ):
            if f"{directory}{model}.pt" in names:
                raise UsageError(f"{path} holds its {kind}s as one pickle: {_PICKLE_HINT}")
            config_file = config_format.format(model)
            if config_file not in names:
                continue  # torch then fails, and says so
            config = json.loads(reader.read_bytes(config_file))["config"]
            for fqn, meta in config.items():
                pickled = meta.get("use_pickle") is not False
                if pickled or not str(meta.get("path_name")).startswith(prefix):
                    raise UsageError(f"{path}: {kind} {fqn} is a pickle: {_PICKLE_HINT}")
        inputs_file = _pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
        if inputs_file in names:
            data = reader.read_bytes(inputs_file)
            if data:
                try:
                    torch.load(io.BytesIO(data), weights_only=True)
                except Exception:
                    raise UsageError(
                        f"{path}: its example inputs are a pickle of more than tensors: "
                        f"{_PICKLE_HINT}"
                    ) from None
    for spec in specs:
        if '"__enum__"' in spec:
            raise UsageError(
                f"{path}: its input/output structure names a Python enum to import: {_PICKLE_HINT}"
            )


def _specs(node: object) -> list[str]:
    """Every serialized pytree spec (``in_spec`` / ``out_spec``) in a program's JSON."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("in_spec", "out_spec") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(_specs(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_specs(value))
    return found


def _type_names(spec: str) -> set[str]:
    """The node type names a serialized pytree spec uses (``[protocol, {"type": ...}]``)."""
    names = set()
    stack = [json.loads(spec)[1]]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                names.add(node["type"])
            stack.extend(node.get("children_spec") or [])
    return names


@contextlib.contextmanager
def _weights_only(force: bool):
    """Make every ``torch.load`` in the block safe (``weights_only=True``) when ``force``.

    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` overrides even an explicit ``weights_only=False``.
    """
    names = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {name: os.environ.get(name) for name in names}
    if force:
        os.environ[names[0]] = "1"
        os.environ.pop(names[1], None)
    try:
        yield
    finally:
        if force:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
