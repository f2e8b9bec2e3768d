"""The main job's options, and the command-line flags that fill them, in one place.

:class:`Options` is what :func:`normexport.pipeline.run` (and :func:`normexport.optimize`)
take, typed: shapes as :class:`~normexport.io.inputs.InputSpec`, ``--dim`` a mapping,
``--dynamic`` parsed (:class:`DynamicAxes`), constructor arguments a dict, paths
:class:`~pathlib.Path`. :func:`make_options` builds it from what a user typed or passed, and is
where every such value is parsed and refused; nothing downstream parses a user's string. Each
flag's ``dest`` is the name of the field it fills (the API's keyword of the same name), and its
default is that field's default (a command may give ``--budget`` its own), so
:func:`options_from_args` is :func:`make_options` of the parsed flags. The argument groups are
shared: the main command uses all five, ``explain`` the model and provider groups, ``bench`` the
model, provider and timing groups and flags of its own (:mod:`normexport.bench.command`). This
module imports no PyTorch or ONNX Runtime package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fusion import TARGETS
from normexport.errors import UsageError
from normexport.io import dims
from normexport.io.inputs import InputSpec, parse_input_shape
from normexport.verdict.parity import DEFAULT_ATOL, DEFAULT_RTOL, NOISE_WARN_FACTOR


@dataclasses.dataclass
class Options:
    """What the user asked for; the CLI flags of the same names fill it.

    Attributes:
        model: the model file (for an in-memory ``module``, a name used in messages and in
            the report).
        output: where to write the optimized model (default: MODEL stem + ``.opt.onnx``).
        report: where the caller will write the JSON report (and ``.png`` chart beside it), or
            None; checked up front so that no output lands on the input or on another.
        input_shape: one :class:`~normexport.io.inputs.InputSpec` per input (``--input-shape``).
        dim: symbolic axis name -> size, for every input axis of that name (``--dim``; ONNX
            input; :mod:`normexport.io.dims`).
        inputs: an ``.npz`` file of example inputs by name (real data), or None.
        dynamic: the axes to export dynamic (``--dynamic``, :class:`DynamicAxes`), or None.
        opset: ai.onnx opset to export at (None: the exporter's default).
        target: ``ort`` or ``onnx`` (see :data:`fusion.TARGETS`).
        provider: ``auto``, ``cpu`` or ``cuda``.
        benchmark: time the variants (``--no-benchmark`` clears it).
        atol, rtol: parity tolerances (see :func:`normexport.verdict.parity.closeness`); atol in the
            outputs' units, rtol times the oracle's largest magnitude.
        strict: fail the verdict where an output passes but is more than
            :data:`normexport.verdict.parity.NOISE_WARN_FACTOR` times further from the oracle than
            the raw model (float32; by default a warning).
        trust_pickle, model_class, exporter: how to load and export the model (see
            docs/model-files.md).
        model_kwargs: ``model_class``'s constructor arguments (``--model-kwargs``, a JSON
            object), or None.
        budget_s: seconds of timed runs to aim for, in all (``--budget``; ``normexport bench``
            has its own default, :data:`normexport.bench.options.BENCH_BUDGET_S`).
        autotune: time the exact alternative forms of the optimized model (and the ORT
            session settings they need; where attention was fused, also the model without
            it) on ``provider`` and keep the fastest.
        precision: ``fp32`` (the model as optimized), ``fp16`` or ``bf16`` (converted to
            float16 or bfloat16 after optimizing, norms kept safe: see
            :mod:`normexport.precision`; bf16 is refused where the provider has no bfloat16
            kernel for the model's linear ops, as ONNX Runtime's CPU provider).
        keep_io_types: with ``fp16``, keep the model's inputs and outputs float32 (``bf16``
            always does).
        module: an in-memory ``torch.nn.Module`` to export instead of loading ``model``
            (Python API only; it is run in eval mode).
        args, kwargs: ``module``'s example arguments, as :func:`torch.onnx.export` takes them
            (Python API only; :func:`normexport.io.examples.from_tensors`), or None.
    """

    model: Path
    output: Path | None = None
    report: Path | None = None
    input_shape: tuple[InputSpec, ...] = ()
    dim: dict[str, int] = dataclasses.field(default_factory=dict)
    inputs: Path | None = None
    dynamic: DynamicAxes | None = None
    opset: int | None = None
    target: str = "ort"
    provider: str = "auto"
    benchmark: bool = True
    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL
    strict: bool = False
    trust_pickle: bool = False
    model_class: str | None = None
    model_kwargs: dict[str, Any] | None = None
    exporter: str = "auto"
    budget_s: float = 10.0
    autotune: bool = False
    precision: str = "fp32"
    keep_io_types: bool = False
    module: Any = None
    args: tuple | None = None
    kwargs: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class DynamicAxes:
    """``--dynamic`` parsed: ``batch`` marks axis 0 of every input, ``sequence`` axis 1
    (``batch,sequence`` both), and ``NAME:0,2`` the listed axes of one input (several such specs
    separated by ``;``).

    Attributes:
        spec: the text as given (for messages).
        every: axis -> dimension name, for every input.
        named: input name -> its axes (named ``NAME_dimA``).
    """

    spec: str
    every: dict[int, str]
    named: dict[str, tuple[int, ...]]

    def axes(self, names: list[str]) -> dict[str, dict[int, str]]:
        """``{input: {axis: dimension name}}`` for the inputs ``names``.

        Raises:
            UsageError: an input named in the spec is not among ``names``.
        """
        for name in self.named:
            if name not in names:
                raise UsageError(
                    f"--dynamic {self.spec!r}: no input named {name!r} (inputs: {names})"
                )
        out = {name: dict(self.every) for name in names if self.every}
        for name, axes in self.named.items():
            out[name] = {axis: f"{name}_dim{axis}" for axis in axes}
        return out


def parse_dynamic(spec: str) -> DynamicAxes:
    """``--dynamic`` as :class:`DynamicAxes`.

    Raises:
        UsageError: neither ``batch``, ``sequence`` nor ``NAME:AXES`` with integer axes.
    """
    words = {"batch": 0, "sequence": 1}
    every: dict[int, str] = {}
    named: dict[str, tuple[int, ...]] = {}
    for part in spec.split(";"):
        if ":" in part:
            name, _, axes = part.partition(":")
            try:
                named[name] = tuple(int(d) for d in axes.split(","))
            except ValueError:
                raise UsageError(f"--dynamic {spec!r}: axes must be integers") from None
            continue
        for word in part.split(","):
            if word not in words:
                raise UsageError(
                    f"--dynamic {spec!r}: use batch, sequence, batch,sequence or NAME:0,1"
                )
            every[words[word]] = word
    return DynamicAxes(spec, every, named)


def make_options(**values: Any) -> Options:
    """The :class:`Options` of what a user gave, each value in the form the CLI or the API
    takes it (keywords: the fields): ``input_shape`` as ``"1,3,224,224"``,
    ``"input_ids=2x16:int64"``, a sequence of ints (float32) or an InputSpec; ``dim`` as a
    mapping or ``NAME=SIZE`` strings; ``dynamic`` as ``--dynamic``'s text; ``model_kwargs`` as a
    mapping or a JSON object; paths as str or path-like. None keeps a field's default.

    Raises:
        UsageError: a value that cannot be parsed, naming its flag.
        TypeError: a keyword that is no field.
    """
    given = {k: v for k, v in values.items() if v is not None}
    for key in ("model", "output", "report", "inputs"):
        if isinstance(given.get(key), str | os.PathLike):
            given[key] = Path(given[key])
    if "input_shape" in given:
        given["input_shape"] = tuple(_input_spec(s) for s in given["input_shape"])
    if "dim" in given:
        given["dim"] = _dims(given["dim"])
    if isinstance(given.get("dynamic"), str):
        given["dynamic"] = parse_dynamic(given["dynamic"]) if given["dynamic"] else None
    if "model_kwargs" in given:
        given["model_kwargs"] = _model_kwargs(given["model_kwargs"])
    return Options(**given)


def _input_spec(value: str | InputSpec | Iterable[int]) -> InputSpec:
    """One ``input_shape`` entry as an :class:`~normexport.io.inputs.InputSpec`."""
    if isinstance(value, InputSpec):
        return value
    if isinstance(value, str):
        return parse_input_shape(value)
    try:
        return InputSpec(None, tuple(int(d) for d in value), np.dtype(np.float32))
    except (TypeError, ValueError):
        raise UsageError(
            f"--input-shape {value!r}: give a string such as 1,3,224,224 or a tuple of ints"
        ) from None


def _dims(value: Mapping[str, int] | Iterable[str]) -> dict[str, int]:
    """``dim`` as name -> size: a mapping checked, ``NAME=SIZE`` strings parsed."""
    if not isinstance(value, Mapping):
        return dims.parse(value)
    for name, size in value.items():
        if not (isinstance(size, int) and size >= 1):
            raise UsageError(f"--dim {name}={size!r}: give a positive integer size")
    return dict(value)


def _model_kwargs(value: str | Mapping[str, Any]) -> dict[str, Any]:
    """``model_kwargs`` as a dict: a JSON object parsed, a mapping copied."""
    if isinstance(value, Mapping):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise UsageError(f"--model-kwargs is not valid JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise UsageError("--model-kwargs must be a JSON object, e.g. '{\"depth\": 18}'")
    return parsed


def _default(name: str) -> Any:
    """The default of the :class:`Options` field ``name`` (for a flag's ``default=``)."""
    return next(f.default for f in dataclasses.fields(Options) if f.name == name)


def options_from_args(args: argparse.Namespace) -> Options:
    """The :class:`Options` that parsed flags ask for: every field a flag of this parser
    fills (its ``dest`` is the field's name); the others keep their defaults."""
    given = vars(args)
    names = [f.name for f in dataclasses.fields(Options)]
    return make_options(**{name: given[name] for name in names if name in given})


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL and the flags that say how to load and export it (main command, explain, bench)."""
    p.add_argument(
        "model",
        type=Path,
        help="torch.save'd nn.Module (needs --trust-pickle) or state_dict (needs "
        "--model-class), TorchScript archive, torch.export .pt2, or .onnx",
    )
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="SHAPE",
        help="one per input, in forward() order: 1,3,224,224 or input_ids=2x16:int64",
    )
    p.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="size of every input axis of that symbolic name, e.g. sequence_length=16 (ONNX)",
    )
    p.add_argument("--inputs", type=Path, help=".npz of example inputs by name (real data)")
    p.add_argument(
        "--dynamic", metavar="AXES", help="dynamic axes: batch, batch,sequence or NAME:0,1"
    )
    p.add_argument("--opset", type=int, help="ai.onnx opset to export at (PyTorch models)")
    p.add_argument(
        "--target",
        choices=TARGETS,
        default=_default("target"),
        help="ort: ONNX Runtime ops allowed (default); onnx: standard ops only",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow unpickling code from the file: a pickled nn.Module, or pickled weights or "
        "constants inside a .pt2 (this runs code from the file)",
    )
    p.add_argument("--model-class", metavar="PKG.MODULE:CLASS", help="class for a state_dict")
    p.add_argument("--model-kwargs", metavar="JSON", help="constructor arguments, JSON object")
    p.add_argument(
        "--exporter",
        choices=["auto", "dynamo", "torchscript"],
        default=_default("exporter"),
        help="see README",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Where the main command writes: the model, the report, and the optional explanation."""
    p.add_argument("-o", "--output", type=Path, help="optimized model (default: MODEL.opt.onnx)")
    p.add_argument("--report", type=Path, help="write the report as JSON here (+ a .png chart)")
    p.add_argument(
        "--explain", action="store_true", help="also list every candidate and what became of it"
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "fp16", "bf16"],
        default=_default("precision"),
        help="write the model in this precision (fp16, bf16: norms keep float32 statistics; "
        "bf16 needs bfloat16 kernels on the provider, refused on CPU; see docs/precision.md)",
    )
    p.add_argument(
        "--keep-io-types",
        action="store_true",
        help="with --precision fp16: keep float32 model inputs and outputs (bf16 always does)",
    )


def add_provider_arguments(p: argparse.ArgumentParser) -> None:
    """Where the model runs: ``--provider`` (main command, explain, bench)."""
    p.add_argument(
        "--provider",
        choices=["auto", "cpu", "cuda"],
        default=_default("provider"),
        help="ONNX Runtime execution provider (auto: CUDA where it loads, else CPU, said so)",
    )


def add_timing_arguments(p: argparse.ArgumentParser, budget_s: float | None = None) -> None:
    """How long to time: ``--budget`` (main command, and bench with its own default
    ``budget_s``; else :class:`Options`')."""
    budget_s = _default("budget_s") if budget_s is None else budget_s
    p.add_argument(
        "--budget",
        dest="budget_s",
        type=float,
        default=budget_s,
        metavar="SECONDS",
        help=f"seconds of timing, in all (default {budget_s:g})",
    )


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    """How the main command checks and times the result: timing on or off, autotune, parity
    tolerances."""
    p.add_argument(
        "--no-benchmark",
        dest="benchmark",
        action="store_false",
        help="skip the latency comparison and its verdict (the report says the speed is unchecked)",
    )
    p.add_argument(
        "--autotune",
        action="store_true",
        help="time the exact alternative forms on this machine's provider and keep the fastest",
    )
    p.add_argument("--atol", type=float, default=_default("atol"), help="parity absolute tolerance")
    p.add_argument(
        "--rtol",
        type=float,
        default=_default("rtol"),
        help="parity relative tolerance (times the output's max magnitude)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail parity where an output is within the tolerance but more than "
        f"{NOISE_WARN_FACTOR:g}x further from the oracle than the raw model (float32 rounding "
        "does not explain it; by default a warning)",
    )


def check_options(opts: Options) -> None:
    """Refuse option values that cannot mean anything, before any work is done.

    Raises:
        UsageError: naming the option and its valid range.
    """
    from normexport import precision, runtime  # ONNX and ONNX Runtime: imported on first use

    if opts.target not in TARGETS:
        raise UsageError(f"--target {opts.target!r}: choose one of {', '.join(TARGETS)}")
    for flag, value in (("--atol", opts.atol), ("--rtol", opts.rtol)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} {value}: give a finite tolerance >= 0, e.g. {flag} 1e-4")
    precision.check_precision(opts.precision)
    if opts.keep_io_types and opts.precision == "fp32":
        raise UsageError("--keep-io-types applies to --precision fp16: add --precision fp16")
    if not (math.isfinite(opts.budget_s) and opts.budget_s > 0):
        raise UsageError(f"--budget {opts.budget_s}: give a number of seconds > 0")
    # ONNX Runtime guarantees opset 7 and up; the newest is what this onnx and ORT both load
    if opts.opset is not None and not 7 <= opts.opset <= runtime.max_opset():
        raise UsageError(
            f"--opset {opts.opset}: give an ai.onnx opset from 7 to {runtime.max_opset()}"
        )
