"""Shared fixtures. Graph builders for the fast pass tests are in ``tests/graphs.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# tests/graphs.py and tests/fusion/norm_testing.py are imported by name from any test folder.
sys.path.insert(0, str(Path(__file__).parent))


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
