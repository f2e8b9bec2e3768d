"""ONNX Runtime's own fusion test models (``tests/data/ort/``, MIT, committed with their source
and licence) as the tests read them: the files, and what each test expects of the few that ONNX
Runtime cannot run as given. The one source of those expectations for the API's, the command's
and fusion's tests (``test_peer_files.py``, ``test_peer_cli.py``, ``test_peer_ort.py``).
"""

from __future__ import annotations

from pathlib import Path

#: The folder of the models, their ``expectations.json`` and their README.
ORT = Path(__file__).resolve().parents[1] / "data" / "ort"
#: Every model: the files of ONNX Runtime's tests, then the variants made from them.
FILES = sorted(ORT.glob("*.onnx")) + sorted(ORT.glob("variants/*.onnx"))

#: The files ONNX Runtime cannot run as given, by file name: why normexport refuses them
#: (exit 2: the words of its one line, of its ``UsageError``) and ONNX Runtime's own words.
UNRUNNABLE = {
    # BatchNormalization-7 with 2 outputs, the second one '' (the in-memory edit of ORT's
    # test): not a valid node, ORT refuses to load it.
    "fuse-conv-bn-no-bias.bn_empty_opt_output.onnx": (
        "ONNX Runtime cannot load this model",
        "output size 2 not in allowed output sizes",
    ),
    "fuse-matmul-bn-with-reshape.bn_empty_opt_output.onnx": (
        "ONNX Runtime cannot load this model",
        "output size 2 not in allowed output sizes",
    ),
    # 5 BatchNorm channels over an axis of size 1: ORT stops when it runs the BatchNorm.
    "fuse-matmul-bn-directly-dont-fuse.onnx": (
        "ONNX Runtime cannot run this model as given",
        "Invalid input scale",
    ),
    "fuse-matmul-bn-only-reshape.onnx": (
        "ONNX Runtime cannot run this model as given",
        "Invalid input scale",
    ),
    "fuse-matmul-bn-only-transpose.onnx": (
        "ONNX Runtime cannot run this model as given",
        "Invalid input scale",
    ),
}
