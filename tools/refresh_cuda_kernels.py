"""Rebuild normexport/runtime/cuda_kernels.json, the CUDA kernel table the CUDA check reads
(normexport.runtime.cuda_kernels, docs/cuda.md), for an ONNX Runtime version.

ONNX Runtime's docs/OperatorKernels.md is generated from its registered kernels
(tools/python/gen_opkernel_doc.py) and kept in its repository; its CUDAExecutionProvider
section is the table. Read it from a release tag (the version installed by default) or from a
local copy, parse it (normexport.runtime.cuda_kernels.parse: a row that does not parse stops
the script, nothing is guessed) and write the JSON with its source.

    python tools/refresh_cuda_kernels.py [--version 1.31.1] [--file OperatorKernels.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

import onnxruntime

from normexport.runtime import cuda_kernels

URL = "https://raw.githubusercontent.com/microsoft/onnxruntime/v{version}/docs/OperatorKernels.md"


def write(kernels: list[dict], source: dict, path: Path) -> None:
    """The table as JSON: its source, then one kernel per line (a refresh diffs by kernel)."""
    lines = ",\n".join("  " + json.dumps(k) for k in kernels)
    text = '{\n"source": ' + json.dumps(source, indent=1) + ',\n"kernels": [\n' + lines + "\n]\n}\n"
    json.loads(text)  # well formed
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--version", default=onnxruntime.__version__, help="ONNX Runtime release")
    p.add_argument("--file", type=Path, help="a local OperatorKernels.md instead of the tag's")
    p.add_argument("--out", type=Path, default=cuda_kernels.TABLE)
    args = p.parse_args(argv)
    if args.file is not None:
        markdown, ref = args.file.read_text(), str(args.file)
    else:
        url = URL.format(version=args.version)
        with urllib.request.urlopen(url, timeout=60) as response:
            markdown, ref = response.read().decode(), f"v{args.version}"
    kernels = cuda_kernels.parse(markdown)
    source = {
        "repository": "microsoft/onnxruntime",
        "path": "docs/OperatorKernels.md",
        "section": "CUDAExecutionProvider",
        "ref": ref,
        "onnxruntime": args.version,
    }
    write(kernels, source, args.out)
    print(f"{args.out}: {len(kernels)} CUDA kernels from {ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
