"""Command line: ``normexport MODEL [options]`` (also ``python -m normexport``).

Exit codes: 0 all went well; 1 parity failed (the optimized model is still written and the
report says where outputs diverge); 2 a usage or input error (one line, no traceback; add
``--debug`` for it); 3 an internal error (a bug: please report it with the ``--debug`` output).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from normexport.errors import UsageError
from normexport.parity import DEFAULT_ATOL, DEFAULT_RTOL


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for the main command."""
    p = argparse.ArgumentParser(
        prog="normexport",
        description="Export a PyTorch model (or optimize an ONNX one): fold BatchNorm, fuse "
        "LayerNorm / RMSNorm, prove parity, time it on ONNX Runtime.",
    )
    p.add_argument(
        "model",
        type=Path,
        help="torch.save'd nn.Module (needs --trust-pickle) or state_dict (needs "
        "--model-class), TorchScript archive, torch.export .pt2, or .onnx",
    )
    p.add_argument("-o", "--output", type=Path, help="optimized model (default: MODEL.opt.onnx)")
    p.add_argument("--report", type=Path, help="write the report as JSON here (+ a .png chart)")
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="SHAPE",
        help="one per input, in forward() order: 1,3,224,224 or input_ids=2x16:int64",
    )
    p.add_argument("--inputs", type=Path, help=".npz of example inputs by name (real data)")
    p.add_argument(
        "--dynamic", metavar="AXES", help="dynamic axes: batch, batch,sequence or NAME:0,1"
    )
    p.add_argument("--opset", type=int, help="ai.onnx opset to export at (PyTorch models)")
    p.add_argument(
        "--target",
        choices=["ort", "onnx"],
        default="ort",
        help="ort: ONNX Runtime ops allowed (default); onnx: standard ops only",
    )
    p.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--no-benchmark", action="store_true", help="skip the latency comparison")
    p.add_argument(
        "--budget", type=float, default=10.0, metavar="SECONDS", help="time spent on timing"
    )
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="parity absolute tolerance")
    p.add_argument(
        "--rtol",
        type=float,
        default=DEFAULT_RTOL,
        help="parity relative tolerance (times the output's max magnitude)",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow loading a pickled nn.Module (this runs code from the file)",
    )
    p.add_argument("--model-class", metavar="PKG.MODULE:CLASS", help="class for a state_dict")
    p.add_argument("--model-kwargs", metavar="JSON", help="constructor arguments, JSON object")
    p.add_argument(
        "--exporter", choices=["auto", "dynamo", "torchscript"], default="auto", help="see README"
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    console = Console(stderr=False, highlight=False)
    try:
        from normexport import pipeline, report

        opts = pipeline.Options(
            model=args.model,
            output=args.output,
            input_shape=args.input_shape,
            inputs=args.inputs,
            dynamic=args.dynamic,
            opset=args.opset,
            target=args.target,
            provider=args.provider,
            benchmark=not args.no_benchmark,
            atol=args.atol,
            rtol=args.rtol,
            trust_pickle=args.trust_pickle,
            model_class=args.model_class,
            model_kwargs=args.model_kwargs,
            exporter=args.exporter,
            budget_s=args.budget,
        )
        result = pipeline.run(opts)
        report.render(result, console)
        if args.report:
            report.write_json(result, args.report)
            if report.write_chart(result, args.report.with_suffix(".png")):
                console.print(f"report: {args.report} and {args.report.with_suffix('.png')}")
            else:
                console.print(f"report: {args.report}")
    except UsageError as err:
        if args.debug:
            raise
        print(f"normexport: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if args.debug:
            raise
        print(
            f"normexport: internal error: {type(err).__name__}: {err}\n"
            "This is a bug in normexport; re-run with --debug and report the traceback.",
            file=sys.stderr,
        )
        return 3
    return 0 if result["parity"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
