"""Command line: ``normexport MODEL [options]`` (also ``python -m normexport``).

Subcommands: ``normexport explain MODEL [options]`` lists every normalization-like subgraph,
what it became, and why each one left alone was left alone; ``normexport bench MODEL
[options]`` compares the latency of the optimizers' variants of one model.

Exit codes: 0 all went well; 1 parity failed (the optimized model is still written and the
report says where outputs diverge); 2 a usage, input-file, output-path or environment error
(one line, no traceback; add ``--debug`` for it); 130 / 143 stopped by SIGINT / SIGTERM
(temporary files removed); 3 an internal error (a bug: please report it with the ``--debug``
output). The kinds and the mapping are in :mod:`normexport.errors`.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from normexport import errors
from normexport.arguments import (
    add_check_arguments,
    add_model_arguments,
    add_output_arguments,
    options_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for the main command."""
    p = argparse.ArgumentParser(
        prog="normexport",
        description="Export a PyTorch model (or optimize an ONNX one): fold BatchNorm, fuse "
        "LayerNorm / RMSNorm, prove parity, time it on ONNX Runtime. "
        "See also: normexport explain MODEL.",
    )
    add_model_arguments(p)
    add_output_arguments(p)
    add_check_arguments(p)
    return p


def build_explain_parser() -> argparse.ArgumentParser:
    """The argument parser for ``normexport explain``."""
    p = argparse.ArgumentParser(
        prog="normexport explain",
        description="List every normalization-like subgraph of MODEL, what it became, and why "
        "each one left alone was left alone. Writes nothing.",
    )
    add_model_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["explain"]:
        args = build_explain_parser().parse_args(argv[1:])
        return _guarded(_explain, args)
    if argv[:1] == ["bench"]:
        from normexport import bench

        args = bench.build_parser().parse_args(argv[1:])
        return _guarded(bench.run, args)
    args = build_parser().parse_args(argv)
    return _guarded(_main, args)


def _main(args: argparse.Namespace, console: Console) -> int:
    from normexport import pipeline, report
    from normexport.report import explain

    result = pipeline.run(options_from_args(args))
    report.render(result, console)
    if args.explain:
        fusions = result.fusions
        findings = explain.from_report(fusions.fused, fusions.refused, fusions.already_fused)
        explain.render(findings, f"What became of each norm in {args.model}", console)
    if args.report:
        report.write_json(result, args.report)
        if report.write_chart(result, args.report.with_suffix(".png")):
            console.print(f"report: {args.report} and {args.report.with_suffix('.png')}")
        else:
            console.print(f"report: {args.report}")
    return 0 if result.passed else 1


def _explain(args: argparse.Namespace, console: Console) -> int:
    from normexport import pipeline
    from normexport.report import explain

    prepared = pipeline.prepare(options_from_args(args))
    source = "as exported" if prepared.export.exporter != "none" else "as given"
    findings = explain.explain(prepared.raw, target=args.target)
    explain.render(findings, f"Normalization in {args.model} ({source})", console)
    return 0


def _guarded(command, args: argparse.Namespace) -> int:
    """Run ``command(args, console)``, turning errors into one line and an exit code
    (:func:`normexport.errors.exit_status`); SIGINT and SIGTERM stop it through its
    ``finally`` blocks, so that no temporary file is left."""
    console = Console(highlight=False)
    with errors.on_signals():
        try:
            code = command(args, console)
            errors.raise_if_interrupted()  # a signal some library caught: still an interrupt
            return code
        except (Exception, KeyboardInterrupt) as err:
            code, line = errors.exit_status(err)
            if args.debug:
                raise
            print(line, file=sys.stderr)
            return code


if __name__ == "__main__":
    sys.exit(main())
