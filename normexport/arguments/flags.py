"""The command-line flags that fill :class:`~normexport.arguments.options.Options`, in groups
the subcommands share (see :mod:`normexport.arguments`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from normexport.arguments.options import PRECISIONS, TARGETS, Options, make_options
from normexport.verdict.tolerance import NOISE_WARN_FACTOR


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
    p.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks, and the libraries' warnings and log lines (hidden otherwise)",
    )


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Where the main command writes: the model, the report, and the optional explanation."""
    p.add_argument("-o", "--output", type=Path, help="optimized model (default: MODEL.opt.onnx)")
    p.add_argument("--report", type=Path, help="write the report as JSON here (+ a .png chart)")
    add_make_dirs_argument(p)
    p.add_argument(
        "--explain", action="store_true", help="also list every candidate and what became of it"
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=_default("precision"),
        help="write the model in this precision (fp16, bf16: norms keep float32 statistics; "
        "bf16 needs bfloat16 kernels on the provider, refused on CPU; int8, int8-dynamic: "
        "ONNX Runtime's quantizer, norms kept float, published where faster; see "
        "docs/precision.md)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        default=_default("calibration"),
        help="with --precision int8: calibration samples, a folder of .npz (one sample each) "
        "or one .npz with a leading sample axis (default: the generated inputs, with a warning)",
    )
    p.add_argument(
        "--keep-io-types",
        action="store_true",
        help="with --precision fp16: keep float32 model inputs and outputs (bf16 always does)",
    )
    p.add_argument(
        "--last-token-logits",
        action="store_true",
        help="write the first output, a decoder's (batch, sequence, vocabulary) logits, at the "
        "last position only, (batch, 1, vocabulary), computing only what that reads",
    )


def add_make_dirs_argument(p: argparse.ArgumentParser) -> None:
    """``--make-dirs``: the output folders that do not exist are made, not refused (main
    command, bench)."""
    p.add_argument(
        "--make-dirs",
        action="store_true",
        help="make the folders of the output paths that do not exist (default: refuse them)",
    )


def add_provider_arguments(p: argparse.ArgumentParser) -> None:
    """Where the model runs: ``--provider`` (main command, explain, bench)."""
    p.add_argument(
        "--provider",
        choices=["auto", "cpu", "cuda"],
        default=_default("provider"),
        help="ONNX Runtime execution provider (auto: CUDA where it loads, else CPU, said so)",
    )


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """The machine the model is made for: ``--threads`` (main command, explain)."""
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="intra-op threads the model will run on (CPU provider): what the fusions are "
        "chosen for and the latency is timed with (default: this machine's cores)",
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
        "--run-timeout",
        type=float,
        default=_default("run_timeout"),
        metavar="SECONDS",
        help="cancel an ONNX Runtime run of the checks that takes longer (exit 2; default "
        f"{_default('run_timeout'):g})",
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
