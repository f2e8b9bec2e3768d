"""``normexport bench MODEL [options]``: the command line of :mod:`normexport.bench`.

Its flags come from :mod:`normexport.arguments`' shared groups (loading and export, provider
and budget: the main command's, with bench's own default budget) and its own (the sweep, what to
time, where to write); the model is prepared as the main job prepares it
(:func:`normexport.pipeline.prepare`, which checks the shared options).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import onnx_ir as ir
from rich.console import Console

from normexport import report, runtime
from normexport.arguments import (
    Options,
    add_flags,
    add_model_arguments,
    options_from_args,
    parse_dynamic,
)
from normexport.bench import variants
from normexport.bench.bench_options import BENCH_BUDGET_S, BenchOptions
from normexport.bench.fixed import fixed_axes, fixed_line
from normexport.bench.measure import bench_model
from normexport.bench.render import render, write_chart
from normexport.bench.results import BenchResult
from normexport.errors import EXIT_OK, UsageError
from normexport.io import external, files
from normexport.io.kinds import detect_kind
from normexport.pipeline import prepare


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for ``normexport bench``."""
    p = argparse.ArgumentParser(
        prog="normexport bench",
        description="Time the raw export, ORT's offline optimization, onnxscript's "
        "optimize_for_ort, ORT's transformer optimizer and normexport's model of MODEL, with "
        "PyTorch eager, interleaved in one process, over a sweep of batch (and sequence) sizes.",
    )
    add_model_arguments(p)
    add_flags(p, "provider")
    add_flags(p, "timing", budget_s=BENCH_BUDGET_S)
    p.add_argument("--batch", default="1,8,64", metavar="B,B,...", help="batch sizes to sweep")
    p.add_argument(
        "--seq",
        metavar="S,S,...",
        help="sequence lengths to sweep (axis 1 of every input of rank >= 2; sequence models)",
    )
    p.add_argument(
        "--sweep",
        choices=["grid", "cross"],
        default="grid",
        help="grid: every (batch, seq) pair; cross: the batches at the first sequence length, "
        "then the sequence lengths at the first batch (fewer points for large models)",
    )
    p.add_argument(
        "--io-binding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="inputs and outputs resident on the device, copies not timed (default: on for "
        "CUDA, off for CPU)",
    )
    p.add_argument("--cuda-graph", action="store_true", help="CUDA graphs (CUDA provider only)")
    p.add_argument(
        "--variants",
        metavar="NAME,...",
        help=f"variants to time (default: all of {', '.join(variants.VARIANTS)})",
    )
    p.add_argument("--no-eager", action="store_true", help="leave PyTorch eager out")
    p.add_argument(
        "--cpu",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the raw export and normexport's model on ORT's CPU provider "
        "(default: on for CUDA)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the elementwise floor")
    p.add_argument(
        "--min-runs",
        type=int,
        default=20,
        metavar="N",
        help="timed rounds per point at least, whatever the budget (default 20)",
    )
    p.add_argument("--json", type=Path, metavar="OUT.json", help="write the results as JSON")
    p.add_argument("--chart", type=Path, metavar="OUT.png", help="latency vs batch chart")
    add_flags(p, "make_dirs")
    return p


def _sizes(text: str | None, flag: str) -> list[int | None]:
    """``1,8,64`` -> ``[1, 8, 64]``; no text -> ``[None]`` (the example's own size).

    Raises:
        UsageError: a size that is no positive integer.
    """
    if not text:
        return [None]
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give sizes like 1,8,64") from None
    if any(s < 1 for s in sizes):
        raise UsageError(f"{flag} {text!r}: sizes must be positive")
    return sizes


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``normexport bench`` on parsed ``args``: print the tables, write ``--json`` and
    ``--chart`` where asked. A swept axis that the model fixes is timed at the model's own size
    only, said in one line before any timing (:mod:`normexport.bench.fixed`).

    Returns:
        :data:`normexport.errors.EXIT_OK` (a variant that fails is recorded, not raised).

    Raises:
        UsageError: a bad option (:func:`_sweep_arguments`,
            :func:`normexport.arguments.check_options`), ``--cuda-graph`` without the CUDA
            provider, an output on the input, a model that cannot be loaded or exported.
    """
    batches, seqs, only = _sweep_arguments(args)
    opts = _options(args, seqs)
    writes = {
        flag: [path] for flag, path in (("--json", args.json), ("--chart", args.chart)) if path
    }
    for flag, (path,) in writes.items():
        files.check_writable(path, flag, make_dirs=args.make_dirs)
    files.refuse_overwriting([Path(opts.model)], writes)
    provider, note = runtime.resolve_provider(opts.provider)
    if note:
        console.print(f"[yellow]{note}[/]")
    if args.cuda_graph and provider != "cuda":
        why = "not --provider cpu" if opts.provider == "cpu" else "and it is not in use here"
        raise UsageError(f"--cuda-graph needs the CUDA provider, {why}")
    loaded, example, raw, *_ = prepare(opts)
    files.refuse_overwriting(external.input_files(loaded.path, loaded.onnx_model), writes)
    batches, seqs, sweep_note = _narrowed(raw, example, batches, seqs, loaded.kind, opts, args)
    if sweep_note:
        console.print(f"[yellow]{sweep_note}[/]", soft_wrap=True)
    if loaded.kind == "onnx":
        raw = Path(opts.model)  # the variants are built from the file itself, not a copy
    options = BenchOptions(
        provider=provider,
        batches=batches,
        seqs=seqs,
        sweep=args.sweep,
        io_binding=args.io_binding if args.io_binding is not None else provider == "cuda",
        cuda_graph=args.cuda_graph,
        target=opts.target,
        only=only,
        floor=not args.no_floor,
        budget_s=opts.budget_s,
        min_runs=args.min_runs,
        with_cpu=provider != "cpu" if args.cpu is None else args.cpu,
    )
    module = None if args.no_eager else loaded.module
    result = bench_model(raw, example, options, module=module)
    result = dataclasses.replace(
        result, model=str(opts.model), provider_note=note, sweep_note=sweep_note
    )
    _write_results(result, args, console)
    return EXIT_OK


def _sweep_arguments(args: argparse.Namespace) -> tuple[list, list, list[str] | None]:
    """The batches, sequence lengths and variants that ``args`` ask for.

    Raises:
        UsageError: a bad ``--batch``, ``--seq``, ``--min-runs`` or ``--variants``.
    """
    batches = _sizes(args.batch, "--batch")
    seqs = _sizes(args.seq, "--seq")
    if args.min_runs < 3:
        raise UsageError(f"--min-runs {args.min_runs}: give at least 3 (a median needs runs)")
    only = args.variants.split(",") if args.variants else None
    if only and (unknown := [v for v in only if v not in variants.VARIANTS]):
        raise UsageError(f"--variants: unknown {unknown}; choose from {list(variants.VARIANTS)}")
    return batches, seqs, only


def _narrowed(
    raw: ir.Model,
    example: dict,
    batches: list,
    seqs: list,
    kind: str,
    opts: Options,
    args: argparse.Namespace,
) -> tuple[list, list, str | None]:
    """The batches and sequence lengths to time, and the line that says why they are fewer
    than asked: an axis the model fixes (:func:`normexport.bench.fixed.fixed_axes`) is timed at
    the model's own size only (None); no line where none is fixed."""
    fixed = fixed_axes(raw, example, batches, seqs)
    if not fixed:
        return batches, seqs, None
    words = {f.word for f in fixed}
    asked = {"--batch": args.batch, "--seq": args.seq}
    dynamic = opts.dynamic.spec if opts.dynamic else None
    line = fixed_line(fixed, str(opts.model), kind, dynamic, asked)
    return (
        [None] if "batch" in words else batches,
        [None] if "sequence" in words else seqs,
        line,
    )


def _options(args: argparse.Namespace, seqs: list[int | None]) -> Options:
    """The shared options ``args`` give (:func:`normexport.arguments.options_from_args`), with
    dynamic batch (and sequence, when the sweep changes it) unless ``--dynamic`` says otherwise
    or the model is ONNX already."""
    opts = options_from_args(args)
    if opts.dynamic is None and detect_kind(opts.model) != "onnx":
        spec = "batch,sequence" if seqs != [None] else "batch"
        opts = dataclasses.replace(opts, dynamic=parse_dynamic(spec))
    return opts


def _write_results(result: BenchResult, args: argparse.Namespace, console: Console) -> None:
    """Print the tables; write ``--json`` and ``--chart`` where asked."""
    render(result, console)
    if args.json:
        report.write_json(result.to_dict(), args.json)
        console.print(f"results: {args.json}")
    if args.chart:
        write_chart(result, args.chart)
        console.print(f"chart: {args.chart}")
