"""Load a ``torch.export.save`` archive (``.pt2``) with no code from the file run
(:func:`load_program`), and read its example inputs (:func:`example_inputs`).

Its tensors are read without unpickling anything; an archive that holds pickles is loaded only
with ``--trust-pickle``. Outputs of a pytree type torch does not know (transformers
``ModelOutput``s) load as a :class:`StandIn` mapping.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree

from normexport.errors import InputFileError, one_line
from normexport.io.quiet import quiet_torch


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
        InputFileError: the archive holds pickles and ``trust_pickle`` is false, or torch cannot
            load it (the message names the file and the reason).
    """
    path = Path(path)
    from torch.export.pt2_archive import PT2ArchiveReader  # here: 0.6 s of imports (dynamo)
    from torch.export.pt2_archive import constants as _pt2

    try:
        with quiet_torch():
            reader = PT2ArchiveReader(str(path))
            names = reader.get_file_names()
            # every file under models/ is a program to torch, whatever its name ends with
            models = [n for n in names if n.startswith(_pt2.MODELS_DIR)]
            specs = [spec for m in models for spec in _specs(json.loads(reader.read_bytes(m)))]
            if not trust_pickle:
                _refuse_code(path, reader, names, models, specs)
    except InputFileError:
        raise
    except Exception as err:
        raise InputFileError(
            f"{path}: not a torch.export archive that this torch can read ({one_line(err)})"
        ) from None
    try:
        for spec in specs:
            for name in _type_names(spec):
                if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
                    _stand_in(name)
            pytree.treespec_loads(spec)
    except Exception as err:
        raise InputFileError(
            f"{path}: cannot rebuild its input/output structure ({one_line(err)}); "
            "re-export the model so that it takes and returns tensors, or tuples, lists or "
            "dicts of them"
        ) from None
    try:
        with quiet_torch() as errors, _weights_only(not trust_pickle):
            return torch.export.load(path)
    except Exception as err:
        cause = errors[0] if errors else err
        raise InputFileError(
            f"{path}: torch.export.load cannot load it ({one_line(cause)})"
        ) from None


_PICKLE_HINT = "loading it runs code from the file; if you trust its source, add --trust-pickle"


def _refuse_code(path: Path, reader, names: list[str], models: list[str], specs: list[str]) -> None:
    """Raise InputFileError if loading the archive would unpickle or import anything from it."""
    from torch.export.pt2_archive import constants as _pt2

    if any(n.startswith(_pt2.AOTINDUCTOR_DIR) for n in names):
        raise InputFileError(f"{path} holds AOTInductor shared libraries: {_PICKLE_HINT}")
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
                raise InputFileError(f"{path} holds its {kind}s as one pickle: {_PICKLE_HINT}")
            config_file = config_format.format(model)
            if config_file not in names:
                continue  # torch then fails, and says so
            config = json.loads(reader.read_bytes(config_file))["config"]
            for fqn, meta in config.items():
                pickled = meta.get("use_pickle") is not False
                if pickled or not str(meta.get("path_name")).startswith(prefix):
                    raise InputFileError(f"{path}: {kind} {fqn} is a pickle: {_PICKLE_HINT}")
        inputs_file = _pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
        if inputs_file in names:
            data = reader.read_bytes(inputs_file)
            if data:
                try:
                    torch.load(io.BytesIO(data), weights_only=True)
                except Exception:
                    raise InputFileError(
                        f"{path}: its example inputs are a pickle of more than tensors: "
                        f"{_PICKLE_HINT}"
                    ) from None
    for spec in specs:
        if '"__enum__"' in spec:
            raise InputFileError(
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


def example_inputs(program: torch.export.ExportedProgram) -> dict[str, np.ndarray] | None:
    """The example inputs saved with ``program``, by its user input names (name -> array, as
    the tensor's dtype and shape), or None where it carries none."""
    if program.example_inputs is None:
        return None
    args, kwargs = program.example_inputs
    names = program.graph_signature.user_inputs
    flat = [*args, *kwargs.values()]
    return {
        str(name): t.detach().cpu().numpy()
        for name, t in zip(names, flat, strict=False)
        if isinstance(t, torch.Tensor)
    }
