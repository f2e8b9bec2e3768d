"""Command line: ``normexport MODEL [options]`` (also ``python -m normexport``), the main job,
and its subcommands (:data:`SUBCOMMANDS`): ``normexport explain MODEL [options]`` lists every
normalization-like subgraph, what it became, and why each one left alone was left alone;
``normexport bench MODEL [options]`` compares the latency of the optimizers' variants of one
model (:mod:`normexport.bench`).

A first word that names a subcommand picks that subcommand's parser; anything else is the main
command's (a model file named like a subcommand: ``normexport ./bench``). ``normexport --help``
lists the subcommands, ``normexport COMMAND --help`` gives each one's flags.

Exit codes (:mod:`normexport.errors` names them, ``docs/errors.md`` tells them): ``EXIT_OK``
all went well; ``EXIT_PARITY_FAILED`` parity failed (the optimized model is still written and
the report says where outputs diverge); ``EXIT_USAGE`` a usage, input-file, output-path or
environment error (one line, no traceback; add ``--debug`` for it); 128 + the signal's number
when stopped by SIGINT / SIGTERM (temporary files removed); ``EXIT_BUG`` an internal error (a
bug: please report it with the ``--debug`` output).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from rich.console import Console

from normexport import errors
from normexport.arguments import add_flags, add_model_arguments, options_from_args, preflight
from normexport.io.quiet import logs_for_debug

#: The subcommands, each with the line ``normexport --help`` gives it.
SUBCOMMANDS = {
    "explain": "each norm-like subgraph, what it became, and why",
    "bench": "the optimizers' variants timed over batch sizes",
}

Command = Callable[[argparse.Namespace, Console], int]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for the main command; its help lists the subcommands."""
    width = max(len(name) for name in SUBCOMMANDS) + len(" MODEL")
    listing = "\n".join(
        f"  normexport {f'{name} MODEL':<{width}}  {line}" for name, line in SUBCOMMANDS.items()
    )
    p = argparse.ArgumentParser(
        prog="normexport",
        usage=f"%(prog)s [{' | '.join(SUBCOMMANDS)}] MODEL [options]",
        description="Export a PyTorch model (or optimize an ONNX one): fold BatchNorm, fuse\n"
        "LayerNorm / RMSNorm, prove parity, time it on ONNX Runtime.",
        epilog=f"subcommands (normexport COMMAND --help for their options):\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(p)
    add_flags(p, "output")
    add_flags(p, "make_dirs")
    p.add_argument(
        "--explain", action="store_true", help="also list every candidate and what became of it"
    )
    for group in ("precision", "provider", "threads", "timing", "check"):
        add_flags(p, group)
    return p


def build_explain_parser() -> argparse.ArgumentParser:
    """The argument parser for ``normexport explain``."""
    p = argparse.ArgumentParser(
        prog="normexport explain",
        description="List every normalization-like subgraph of MODEL, what it became, and why "
        "each one left alone was left alone. Writes nothing.",
    )
    add_model_arguments(p)
    add_flags(p, "provider")
    add_flags(p, "threads")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command that ``argv`` (default: ``sys.argv[1:]``) names; returns the exit code
    (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = argv[0] if argv[:1] and argv[0] in SUBCOMMANDS else None
    parser, command = _subcommand(name)
    return _guarded(command, parser.parse_args(argv if name is None else argv[1:]))


def _subcommand(name: str | None) -> tuple[argparse.ArgumentParser, Command]:
    """The parser and the function of subcommand ``name`` (None: the main command)."""
    if name == "explain":
        return build_explain_parser(), _explain
    if name == "bench":
        from normexport.bench import command  # PyTorch and ONNX Runtime: imported on use

        return command.build_parser(), command.run
    return build_parser(), _main


def _main(args: argparse.Namespace, console: Console) -> int:
    opts = options_from_args(args)
    # before PyTorch and the pipeline are imported: a mistake answers at once
    for warning in preflight(opts):
        print(f"normexport: warning: {warning}", file=sys.stderr)

    from normexport import pipeline, progress, report
    from normexport.report import explain
    from normexport.runtime.memory import imports_spared

    # the stages as they run: live on a terminal, else a line as each starts and ends
    with progress.shown(Console(stderr=True), log=console), imports_spared():
        result = pipeline.run(opts)
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
            console.print(f"report: {args.report} (no chart: nothing was timed)")
    return errors.EXIT_OK if result.passed else errors.EXIT_PARITY_FAILED


def _explain(args: argparse.Namespace, console: Console) -> int:
    opts = options_from_args(args)
    for warning in preflight(opts, writes=False):  # before PyTorch and the pipeline
        print(f"normexport: warning: {warning}", file=sys.stderr)

    from normexport import pipeline, runtime
    from normexport.pipeline.job import run_policy, run_threads
    from normexport.report import explain

    provider, _ = runtime.resolve_provider(opts.provider)  # as the run resolves it
    prepared = pipeline.prepare(opts)
    source = "as exported" if prepared.export.exporter != "none" else "as given"
    policy = run_policy(opts, prepared.raw, provider, run_threads(opts))
    findings = explain.explain(prepared.raw, policy)
    explain.render(findings, f"Normalization in {args.model} ({source})", console)
    return errors.EXIT_OK


def _guarded(command, args: argparse.Namespace) -> int:
    """Run ``command(args, console)``, turning errors into one line and an exit code
    (:func:`normexport.errors.exit_status`); SIGINT and SIGTERM stop it through its
    ``finally`` blocks, so that no temporary file is left."""
    console = Console(highlight=False, width=_width())
    with errors.on_signals(), logs_for_debug(args.debug):
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


#: The output's width where it is no terminal (a pipe, a log) and ``COLUMNS`` does not say:
#: wide enough for every column of the report's tables (rich's 80 cut numbers short).
LOG_WIDTH = 200


def _width() -> int | None:
    """The output console's width: the terminal's, ``COLUMNS``, else :data:`LOG_WIDTH`."""
    return None if sys.stdout.isatty() or "COLUMNS" in os.environ else LOG_WIDTH


if __name__ == "__main__":
    sys.exit(main())
