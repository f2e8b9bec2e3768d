"""Load a ``torch.save`` file: a state_dict, built with ``--model-class`` (kind
``state_dict``), or a whole pickled nn.Module (kind ``pickled_module``), which is unpickled only
with ``--trust-pickle`` since unpickling runs code from the file.

The user's modules in the current folder are importable while a model is unpickled or its class
built, as under ``python -m normexport``; ``sys.path`` is as it was afterwards.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from normexport.errors import InputFileError, UsageError, one_line


def load_torch_save(
    path: Path, *, trust_pickle: bool, model_class: str | None, model_kwargs: dict | None
) -> tuple[str, torch.nn.Module]:
    """The model in a ``torch.save`` file: ``("state_dict", the model_class built with
    ``model_kwargs`` and the weights loaded, eval mode)``, or ``("pickled_module", the
    unpickled module as it was saved)`` when ``trust_pickle``.

    Raises:
        InputFileError: the file is damaged, holds neither an nn.Module nor a state_dict, is a
            pickled module not trusted, or names a class that cannot be found.
        UsageError: a state_dict with no ``model_class``, or one that cannot be imported or
            built, or does not fit it.
    """
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
        return "pickled_module", obj
    except Exception as err:  # a damaged file: EOFError, RuntimeError from the zip reader
        raise InputFileError(
            f"{path}: torch.load cannot read it ({one_line(err)}); is the file complete?"
        ) from None
    state_dict = _state_dict(obj)
    if state_dict is None:
        raise InputFileError(f"{path} holds a {type(obj).__name__}, not an nn.Module or state_dict")
    return "state_dict", _build(path, state_dict, model_class, model_kwargs)


def _load_trusted(path: Path) -> object:
    """``torch.load(path, weights_only=False)`` (the user passed --trust-pickle), with modules
    importable from the current folder as under ``python -m normexport``.

    Raises:
        InputFileError: the pickle is damaged, or names a class that cannot be found.
    """
    try:
        with _cwd_importable():  # torch resolves the pickled classes as it loads
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise InputFileError(_why_not_unpickled(path, err)) from None


def _why_not_unpickled(path: Path, err: Exception) -> str:
    """The message for a trusted pickle that did not load: a library that fails to import
    (named, with its error), a module that is not there (a library to install, or the user's
    own code to put on the path), a class of a script's ``__main__``, else a damaged file."""
    library = _failed_import(err)
    if library is not None:
        return (
            f"{path}: this model needs {library}, which fails to import here "
            f"({one_line(err)}); install a {library} that works with this PyTorch"
        )
    if isinstance(err, ModuleNotFoundError) and err.name and "__main__" not in str(err):
        top = err.name.split(".")[0]
        return (
            f"{path}: this model needs the module {err.name!r}, which is not installed here: if "
            f"it is a library, install it (pip install {top}); if it is your own code, run from "
            "the folder that holds it, or put it on the Python path"
        )
    if isinstance(err, AttributeError | ImportError):
        where = (
            "its script's __main__ module, which only exists while that script runs"
            if "__main__" in str(err)
            else "a module that cannot be imported here"
        )
        return (
            f"{path}: the pickled model's class is in {where} ({one_line(err)}); move the "
            "class into a module on the Python path (or the current folder) and save it again, "
            "or save its state_dict and pass --model-class package.module:Class"
        )
    return f"{path}: cannot unpickle it ({one_line(err)}); is the file complete?"


def _failed_import(err: BaseException) -> str | None:
    """The top-level package whose import raised ``err`` (a frame of its module-level code in
    the traceback), or None: an installed library that is broken here (torchvision whose C++
    operators do not load beside this torch)."""
    tb = err.__traceback__
    found = None
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "<module>" and name.split(".")[0] not in ("torch", "normexport"):
            found = found or name.split(".")[0]
        tb = tb.tb_next
    return found


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """Within the block, the current folder is on ``sys.path`` as under ``python -m
    normexport``, so that the ``normexport`` script finds the user's modules (``--model-class
    mymod:Net``, a pickled model's class) too. ``sys.path`` is as it was afterwards, also on
    error; the modules imported meanwhile stay imported (``sys.modules``), with the classes the
    model is made of."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


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
    model_kwargs: dict | None,
) -> torch.nn.Module:
    """``model_class`` (``package.module:Class``) built with ``model_kwargs`` (keywords)
    and ``state_dict`` loaded into it, in eval mode.

    Raises:
        UsageError: no ``model_class``, or it cannot be imported or built, or the state_dict
            does not fit the class.
    """
    if not model_class:
        raise UsageError(
            f"{path} is a state_dict ({len(state_dict)} tensors) with no model code: add "
            "--model-class package.module:Class (and --model-kwargs JSON if its constructor "
            "needs arguments)"
        )
    module_name, _, class_name = model_class.partition(":")
    if not module_name or not class_name:
        raise UsageError(f"--model-class {model_class!r}: expected package.module:Class")
    with _cwd_importable():  # the class's module, and what it imports while it is built
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as err:
            raise UsageError(f"--model-class {model_class!r}: cannot import it ({err})") from None
        try:
            module = cls(**(model_kwargs or {}))
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


def _mismatch(err: BaseException) -> str:
    """What ``load_state_dict`` says does not fit: the line after its "Error(s) in loading
    state_dict for X:" header (the first line when there is no other)."""
    lines = str(err).strip().splitlines()
    return lines[1].strip() if len(lines) > 1 else (lines[0] if lines else type(err).__name__)
