"""normexport: PyTorch -> ONNX with BatchNorm folded and LayerNorm / RMSNorm fused, parity
proven against PyTorch and latency measured on ONNX Runtime.

Python API (the CLI's twin; each keyword is the flag of the same name)::

    import normexport

    report = normexport.optimize("model.pt", trust_pickle=True, input_shapes=["1,3,224,224"])
    report.parity.passed, report.fusions.counts["batchnorm_folded"], report.output

    report = normexport.optimize(module, (torch.randn(1, 3, 224, 224),), output="m.onnx")

``import normexport`` is light: PyTorch, ONNX and ONNX Runtime are imported by the first call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from normexport.arguments import Options
    from normexport.report import Report

__version__ = "0.1.0"
__all__ = ["Options", "Report", "optimize"]


def optimize(
    model: str | os.PathLike | Any,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    output: str | os.PathLike | None = None,
    report: str | os.PathLike | None = None,
    input_shapes: Sequence[str | Sequence[int]] = (),
    dims: Mapping[str, int] | None = None,
    inputs: str | os.PathLike | None = None,
    dynamic: str | None = None,
    opset: int | None = None,
    target: str = "ort",
    provider: str = "auto",
    benchmark: bool = True,
    autotune: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    strict: bool = False,
    budget_s: float | None = None,
    trust_pickle: bool = False,
    model_class: str | None = None,
    model_kwargs: str | Mapping[str, Any] | None = None,
    exporter: str = "auto",
    precision: str = "fp32",
    keep_io_types: bool = False,
) -> Report:
    """Export (or take) a model, optimize it, check parity, time it, write it: the main
    command as a function. Each keyword mirrors the CLI flag of the same name.

    Args:
        model: a model file (any kind the CLI takes) or an in-memory ``torch.nn.Module``
            (run in eval mode; its training flag is restored afterwards).
        args, kwargs: an in-memory module's example arguments, as :func:`torch.onnx.export`
            takes them (``model(*args, **kwargs)`` is exported; tensors become the inputs,
            named after ``forward``'s parameters or their keywords; other values stay fixed),
            instead of ``input_shapes`` / ``inputs``.
        output: the optimized model's path (``-o``); default: MODEL stem + ``.opt.onnx``
            beside the file. Required for an in-memory module.
        report: also write the JSON report here, and the latency chart beside it as ``.png``.
        input_shapes: one per input in ``forward()`` order (``--input-shape``), as
            ``"1,3,224,224"``, ``"input_ids=2x16:int64"`` or a tuple of ints (float32).
        dims: symbolic axis name -> size, for every input axis of that name (``--dim``;
            ONNX input).
        inputs: an ``.npz`` of example inputs by name (``--inputs``).
        dynamic, opset, target, provider, exporter, autotune, strict, trust_pickle,
            model_class, precision, keep_io_types: as the flags (:class:`Options`).
        benchmark: time the variants (False: ``--no-benchmark``).
        atol, rtol, budget_s: ``--atol``, ``--rtol``, ``--budget`` (None: their defaults).
        model_kwargs: constructor arguments, a mapping or a JSON object (``--model-kwargs``).

    Returns:
        The :class:`normexport.report.Report`; ``report.to_dict()`` is the CLI's JSON and
        ``report.passed`` its exit code 0 (True) or 1 (False).

    Raises:
        normexport.errors.UsageError: what the CLI reports with exit 2 (and its subclasses
            InputFileError, OutputPathError, EnvironmentProblem), with the same one-line message.
    """
    return _run(_options(dict(locals())))  # the parameters, by name


def _run(opts: Options) -> Report:
    """Run the pipeline on ``opts`` (a module in eval mode, its training flag restored) and
    write the JSON report and chart where ``opts.report`` asks."""
    from normexport import pipeline
    from normexport import report as report_mod

    training = getattr(opts.module, "training", False)
    try:
        if opts.module is not None:
            opts.module.eval()
        result = pipeline.run(opts)
    finally:
        if training:
            opts.module.train(True)
    if opts.report is not None:
        report_mod.write_json(result, opts.report)
        report_mod.write_chart(result, opts.report.with_suffix(".png"))
    return result


def _options(given: dict[str, Any]) -> Options:
    """:class:`Options` from :func:`optimize`'s arguments: paths made :class:`Path`, shapes
    and constructor arguments in the CLI's spelling, None meaning the field's default.

    Raises:
        UsageError: ``model`` is neither a path nor a module; a module without ``output``.
    """
    from normexport.arguments import Options
    from normexport.errors import UsageError

    values = {k: v for k, v in given.items() if v is not None}
    model = values.pop("model")
    for key in ("output", "report", "inputs"):
        if key in values:
            values[key] = Path(values[key])
    values["input_shape"] = [_shape_spec(s) for s in values.pop("input_shapes")]
    values["dim"] = [f"{k}={v}" for k, v in values.pop("dims", {}).items()]
    if isinstance(values.get("model_kwargs"), Mapping):
        values["model_kwargs"] = json.dumps(dict(values["model_kwargs"]))
    if isinstance(model, str | os.PathLike):
        if "args" in values or "kwargs" in values:
            raise UsageError(
                "args / kwargs are example arguments of an in-memory module; for a model file "
                "give input_shapes or inputs"
            )
        return Options(model=Path(model), **values)
    if not callable(getattr(model, "forward", None)):
        raise UsageError(
            f"model: give a model file path or a torch.nn.Module, not {type(model).__name__}"
        )
    if "output" not in values:
        raise UsageError("an in-memory module has no file to write beside: give output=PATH")
    if ("args" in values or "kwargs" in values) and (values["input_shape"] or "inputs" in values):
        raise UsageError("give the example inputs once: args / kwargs, or input_shapes / inputs")
    if "args" in values:
        values["args"] = tuple(values["args"])
    if "kwargs" in values:
        values["kwargs"] = dict(values["kwargs"])
    return Options(model=Path(f"<nn.Module {type(model).__name__}>"), module=model, **values)


def _shape_spec(shape: str | Sequence[int]) -> str:
    """``(1, 3, 224, 224)`` -> ``"1,3,224,224"`` (``--input-shape``'s form); a str as is."""
    return shape if isinstance(shape, str) else ",".join(str(int(d)) for d in shape)


def __getattr__(name: str) -> Any:
    """``normexport.Options`` and ``normexport.Report``, imported on first use."""
    if name == "Options":
        from normexport.arguments import Options

        return Options
    if name == "Report":
        from normexport.report import Report

        return Report
    raise AttributeError(f"module 'normexport' has no attribute {name!r}")
