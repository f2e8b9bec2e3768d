""":class:`Options`, typed, and :func:`make_options`, where what a user typed or passed is parsed
and refused (see :mod:`normexport.arguments`); :func:`check_options`, the ranges checked before
any work is done."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from normexport.errors import UsageError
from normexport.io import dims
from normexport.io.specs import InputSpec, parse_input_shape
from normexport.verdict.tolerance import DEFAULT_ATOL, DEFAULT_RTOL, NOISE_WARN_FACTOR

#: The fusion targets, as :data:`fusion.TARGETS` names them (a test holds the two equal): the
#: options are checked before ``fusion`` is imported (it loads onnxscript and ONNX Runtime,
#: about a second), so that a mistake answers at once.
TARGETS = ("ort", "onnx")

#: The values of ``--precision``, each with what the run makes of the optimized model
#: (:attr:`Options.conversion`, the one place it is decided): None keeps it float32, ``"half"``
#: converts it (:mod:`normexport.precision`; whether ``bf16`` can be delivered is asked of ONNX
#: Runtime when converting), ``"int8"`` quantizes it (its values are
#: :data:`normexport.precision.int8.INT8_PRECISIONS`, a test holds the two equal).
PRECISIONS = {"fp32": None, "fp16": "half", "bf16": "half", "int8": "int8", "int8-dynamic": "int8"}

#: The values of ``--provider`` (:func:`normexport.runtime.resolve_provider` resolves ``auto``).
PROVIDERS = ("auto", "cpu", "cuda")

#: The values of ``--exporter`` (docs/model-files.md).
EXPORTERS = ("auto", "dynamo", "torchscript")

#: The groups of flags (:attr:`Flag.group`), in the order the main command's help lists them;
#: each command adds those it takes (:func:`normexport.arguments.flags.add_flags`).
FLAG_GROUPS = (
    "model",
    "output",
    "make_dirs",
    "precision",
    "provider",
    "threads",
    "timing",
    "check",
)


@dataclasses.dataclass(frozen=True)
class Flag:
    """The command-line flag of an :class:`Options` field, kept in the field's metadata
    (``"flag"``; :func:`flag` declares both): :func:`normexport.arguments.flags.add_flags` adds
    it with ``dest`` the field's name and ``default`` the field's default.

    Attributes:
        group: one of :data:`FLAG_GROUPS`; within a group the flags come in field order.
        help: the flag's help (argparse's ``%(default)g`` names the default).
        names: the option strings, or the positional's name; empty: ``--`` and the field's
            name, underscores as hyphens (``--no-`` before it for a field that is True by
            default).
        argparse: the other keywords of :meth:`argparse.ArgumentParser.add_argument` (``type``,
            ``metavar``, ``choices``, ``action``); a bool field's action follows its default
            (``store_true``, or ``store_false`` where it is True).
    """

    group: str
    help: str
    names: tuple[str, ...] = ()
    argparse: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def flag(
    group: str,
    help: str,
    *names: str,
    default: Any = None,
    default_factory: Any = dataclasses.MISSING,
    **argparse: Any,
) -> Any:
    """An :class:`Options` field and its command-line flag, declared together: the
    :func:`dataclasses.field` of ``default`` (or ``default_factory``; ``dataclasses.MISSING``:
    a field without one) whose metadata is its :class:`Flag` (the other arguments)."""
    if default_factory is not dataclasses.MISSING:
        default = dataclasses.MISSING
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={"flag": Flag(group, help, names, argparse)},
    )


@dataclasses.dataclass
class Options:
    """What the user asked for; the CLI flags of the same names fill it, each declared with its
    field (:func:`flag`: its group, help and argparse keywords; its ``dest`` the field's name,
    its default the field's), the API's keywords of the same names too.

    Attributes:
        model: the model file (for an in-memory ``module``, a name used in messages and in
            the report).
        output: where to write the optimized model (default: MODEL stem + ``.opt.onnx``).
        report: where the caller will write the JSON report (and ``.png`` chart beside it), or
            None; checked up front so that no output lands on the input or on another.
        make_dirs: make the folders of ``output`` and ``report`` that do not exist; else such
            a path is refused before any work (a typo would otherwise make folders).
        input_shape: one :class:`~normexport.io.specs.InputSpec` per input (``--input-shape``).
        dim: symbolic axis name -> size, for every input axis of that name (``--dim``; ONNX
            input; :mod:`normexport.io.dims`).
        inputs: an ``.npz`` file of example inputs by name (real data), or None.
        dynamic: the axes to export dynamic (``--dynamic``, :class:`DynamicAxes`), or None.
        opset: ai.onnx opset to export at (None: the exporter's default).
        target: ``ort`` or ``onnx`` (see :data:`fusion.TARGETS`).
        provider: ``auto``, ``cpu`` or ``cuda``.
        threads: the intra-op threads of the CPU provider the model is made for and timed
            with (``--threads``: the CPU fusion policy's, :attr:`fusion.Policy.threads`), or
            None: the cores this process may run on (resolved once per run, by
            :func:`normexport.pipeline.job.run_threads`).
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
            has its own default, :data:`normexport.bench.bench_options.BENCH_BUDGET_S`).
        run_timeout: seconds an ONNX Runtime run of the verdict may take before it is
            cancelled (``--run-timeout``; :class:`normexport.errors.RunTimedOut`, exit 2).
        autotune: time the exact alternative forms of the optimized model (and the ORT
            session settings they need; where attention was fused, also the model without
            it) on ``provider`` and keep the fastest.
        precision: ``fp32`` (the model as optimized), ``fp16`` or ``bf16`` (converted to
            float16 or bfloat16 after optimizing, norms kept safe: see
            :mod:`normexport.precision`; bf16 is refused where the provider has no bfloat16
            kernel for the model's linear ops, as ONNX Runtime's CPU provider).
            ``int8`` / ``int8-dynamic``: quantized by ONNX Runtime's tools after optimizing,
            norms and Softmax kept float, published only where faster than float32
            (:mod:`normexport.precision.int8`).
        calibration: ``int8``'s calibration samples: a folder of ``.npz`` files or one
            ``.npz`` with a leading sample axis (:func:`normexport.precision.int8.
            load_calibration`), or None: the generated input sets, with a warning.
        keep_io_types: with ``fp16``, keep the model's inputs and outputs float32 (``bf16``
            always does).
        last_token_logits: write the model's first output, a decoder's ``(batch, sequence,
            vocabulary)`` logits, at the last position only (``(batch, 1, vocabulary)``), and
            compute only what that reads (:attr:`fusion.Policy.last_rows`); the verdict compares
            it with the references' last position.
        module: an in-memory ``torch.nn.Module`` to export instead of loading ``model``
            (Python API only; it is run in eval mode).
        args, kwargs: ``module``'s example arguments, as :func:`torch.onnx.export` takes them
            (Python API only; :func:`normexport.io.examples.from_tensors`), or None.
    """

    model: Path = flag(
        "model",
        "torch.save'd nn.Module (needs --trust-pickle) or state_dict (needs --model-class), "
        "TorchScript archive, torch.export .pt2, or .onnx",
        "model",
        default=dataclasses.MISSING,
        type=Path,
    )
    output: Path | None = flag(
        "output", "optimized model (default: MODEL.opt.onnx)", "-o", "--output", type=Path
    )
    report: Path | None = flag(
        "output", "write the report as JSON here (+ a .png chart)", type=Path
    )
    make_dirs: bool = flag(
        "make_dirs",
        "make the folders of the output paths that do not exist (default: refuse them)",
        default=False,
    )
    input_shape: tuple[InputSpec, ...] = flag(
        "model",
        "one per input, in forward() order: 1,3,224,224 or input_ids=2x16:int64",
        default=(),
        action="append",
        metavar="SHAPE",
    )
    dim: dict[str, int] = flag(
        "model",
        "size of every input axis of that symbolic name, e.g. sequence_length=16 (ONNX)",
        default_factory=dict,
        action="append",
        metavar="NAME=SIZE",
    )
    inputs: Path | None = flag("model", ".npz of example inputs by name (real data)", type=Path)
    dynamic: DynamicAxes | None = flag(
        "model", "dynamic axes: batch, batch,sequence or NAME:0,1", metavar="AXES"
    )
    opset: int | None = flag("model", "ai.onnx opset to export at (PyTorch models)", type=int)
    target: str = flag(
        "model",
        "ort: ONNX Runtime ops allowed (default); onnx: standard ops only",
        default="ort",
        choices=TARGETS,
    )
    provider: str = flag(
        "provider",
        "ONNX Runtime execution provider (auto: CUDA where it loads, else CPU, said so)",
        default="auto",
        choices=PROVIDERS,
    )
    threads: int | None = flag(
        "threads",
        "intra-op threads the model will run on (CPU provider): what the fusions are chosen for "
        "and the latency is timed with (default: this machine's cores)",
        type=int,
        metavar="N",
    )
    benchmark: bool = flag(
        "check",
        "skip the latency comparison and its verdict (the report says the speed is unchecked)",
        default=True,
    )
    run_timeout: float = flag(
        "check",
        "cancel an ONNX Runtime run of the checks that takes longer (exit 2; default %(default)g)",
        default=600.0,
        type=float,
        metavar="SECONDS",
    )
    autotune: bool = flag(
        "check",
        "time the exact alternative forms on this machine's provider and keep the fastest",
        default=False,
    )
    atol: float = flag("check", "parity absolute tolerance", default=DEFAULT_ATOL, type=float)
    rtol: float = flag(
        "check",
        "parity relative tolerance (times the output's max magnitude)",
        default=DEFAULT_RTOL,
        type=float,
    )
    strict: bool = flag(
        "check",
        "fail parity where an output is within the tolerance but more than "
        f"{NOISE_WARN_FACTOR:g}x further from the oracle than the raw model (float32 rounding "
        "does not explain it; by default a warning)",
        default=False,
    )
    trust_pickle: bool = flag(
        "model",
        "allow unpickling code from the file: a pickled nn.Module, or pickled weights or "
        "constants inside a .pt2 (this runs code from the file)",
        default=False,
    )
    model_class: str | None = flag("model", "class for a state_dict", metavar="PKG.MODULE:CLASS")
    model_kwargs: dict[str, Any] | None = flag(
        "model", "constructor arguments, JSON object", metavar="JSON"
    )
    exporter: str = flag("model", "see README", default="auto", choices=EXPORTERS)
    budget_s: float = flag(
        "timing",
        "seconds of timing, in all (default %(default)g)",
        "--budget",
        default=10.0,
        type=float,
        metavar="SECONDS",
    )
    precision: str = flag(
        "precision",
        "write the model in this precision (fp16, bf16: norms keep float32 statistics; bf16 "
        "needs bfloat16 kernels on the provider, refused on CPU; int8, int8-dynamic: ONNX "
        "Runtime's quantizer, norms kept float, published where faster; see docs/precision.md)",
        default="fp32",
        choices=tuple(PRECISIONS),
    )
    calibration: Path | None = flag(
        "precision",
        "with --precision int8: calibration samples, a folder of .npz (one sample each) or one "
        ".npz with a leading sample axis (default: the generated inputs, with a warning)",
        type=Path,
    )
    keep_io_types: bool = flag(
        "precision",
        "with --precision fp16: keep float32 model inputs and outputs (bf16 always does)",
        default=False,
    )
    last_token_logits: bool = flag(
        "precision",
        "write the first output, a decoder's (batch, sequence, vocabulary) logits, at the last "
        "position only, (batch, 1, vocabulary), computing only what that reads",
        default=False,
    )
    module: Any = None
    args: tuple | None = None
    kwargs: dict[str, Any] | None = None

    @property
    def conversion(self) -> str | None:
        """What the run makes of the optimized model by ``--precision``
        (:data:`PRECISIONS`): None keeps it float32, ``"half"`` converts it to float16 or
        bfloat16 (:func:`normexport.precision.to_half`), ``"int8"`` quantizes it
        (:mod:`normexport.precision.int8`)."""
        return PRECISIONS[self.precision]


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
    for key in ("model", "output", "report", "inputs", "calibration"):
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
    """One ``input_shape`` entry as an :class:`~normexport.io.specs.InputSpec`."""
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


def check_options(opts: Options) -> None:
    """Refuse option values that cannot mean anything, before any work is done.

    Raises:
        UsageError: naming the option and its valid range.
    """
    if opts.target not in TARGETS:
        raise UsageError(f"--target {opts.target!r}: choose one of {', '.join(TARGETS)}")
    if opts.precision not in PRECISIONS:
        raise UsageError(f"--precision {opts.precision!r}: choose one of {', '.join(PRECISIONS)}")
    for flag, value in (("--atol", opts.atol), ("--rtol", opts.rtol)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} {value}: give a finite tolerance >= 0, e.g. {flag} 1e-4")
    if opts.calibration is not None and opts.precision != "int8":
        raise UsageError("--calibration applies to --precision int8: add --precision int8")
    if opts.keep_io_types and opts.conversion != "half":
        raise UsageError("--keep-io-types applies to --precision fp16: add --precision fp16")
    if not (math.isfinite(opts.budget_s) and opts.budget_s > 0):
        raise UsageError(f"--budget {opts.budget_s}: give a number of seconds > 0")
    if not (math.isfinite(opts.run_timeout) and opts.run_timeout > 0):
        raise UsageError(f"--run-timeout {opts.run_timeout}: give a number of seconds > 0")
    if opts.threads is not None and opts.threads < 1:
        raise UsageError(f"--threads {opts.threads}: give a number of threads >= 1")
    if opts.opset is not None:
        _check_opset(opts.opset)


def _check_opset(opset: int) -> None:
    """Refuse an ai.onnx opset ONNX Runtime cannot load: it guarantees 7 and up; the newest is
    what this onnx and ONNX Runtime both load (asked of them: imported here, not before).

    Raises:
        UsageError: naming ``--opset`` and the range.
    """
    from normexport import runtime

    if not 7 <= opset <= runtime.max_opset():
        raise UsageError(f"--opset {opset}: give an ai.onnx opset from 7 to {runtime.max_opset()}")
