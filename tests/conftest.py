"""Shared fixtures. Graph builders for the fast pass tests are in ``tests/graphs.py``."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest

# tests/graphs.py and tests/fusion/norm_testing.py are imported by name from any test folder.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left alive (every test module, torch, onnx, their caches: some
    300,000 objects) out of the cyclic garbage collector's reach. Each main job calls
    ``gc.collect()`` about six times (:func:`normexport.runtime.memory.give_back`, after each
    ONNX Runtime session it closes), and each full collection walks every live object: about
    0.2 s each in a worker, most of a small model's run. The objects made by the tests
    themselves are still collected; only those that live for the whole session are not walked.
    """
    gc.collect()
    gc.freeze()


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
