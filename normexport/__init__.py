"""normexport: PyTorch -> ONNX with BatchNorm folded and LayerNorm / RMSNorm fused, parity
proven against PyTorch and latency measured on ONNX Runtime.

Python API (the CLI's twin; each keyword is the flag of the same name)::

    import normexport

    report = normexport.optimize("model.pt", trust_pickle=True, input_shape=["1,3,224,224"])
    report.parity.passed, report.fusions.counts["batchnorm_folded"], report.output

    report = normexport.optimize(module, (torch.randn(1, 3, 224, 224),), output="m.onnx")

``import normexport`` is light: PyTorch, ONNX and ONNX Runtime are imported by the first call.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
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
    make_dirs: bool = False,
    input_shape: Sequence[str | Sequence[int]] = (),
    dim: Mapping[str, int] | None = None,
    inputs: str | os.PathLike | None = None,
    dynamic: str | None = None,
    opset: int | None = None,
    target: str = "ort",
    provider: str = "auto",
    threads: int | None = None,
    benchmark: bool = True,
    autotune: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    strict: bool = False,
    budget_s: float | None = None,
    run_timeout: float | None = None,
    trust_pickle: bool = False,
    model_class: str | None = None,
    model_kwargs: str | Mapping[str, Any] | None = None,
    exporter: str = "auto",
    precision: str = "fp32",
    calibration: str | os.PathLike | None = None,
    keep_io_types: bool = False,
    last_token_logits: bool = False,
) -> Report:
    """Export (or take) a model, optimize it, check parity, time it, write it: the main
    command as a function. Each keyword is the CLI flag of the same name (``--input-shape``:
    ``input_shape``; ``--no-benchmark``: ``benchmark=False``; ``--budget``: ``budget_s``) and
    the :class:`Options` field it fills (:func:`normexport.arguments.make_options`).

    Args:
        model: a model file (any kind the CLI takes) or a ``torch.nn.Module`` (run in eval mode).
        args, kwargs: an in-memory module's example arguments, as :func:`torch.onnx.export`
            takes them (``model(*args, **kwargs)`` is exported; tensors become the inputs,
            named after ``forward``'s parameters or their keywords; other values stay fixed),
            instead of ``input_shape`` / ``inputs``.
        output, report, make_dirs: the optimized model's path (``-o``; default MODEL stem +
            ``.opt.onnx``); the JSON report's, and the latency chart's beside it (``.png``);
            make their missing folders (else an OutputPathError before any work).
        input_shape: one per input in ``forward()`` order, as ``"1,3,224,224"``,
            ``"input_ids=2x16:int64"`` or a tuple of ints (float32).
        dim, inputs: symbolic axis name -> size (ONNX input); an ``.npz`` of example inputs.
        the others: as the flags (:class:`Options`; None: their defaults; ``model_kwargs`` a
            mapping or a JSON object).

    Returns:
        The :class:`normexport.report.Report` (``to_dict()``: the JSON; ``passed``: exit 0).

    Raises:
        normexport.errors.UsageError: what the CLI reports with exit 2 (and its subclasses
            InputFileError, OutputPathError, EnvironmentProblem), with the same one-line message.
    """
    return _run(_options(dict(locals())))  # the parameters, by name


def _run(opts: Options) -> Report:
    """Run the pipeline on ``opts`` (a module in eval mode, its training flag restored) and
    write the JSON report and chart where ``opts.report`` asks."""
    from normexport import pipeline
    from normexport.arguments import check_onnxruntime
    from normexport.report import write_chart, write_json

    conflict = check_onnxruntime()
    if conflict:
        warnings.warn(conflict, RuntimeWarning, stacklevel=3)
    training = getattr(opts.module, "training", False)
    try:
        if opts.module is not None:
            opts.module.eval()
        result = pipeline.run(opts)
    finally:
        if training:
            opts.module.train(True)
    if opts.report is not None:
        write_json(result, opts.report)
        write_chart(result, opts.report.with_suffix(".png"))
    return result


def _options(given: dict[str, Any]) -> Options:
    """:class:`Options` from :func:`optimize`'s arguments
    (:func:`normexport.arguments.make_options`), the model a path or an in-memory module.

    Raises:
        UsageError: ``model`` is neither a path nor a module; a module without ``output``;
            example inputs given twice; a value that cannot be parsed.
    """
    from normexport.arguments import make_options
    from normexport.errors import UsageError

    values = {k: v for k, v in given.items() if v is not None}
    model = values.pop("model")
    if isinstance(model, str | os.PathLike):
        if "args" in values or "kwargs" in values:
            raise UsageError(
                "args / kwargs are example arguments of an in-memory module; for a model file "
                "give input_shape or inputs"
            )
        return make_options(model=model, **values)
    if not callable(getattr(model, "forward", None)):
        raise UsageError(
            f"model: give a model file path or a torch.nn.Module, not {type(model).__name__}"
        )
    if "output" not in values:
        raise UsageError("an in-memory module has no file to write beside: give output=PATH")
    if ("args" in values or "kwargs" in values) and (values["input_shape"] or "inputs" in values):
        raise UsageError("give the example inputs once: args / kwargs, or input_shape / inputs")
    if "args" in values:
        values["args"] = tuple(values["args"])
    if "kwargs" in values:
        values["kwargs"] = dict(values["kwargs"])
    name = f"<nn.Module {type(model).__name__}>"
    return make_options(model=name, module=model, **values)


def __getattr__(name: str) -> Any:
    """``normexport.Options`` and ``normexport.Report``, imported on first use."""
    if name == "Options":
        from normexport.arguments import Options

        return Options
    if name == "Report":
        from normexport.report import Report

        return Report
    raise AttributeError(f"module 'normexport' has no attribute {name!r}")
