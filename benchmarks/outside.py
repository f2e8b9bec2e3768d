"""Libraries that ``make bench`` installs outside the virtual environment's site-packages.

timm and torchvision go into ``{sys.prefix}/timm``, the model libraries that
``benchmarks/families.py`` times (diffusers, open_clip, openai-whisper, segment-anything,
ultralytics and their light dependencies) into ``{sys.prefix}/families``, each with
``pip install --no-deps --target``: torchvision 0.28's C++ ops do not load beside torch 2.13's
CPU wheel, and installed in site-packages it would break transformers' imports. The models
timed call none of its ops; defining the two op schemas its import registers fake kernels for
(``torchvision::nms``, ``qnms``) first is enough for ``import torchvision`` to succeed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

#: The folders under ``sys.prefix`` that ``make bench`` fills (see the Makefile).
FOLDERS = ("timm", "families")

_schemas: list[torch.library.Library] = []  # kept alive: a freed Library drops its schemas


def use(*folders: str) -> list[Path]:
    """Make the libraries in ``{sys.prefix}/FOLDER`` importable, for each of ``folders`` (default
    :data:`FOLDERS`), and define torchvision's two op schemas (once per process).

    The folders go at the end of ``sys.path``: where a package is in site-packages too, the
    virtual environment's own copy is the one imported.

    Returns:
        The folders that exist (a missing one is not an error: its libraries do not import,
        and the caller says so).
    """
    if not _schemas:
        library = torch.library.Library("torchvision", "DEF")
        library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _schemas.append(library)
    found = [Path(sys.prefix) / name for name in folders or FOLDERS]
    found = [path for path in found if path.is_dir()]
    sys.path.extend(str(path) for path in found if str(path) not in sys.path)
    return found
