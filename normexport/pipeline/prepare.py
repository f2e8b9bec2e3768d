"""The first stage: load the model (or take the module given), settle its example inputs,
export it to ONNX (or take the ONNX file as it is)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx_ir as ir
import torch

from fusion.graph import opset_version
from normexport.arguments import Options, check_options
from normexport.errors import InputFileError, UsageError
from normexport.io import examples, external
from normexport.io.export import ExportError, export_module
from normexport.io.inputs import (
    Sizing,
    check_size,
    conform,
    declared_dtypes,
    example_arrays,
    id_ranges,
    onnx_input_specs,
)
from normexport.io.load import LoadedModel, load_model


@dataclasses.dataclass(frozen=True)
class ExportInfo:
    """Which exporter made the raw model.

    Attributes:
        exporter: ``"dynamo"``, ``"torchscript"``, or ``"none"`` for ONNX input.
        fallback_reason: why the dynamo exporter failed where the TorchScript one was used
            (one line), else None.
        warnings: the TorchScript tracer's warnings (``file:line: message``), each once.
    """

    exporter: str
    fallback_reason: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


class Prepared(NamedTuple):
    """The loaded model, its example inputs, its ONNX form before normexport's passes, and,
    for an ONNX file whose example inputs normexport made, their sizes try by try (None
    otherwise)."""

    loaded: LoadedModel
    example: dict[str, np.ndarray]
    raw: ir.Model
    export: ExportInfo
    sizing: Sizing | None = None


def prepare(opts: Options) -> Prepared:
    """Load the model (or take ``opts.module``), settle its example inputs, export it (or take
    the ONNX as it is).

    Returns:
        ``(loaded, example inputs by name, ONNX model before normexport's passes, export,
        sizing)``; ``export.exporter`` is ``"dynamo"``, ``"torchscript"`` or ``"none"`` for
        ONNX input; ``sizing`` the example's sizes try by try, for an ONNX file's example made
        here (:class:`normexport.io.inputs.Sizing`), else None.

    Raises:
        UsageError: a bad option (:func:`normexport.arguments.check_options`), a file that
            cannot be read or exported (:class:`normexport.errors.InputFileError`).
    """
    check_options(opts)
    if opts.module is not None:
        module, example = opts.module, None
        if opts.args is not None or opts.kwargs is not None:
            module, example = examples.from_tensors(module, opts.args or (), opts.kwargs or {})
        loaded = LoadedModel(
            Path(opts.model), "nn_module", module=module.eval(), example_inputs=example
        )
    else:
        loaded = load_model(
            opts.model,
            trust_pickle=opts.trust_pickle,
            model_class=opts.model_class,
            model_kwargs=opts.model_kwargs,
        )
    if loaded.kind == "onnx":
        external.require_external_data(loaded.onnx_model, loaded.path)
    example, sizing = _example_inputs(loaded, opts)
    raw, export = _raw_onnx(loaded, example, opts)
    return Prepared(loaded, example, raw, export, sizing)


def _example_inputs(
    loaded: LoadedModel, opts: Options
) -> tuple[dict[str, np.ndarray], Sizing | None]:
    """Example inputs by name: from ``--inputs``, ``--input-shape``, the file (or the example
    arguments of an in-memory module), or the graph (with its sizes try by try)."""
    specs = list(opts.input_shape)
    if opts.inputs is not None:
        try:
            with np.load(opts.inputs) as data:
                arrays = {k: data[k] for k in data.files}
        except (OSError, ValueError) as err:
            raise UsageError(f"--inputs {opts.inputs}: cannot read it as .npz ({err})") from None
        model = loaded.onnx_model if loaded.kind == "onnx" else loaded.module
        expected = declared_dtypes(model, arrays)
        return conform(arrays, expected, f"--inputs {opts.inputs}"), None
    if opts.dim and loaded.kind != "onnx":
        raise UsageError(
            f"--dim sizes the symbolic axes of an ONNX file's inputs; {loaded.path} is a "
            "PyTorch model: give its inputs with --input-shape"
        )
    if loaded.kind == "onnx":
        sizing = onnx_input_specs(loaded.onnx_model, specs, str(loaded.path), opts.dim)
        return example_arrays(sizing.specs, id_ranges(loaded.onnx_model)), sizing
    if not specs and loaded.example_inputs is not None:
        return dict(loaded.example_inputs), None
    elif not specs:
        raise UsageError(
            f"cannot guess the inputs of {loaded.path} ({loaded.kind.replace('_', ' ')}): add "
            "--input-shape for each input, e.g. --input-shape 1,3,224,224 or "
            "--input-shape input_ids=2x16:int64 (or --inputs FILE.npz)"
        )
    check_size(specs)
    return example_arrays(specs), None


def _raw_onnx(
    loaded: LoadedModel, example: dict[str, np.ndarray], opts: Options
) -> tuple[ir.Model, ExportInfo]:
    """The model before normexport's passes, and which exporter made it ("none" for ONNX)."""
    if loaded.kind == "onnx":
        for flag, value in (("--opset", opts.opset), ("--dynamic", opts.dynamic)):
            if value:
                raise UsageError(f"{flag} applies to PyTorch models; {loaded.path} is ONNX already")
        return loaded.onnx_model, ExportInfo("none")
    names = list(example)
    args = [torch.from_numpy(a) for a in example.values()]
    try:
        exported = export_module(
            loaded.module,
            args,
            opset=opts.opset,
            input_names=names,
            dynamic_axes=opts.dynamic.axes(names) if opts.dynamic else None,
            exporter=opts.exporter,
        )
    except ExportError as err:
        raise InputFileError(f"{loaded.path}: could not export to ONNX: {err}") from None
    _check_export(exported, loaded, opts)
    info = ExportInfo(exported.exporter, exported.fallback_reason, exported.warnings)
    return exported.model, info


def _check_export(exported, loaded: LoadedModel, opts: Options) -> None:
    """Refuse an export that cannot be what the user asked for: a graph with no outputs
    (``forward`` returned no tensor), or an opset other than ``--opset``.

    Raises:
        InputFileError: the graph has no outputs.
        UsageError: ``--opset`` cannot be had from this exporter.
    """
    if not exported.model.graph.outputs:
        raise InputFileError(
            f"{loaded.path}: the model's forward() returns no tensor, so its ONNX graph has no "
            "outputs: return the tensor(s) the model computes"
        )
    got = opset_version(exported.model)
    if opts.opset is not None and got != opts.opset:
        raise UsageError(
            f"--opset {opts.opset}: the {exported.exporter} exporter cannot export at that "
            f"opset (it wrote opset {got}); choose another --opset, or another --exporter"
        )


def by_feed_name(example: dict[str, np.ndarray], feed_names: list[str]) -> dict:
    """Example arrays keyed by the ONNX graph's input names (by name, else by position).

    Raises:
        UsageError: the graph has another number of inputs than the examples given.
    """
    if set(feed_names) <= set(example):
        return {name: example[name] for name in feed_names}
    if len(feed_names) != len(example):
        raise UsageError(
            f"the exported graph has inputs {feed_names} but {len(example)} example inputs "
            f"({list(example)}) were given"
        )
    return dict(zip(feed_names, example.values(), strict=True))
