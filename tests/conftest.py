"""Shared fixtures and the order the tests run in. What tests share besides fixtures (graph
builders, exports) is the package ``tests.support``."""

from __future__ import annotations

import gc
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that hold ``slow`` tests (PyTorch exports, model files: seconds to a minute
    each) run first, the graph-level ones (milliseconds) after them: ``make test``'s workers
    (pytest-xdist) then end together, filling in with small tests, instead of one running a
    minute-long test alone at the end. Each module's tests stay together and in their order."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Collect the garbage and freeze what is left alive (the test modules, torch, onnx, what
    they imported lazily, their caches: some 400,000 objects) out of the cyclic garbage
    collector's reach, before each test. Each main job calls ``gc.collect()`` about six times
    (:func:`normexport.runtime.memory.give_back`, after each ONNX Runtime session it closes),
    and a full collection walks every live object: 0.2 s each in a worker, most of a small
    model's run. What the test makes is still collected; at the first test of each module
    everything is unfrozen and collected once, so what died since (the previous module's
    fixtures) is not kept."""
    if item.module is not _FROZEN_AT.get("module"):
        _FROZEN_AT["module"] = item.module
        gc.unfreeze()
    _build_torchlib_registry_once()
    gc.collect()
    gc.freeze()


def _build_torchlib_registry_once() -> None:
    """Once the dynamo exporter has been imported (by the first export), make its table of
    ONNX functions per opset once per worker, not once per export: ``torch.onnx.export``
    builds it anew each call from onnxscript's torchlib, reading and parsing the source of
    some 500 functions (``TracedOnnxFunction.function_ir`` is not cached), 0.3 s of a
    0.6 s gallery export. Each export gets its own copy of the table (the exporter adds a
    caller's ``custom_translation_table`` to the one it is given), made by torch's own
    ``from_torchlib``: what is exported does not change. Without that module, its class or its
    default opset (another torch), nothing is changed; a call with other arguments than the
    opset goes to torch's own."""
    registration = sys.modules.get("torch.onnx._internal.exporter._registration")
    if registration is None or _TORCHLIB_BUILD:
        return
    registry = getattr(registration, "ONNXRegistry", None)
    build = getattr(registry, "from_torchlib", None)
    default = getattr(getattr(registration, "_constants", None), "TORCHLIB_OPSET", None)
    if build is None or default is None:
        return

    def from_torchlib(cls, *args, **kwargs):
        if args or set(kwargs) - {"opset_version"}:
            return build(*args, **kwargs)
        opset_version = kwargs.get("opset_version", default)
        if opset_version not in _TORCHLIB_TABLES:
            _TORCHLIB_TABLES[opset_version] = build(opset_version=opset_version)
        made, copy = _TORCHLIB_TABLES[opset_version], cls.__new__(cls)
        copy.__dict__.update({name: _copied(value) for name, value in vars(made).items()})
        return copy

    registry.from_torchlib = classmethod(from_torchlib)
    _TORCHLIB_BUILD.append(build)


def _copied(value: Any) -> Any:
    """A registry attribute as a new export may change it: a dict with its lists copied (the
    functions per target), a list copied; anything else shared (the functions themselves)."""
    if isinstance(value, dict):
        return {key: list(v) if isinstance(v, list) else v for key, v in value.items()}
    return list(value) if isinstance(value, list) else value


#: The dynamo exporter's torchlib tables by opset (:func:`_build_torchlib_registry_once`).
_TORCHLIB_TABLES: dict[int, Any] = {}
#: torch's own ``ONNXRegistry.from_torchlib``, once replaced.
_TORCHLIB_BUILD: list[Callable[..., Any]] = []


#: The module of the last test :func:`pytest_runtest_setup` ran before.
_FROZEN_AT: dict[str, object] = {}


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: every test draws the same random weights and statistics."""
    return np.random.default_rng(0)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """An empty folder for a run's outputs, apart from its model's (a missing output folder
    is refused without ``--make-dirs``)."""
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


class ExportCache:
    """Files a session makes once (PyTorch exports: seconds each) and tests copy: each test
    gets its own copy, which it may change, move or delete.

    Args:
        root: a folder of the session's own, under which each key's files are made.
    """

    def __init__(self, root: Path):
        self._root = root
        self._made: dict[str, Any] = {}

    def copy(self, key: str, make: Callable[[Path], Any], to: Path) -> tuple[Path, Any]:
        """``to``, a new folder with the files ``make(folder)`` writes, and what that call
        returned; ``make`` runs the first time ``key`` is asked for, in a folder of its own.

        Raises:
            FileExistsError: ``to`` exists.
        """
        folder = self._root / key
        if key not in self._made:
            folder.mkdir()
            self._made[key] = make(folder)
        shutil.copytree(folder, to)
        return to, self._made[key]


@pytest.fixture(scope="session")
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> ExportCache:
    """The session's :class:`ExportCache` (one per pytest-xdist worker)."""
    return ExportCache(tmp_path_factory.mktemp("exported"))
