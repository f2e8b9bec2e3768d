"""Argument groups that several commands share (the main command, ``explain``, ``bench``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL and the flags that say how to load and export it (main command and explain)."""
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
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow unpickling code from the file: a pickled nn.Module, or pickled weights or "
        "constants inside a .pt2 (this runs code from the file)",
    )
    p.add_argument("--model-class", metavar="PKG.MODULE:CLASS", help="class for a state_dict")
    p.add_argument("--model-kwargs", metavar="JSON", help="constructor arguments, JSON object")
    p.add_argument(
        "--exporter", choices=["auto", "dynamo", "torchscript"], default="auto", help="see README"
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
