"""Example tensors, as :func:`torch.onnx.export` and :func:`torch.export.export` take them: a
module called as ``module(*args, **kwargs)``, turned into the named example inputs and the
positional-only module the rest of the run exports, runs and times.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from normexport.errors import UsageError


class Called(torch.nn.Module):
    """``module(*args, **kwargs)`` as a module whose inputs are the tensors of ``args`` and
    ``kwargs``, positionally, in that order; their other values (``use_cache=False``, None)
    stay fixed, as an exporter bakes them in.

    Args:
        module: the user's ``nn.Module`` (a submodule of this one, so ``eval()``, ``double()``
            and ``deepcopy`` reach it).
        args, kwargs: the example arguments; only which of them are tensors is kept.
    """

    def __init__(self, module: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]):
        super().__init__()
        self.module = module
        self.fixed_args = [None if _is_tensor(a) else a for a in args]
        self.tensor_args = [_is_tensor(a) for a in args]
        self.fixed_kwargs = {k: None if _is_tensor(v) else v for k, v in kwargs.items()}
        self.tensor_kwargs = {k: _is_tensor(v) for k, v in kwargs.items()}

    def forward(self, *tensors: torch.Tensor) -> Any:
        """The module's output on ``tensors`` in the places of the example's tensors."""
        given = iter(tensors)
        args = [
            next(given) if t else a for a, t in zip(self.fixed_args, self.tensor_args, strict=True)
        ]
        kwargs = {
            k: next(given) if self.tensor_kwargs[k] else v for k, v in self.fixed_kwargs.items()
        }
        return self.module(*args, **kwargs)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def from_tensors(
    module: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    """The module to export and its example inputs by name, from example arguments.

    Positional tensors are named after ``forward``'s parameters (``x``, ``input_ids``; a
    ``*args`` parameter's as ``args_0``, ``args_1``), keyword tensors by their keywords. Where
    every argument is a positional tensor the module is returned as it is, else wrapped in
    :class:`Called`.

    Args:
        module: an ``nn.Module``.
        args: positional example arguments: tensors, or fixed values (int, float, bool, str,
            None).
        kwargs: keyword example arguments, likewise.

    Returns:
        ``(module to export, {input name: array})``, arrays as numpy has them (any dtype numpy
        has: bfloat16 tensors are refused).

    Raises:
        UsageError: the arguments do not fit ``forward``'s signature, a value is a container
            (give its tensors one by one), or a tensor's dtype has no numpy counterpart.
    """
    signature = inspect.signature(module.forward)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        raise UsageError(
            f"args / kwargs do not fit {type(module).__name__}.forward: {err}"
        ) from None
    names: list[str] = []
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            names += [f"{param.name}_{i}" for i in range(len(args) - len(names))]
        elif param.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names.append(param.name)
    names = names[: len(args)] + list(kwargs)
    example = {}
    for name, value in zip(names, [*args, *kwargs.values()], strict=True):
        if isinstance(value, list | tuple | dict):
            raise UsageError(
                f"argument {name!r} is a {type(value).__name__}: give example tensors one by one "
                "(a container of tensors is not an ONNX input)"
            )
        if _is_tensor(value):
            example[name] = _array(name, value)
    plain = not kwargs and all(_is_tensor(a) for a in args)
    return (module if plain else Called(module, args, kwargs).train(module.training)), example


def _array(name: str, tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a numpy array on the host.

    Raises:
        UsageError: numpy has no such dtype (bfloat16, float8).
    """
    try:
        return tensor.detach().cpu().numpy()
    except TypeError:
        raise UsageError(
            f"argument {name!r} is {tensor.dtype}, which numpy has no type for: give it as "
            "float32 (a bfloat16 model is made with --precision bf16)"
        ) from None
