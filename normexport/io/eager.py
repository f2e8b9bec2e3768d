"""Run a PyTorch model eagerly on numpy arrays: the one runner that parity, latency and bench
share."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


class Eager:
    """A model or exported program called on a flat list of arrays, in inference mode.

    An exported program is called the way it was exported: its example inputs' structure
    (positional and keyword arguments, non-tensor values such as ``use_cache=False``) with the
    given arrays in place of its tensors, in order.

    Args:
        model: an ``nn.Module`` or a ``torch.export.ExportedProgram``.
        float64: run a float64 copy of the model (:func:`float64_copy`), with float inputs
            cast to float64 (integer inputs as they are): the exact reference of parity.
        device: ``"cpu"`` or ``"cuda"``; outputs come back as numpy arrays on the host.
    """

    def __init__(self, model: Any, *, float64: bool = False, device: str = "cpu"):
        self.structure = None
        if isinstance(model, torch.export.ExportedProgram):
            self.structure = model.example_inputs
            model = model.module()
        if float64:
            model = float64_copy(model)
        self.module = model.to(device) if device != "cpu" else model
        self.float64 = float64
        self.device = device

    def bind(self, arrays: Sequence[np.ndarray]) -> Callable[[], Any]:
        """A call with no arguments on ``arrays`` already moved to the device (for timing);
        on CUDA it waits for the device. It returns the model's raw output."""
        args, kwargs = self._arguments(arrays)

        def call() -> Any:
            with torch.inference_mode():
                out = self.module(*args, **kwargs)
            if self.device == "cuda":
                torch.cuda.synchronize()
            return out

        return call

    def __call__(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The model's tensor outputs on ``arrays``, flattened in order, as numpy arrays."""
        leaves = torch.utils._pytree.tree_leaves(self.bind(arrays)())
        return [t.detach().cpu().numpy() for t in leaves if isinstance(t, torch.Tensor)]

    def _arguments(self, arrays: Sequence[np.ndarray]) -> tuple[list, dict]:
        tensors = [self._tensor(a) for a in arrays]
        if self.structure is None:
            return tensors, {}
        given = iter(tensors)
        args, kwargs = torch.utils._pytree.tree_map(
            lambda x: next(given) if isinstance(x, torch.Tensor) else x, self.structure
        )
        return list(args), kwargs

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.float64 and t.is_floating_point():
            t = t.double()
        return t.to(self.device) if self.device != "cpu" else t


def float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` in float64 (``.double()``).

    In a graph module (an exported program's, and its higher-order ops' submodules) every
    ``torch.float32`` argument becomes ``torch.float64`` too, so that explicit casts
    (``aten.to.dtype``, LLaMA's RMSNorm upcast), ``aten.full(dtype=...)`` and the exporter's
    dtype asserts follow the weights instead of failing on them.
    """
    with warnings.catch_warnings():  # .double() reads .grad of every parameter
        warnings.simplefilter("ignore")
        module = copy.deepcopy(module).double()
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                node.args = torch.fx.node.map_aggregate(node.args, _float64_dtype)
                node.kwargs = torch.fx.node.map_aggregate(node.kwargs, _float64_dtype)
            sub.recompile()
    return module


def _float64_dtype(arg: Any) -> Any:
    return torch.float64 if arg is torch.float32 else arg
