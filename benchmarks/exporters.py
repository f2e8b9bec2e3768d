"""Files from other frameworks' exporters, published by normexport, timed against the
exporter's own file and the other tools (issue 51).

The files are made by ``tools/make_exporter_files.py FRAMEWORK --bench --out DIR``, run in each
framework's own environment (TensorFlow + tf2onnx, JAX + Flax + jax2onnx, Paddle +
paddle2onnx; none is normexport's dependency): a ResNet50, a MobileNetV3Small and a post-norm
encoder from Keras, a ResNet-18, a MobileNetV3-small and a pre-norm encoder from Paddle, a CNN
and a pre-norm encoder from Flax, each with a symbolic batch and ``NAME.inputs.npz`` beside it
(one example, batch 1). Each is timed on ONNX Runtime as ``benchmarks/families.py`` times a
library's model (:func:`families.build`, :func:`families.measure`: ORT_ENABLE_ALL, 2 intra-op
threads on the CPU provider, spinning off, ``--copies`` sessions of each variant opened ABBA and
timed interleaved in a random order per round, ratios with 95% bootstrap intervals):

- ``ort_raw``: the exporter's file as it is;
- ``ort_transformers``: ONNX Runtime's transformer optimizer with the model type it offers for
  the file (:data:`MODELS`: ``bert_tf`` for tf2onnx's encoder, ``bert`` for the others; a CNN
  gets the default, which fuses none of its layers);
- ``onnxscript_ort``: onnxscript's ``optimize_for_ort``;
- ``normexport``: the main job on the file with its example inputs;
- ``normexport_again``: the A/A control, other sessions of normexport's own file.

    python benchmarks/exporters.py --folder DIR [--only keras_encoder,flax_cnn] [--budget 20]
                                   [--copies 2] [--normexport-budget 10] [--provider cpu]

Writes ``exporters_<provider>.json`` and ``.png`` to ``--out`` (default ``benchmarks/results``)
and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import families
import numpy as np
import onnx
from rich.console import Console

#: Per file: its exporter, and ONNX Runtime's transformer optimizer's model type, heads and
#: hidden size for it (0: it reads them from each attention).
MODELS = {
    "keras_resnet50": ("tf2onnx", "bert", 0, 0),
    "keras_mobilenetv3small": ("tf2onnx", "bert", 0, 0),
    "keras_encoder": ("tf2onnx", "bert_tf", 4, 256),
    "paddle_resnet18": ("paddle2onnx", "bert", 0, 0),
    "paddle_mobilenetv3small": ("paddle2onnx", "bert", 0, 0),
    "paddle_encoder": ("paddle2onnx", "bert", 4, 256),
    "flax_cnn": ("jax2onnx", "bert", 0, 0),
    "flax_encoder": ("jax2onnx", "bert", 4, 256),
}


def bench_file(name: str, folder: Path, args: argparse.Namespace) -> dict:
    """Build every variant of the file ``name`` in ``folder`` and time them; its JSON entry
    (``skipped`` where the file is not there)."""
    exporter, ort_type, heads, hidden = MODELS[name]
    source = folder / f"{name}.onnx"
    if not source.is_file():
        return {"exporter": exporter, "skipped": f"{source} not found: make it first"}
    family = families.Family(exporter, None, {}, ort_type, heads, hidden)
    entry = {"exporter": exporter, "ort_model_type": ort_type}
    with tempfile.TemporaryDirectory(prefix="exporters-") as tmp:
        work = Path(tmp)
        raw = work / "raw.onnx"
        shutil.copyfile(source, raw)
        shutil.copyfile(folder / f"{name}.inputs.npz", work / "inputs.npz")
        feeds = dict(np.load(work / "inputs.npz"))
        entry["inputs"] = {k: list(a.shape) for k, a in feeds.items()}
        entry["producer"] = onnx.load(raw, load_external_data=False).producer_name
        built, entry["normexport_report"] = families.build(
            raw, work, family, args.provider, args.normexport_budget
        )
        entry["variants"] = {
            k: v.to_dict() | (families.ops_of(v.model, feeds) if v.model else {})
            for k, v in built.items()
        }
        paths = {k: v.model for k, v in built.items() if v.model is not None}
        if "normexport" not in paths:
            return entry | {"failed": f"normexport: {built['normexport'].error}"}
        paths[families.CONTROL] = paths["normexport"]
        entry |= families.measure(paths, feeds, args.provider, args.budget, args.copies)
    return entry


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write the JSON and the chart; print the table."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/exporters.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--folder", type=Path, required=True, help="the exporters' files")
    p.add_argument("--only", default=",".join(MODELS), help="comma-separated file names")
    families.add_timing_arguments(p)
    args = p.parse_args(argv)
    names = families.chosen(p, args.only, MODELS, "--only")
    console = Console(highlight=False, width=200)
    results = families.header(args, console)
    if results is None:
        return 2
    versions_file = args.folder / "versions.json"
    results["files"] = json.loads(versions_file.read_text()) if versions_file.is_file() else None
    families.run_models(names, lambda name: bench_file(name, args.folder, args), results, console)
    stem = args.out / f"exporters_{args.provider}"
    title = f"Other frameworks' exporters, {args.provider}: above 1, normexport is faster"
    families.save(results, stem, title)
    families.print_table(results, console)
    console.print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
