"""PyTorch modules exported to ONNX, for the pass tests that start from a real export (marked
slow): :func:`torch.onnx.export` as it is, its own graph optimizer off (it deletes an eps of
1e-8 or less), the model then cleaned up as :func:`fusion.optimize` cleans it up before its
passes (:func:`fusion.cleanup.cleanup_with_types`; a dynamo export mended then by
:func:`fusion.cleanup.drop_malformed_zero_conv_bias`)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx_ir as ir
import torch

from fusion.cleanup import cleanup_with_types, drop_malformed_zero_conv_bias


def export(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    *,
    input_names: Sequence[str],
    exporter: str = "dynamo",
    opset: int | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
) -> ir.Model:
    """``module`` (put in eval mode) called on ``args``, exported to ONNX.

    Args:
        module: the model.
        args: its positional example inputs.
        input_names: the graph inputs' names, in the order of ``args``.
        exporter: ``"dynamo"`` or ``"torchscript"``.
        opset: the ai.onnx opset; None: the exporter's default (17 for TorchScript).
        dynamic_axes: ``{input_name: {axis: dim_name}}`` for axes that stay symbolic.

    Returns:
        The model, its weights in memory, cleaned up.

    Raises:
        ValueError: ``exporter`` is neither.
    """
    module, args = module.eval(), tuple(args)
    axes = dict(dynamic_axes) if dynamic_axes else None
    with torch.no_grad():
        if exporter == "dynamo":
            model = torch.onnx.export(
                module, args, dynamo=True, optimize=False, verbose=False, opset_version=opset,
                input_names=list(input_names), dynamic_axes=axes,
            ).model  # fmt: skip
        elif exporter == "torchscript":
            model = _torchscript(module, args, opset or 17, list(input_names), axes)
        else:
            raise ValueError(f"exporter {exporter!r}: 'dynamo' or 'torchscript'")
    cleanup_with_types(model)
    if exporter == "dynamo":
        drop_malformed_zero_conv_bias(model)
    return model


def _torchscript(module, args: tuple, opset: int, input_names: list, axes) -> ir.Model:
    """The TorchScript exporter's model, its weights read into memory."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(
            module, args, str(path), dynamo=False, opset_version=opset,
            input_names=input_names, dynamic_axes=axes,
        )  # fmt: skip
        model = ir.load(path)
        for value in model.graph.initializers.values():
            value.const_value = ir.tensor(value.const_value.numpy(), name=value.name)
    return model
