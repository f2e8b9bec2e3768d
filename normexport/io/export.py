"""PyTorch -> ONNX: the dynamo exporter first, the TorchScript exporter as fallback.

The dynamo exporter is called with ``optimize=False``: its built-in onnxscript optimizer drops
an ``Add`` of eps 1e-8 (it matches constants with ``abs_tol=1e-8``), which turns a constant row
into NaN. What that optimizer does that is exact (constant folding, dead-node removal) is done
afterwards by :func:`fusion.cleanup.cleanup_with_types` (with the types inference gives the
values: a ``CastLike`` of a constant weight folds only then); BatchNorm folding and norm fusion
are normexport's own passes, which report what they did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx_ir as ir
import torch

from fusion.cleanup import cleanup_with_types, drop_malformed_zero_conv_bias
from fusion.graph import opset_version
from normexport.errors import one_line, raise_if_interrupted
from normexport.io.quiet import quiet, quiet_torch, swallow_prints


class ExportError(RuntimeError):
    """Neither exporter could turn the module into ONNX; the message holds both errors."""


@dataclasses.dataclass
class Exported:
    """An exported model and how it was made.

    Attributes:
        model: the ONNX model (onnx_ir), constant-folded, not otherwise optimized.
        exporter: ``"dynamo"`` or ``"torchscript"``.
        fallback_reason: why the dynamo exporter was not used (first line of its error), or
            None when it was.
        warnings: what the TorchScript tracer warned of while tracing, one line each with
            the place in the model's code (``file:line: message``), each once: a trace that
            may not generalize (a tensor turned into a Python bool or number fixes a branch of
            ``forward`` on the example inputs).
    """

    model: ir.Model
    exporter: str
    fallback_reason: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _quiet():
    """Silence the exporters' warnings and loggers (they are not the user's concern), and
    torch's loggers, which print tracebacks of the failures we report in one line."""
    with quiet("torch.onnx"), quiet_torch():
        yield


@contextlib.contextmanager
def _tracer_warnings():
    """Collect the TorchScript tracer's warnings raised inside the block into the yielded list,
    as ``file:line: first line``, each once (other warnings go where they went before)."""
    found: list[str] = []
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, torch.jit.TracerWarning):
            text = str(message).strip().splitlines()[0] if str(message).strip() else ""
            entry = f"{filename}:{lineno}: {text}"
            if entry not in found:
                found.append(entry)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", torch.jit.TracerWarning)
        warnings.showwarning = record
        yield found


def export_module(
    module: torch.nn.Module | torch.export.ExportedProgram,
    args: Sequence[torch.Tensor],
    kwargs: Mapping[str, torch.Tensor] | None = None,
    *,
    opset: int | None = None,
    input_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    exporter: str = "auto",
) -> Exported:
    """Export ``module`` (put in eval mode) to ONNX.

    Args:
        module: the model, called as ``module(*args, **kwargs)``, or a ``torch.export``
            program (exported as it is, dynamo exporter only).
        args: positional example inputs.
        kwargs: keyword example inputs (a named ``--input-shape`` gives these).
        opset: the ai.onnx opset to target; None takes the exporter's default (20 for dynamo
            in torch 2.13, 17 for the TorchScript fallback).
        input_names: names for the graph inputs, in the order args then kwargs.
        dynamic_axes: ``{input_name: {axis: dim_name}}`` for axes that stay symbolic.
        exporter: ``"auto"`` (dynamo, then TorchScript on failure), ``"dynamo"`` or
            ``"torchscript"``.

    Returns:
        :class:`Exported`, its model cleaned up by :func:`fusion.cleanup.cleanup_with_types`.

    Raises:
        ExportError: the chosen exporter(s) failed; the message names each error.
    """
    is_program = isinstance(module, torch.export.ExportedProgram)
    if not is_program:
        module = module.eval()
    names = list(input_names) if input_names else None
    axes = dict(dynamic_axes) if dynamic_axes else None
    kwargs = dict(kwargs or {})
    errors = []
    if exporter in ("auto", "dynamo"):
        try:
            return Exported(_dynamo(module, tuple(args), kwargs, opset, names, axes), "dynamo")
        except Exception as err:  # the exporter raises many types; all mean "try the other"
            raise_if_interrupted()  # unless it is what a Ctrl-C inside a lazy import became
            errors.append(f"dynamo exporter: {one_line(err)}")
    if exporter in ("auto", "torchscript") and not is_program:
        try:
            model, warned = _torchscript(module, tuple(args), kwargs, opset, names, axes)
            return Exported(model, "torchscript", errors[0] if errors else None, warned)
        except Exception as err:
            raise_if_interrupted()
            errors.append(f"TorchScript exporter: {one_line(err)}")
    raise ExportError("; ".join(errors))


def _dynamo(module, args: tuple, kwargs: dict, opset, input_names, dynamic_axes) -> ir.Model:
    """The dynamo exporter's model, cleaned up (see :func:`export_module`)."""
    # verbose=False: no progress prints. torch.export prints a failed trace's partial graph to
    # sys.stderr with no switch to stop it (torch 2.13 torch/export/_trace.py): that is swallowed.
    with _quiet(), swallow_prints("stderr"), torch.no_grad():
        program = torch.onnx.export(
            module,
            args,
            kwargs=kwargs or None,
            dynamo=True,
            optimize=False,
            verbose=False,
            opset_version=opset,
            input_names=input_names,
            dynamic_axes=dynamic_axes,
        )
    raise_if_interrupted()  # torch's own fallbacks may have swallowed a Ctrl-C
    model = program.model
    if opset is not None and opset_version(model) != opset:  # it converts down to 17
        raise ValueError(f"--opset {opset}: it wrote opset {opset_version(model)}")
    cleanup_with_types(model)
    drop_malformed_zero_conv_bias(model)
    return model


def _torchscript(
    module, args: tuple, kwargs: dict, opset, input_names, dynamic_axes
) -> tuple[ir.Model, list[str]]:
    """The TorchScript exporter's model (opset 17 unless ``opset``), weights in memory, cleaned
    up, and the tracer's warnings (:func:`_tracer_warnings`)."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        _quiet(),
        torch.no_grad(),
        _tracer_warnings() as warned,
    ):
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(
            module,
            args + ((kwargs,) if kwargs else ()),
            str(path),
            dynamo=False,
            opset_version=opset or 17,
            input_names=input_names,
            dynamic_axes=dynamic_axes,
        )
        model = ir.load(path)
        # Read the weights into memory before the folder goes away.
        for value in model.graph.initializers.values():
            value.const_value = ir.tensor(value.const_value.numpy(), name=value.name)
    cleanup_with_types(model)
    return model, warned
