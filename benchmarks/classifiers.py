"""Classifiers that read one token of their last hidden state, published by normexport, timed
against the raw export and the other tools, with each file's multiply-add work (issue 52).

A classifier that reads the class token (a ViT's head, BERT's pooler, open_clip's ``tok``
pooling, RN50's attention pooling) needs one row of its last block; normexport's PruneRows
(``fusion.prune_rows``) makes the published model compute only that row. The models, built from
their libraries' classes with random weights (:func:`families.randomize`), batch 1:

- transformers: ``ViTForImageClassification`` (hidden 192, 6 layers, 3 heads, 224x224 in
  patches of 16: 197 tokens) and ``BertForSequenceClassification`` (hidden 256, 6 layers, 4
  heads, 128 tokens with the last quarter padded);
- timm: ``vit_tiny_patch16_224`` and ``deit_tiny_patch16_224`` (12 layers, hidden 192, 3
  heads, 10 classes);
- open_clip: the ViT and RN50 towers of ``benchmarks/families.py``.

Each is exported with ``torch.onnx.export``'s defaults and timed as ``families.py`` times a
library's model (:func:`families.bench_family`: ``ort_raw``, ``ort_transformers``,
``onnxscript_ort``, ``normexport``, the A/A control ``normexport_again``; ORT_ENABLE_ALL, 2
intra-op threads on the CPU provider, spinning off, ``--copies`` sessions of each opened ABBA,
timed interleaved in a random order per round, ratios with 95% bootstrap intervals; above 1:
normexport is faster). Beside the time, each file's work (:func:`work`): the multiply-adds of
its MatMul, Gemm and attention nodes (:func:`families.work`), and its ratio to the raw
export's.

    python benchmarks/classifiers.py [--models vit_classifier,timm_vit] [--budget 20]
                                     [--copies 2] [--normexport-budget 10] [--out DIR]

Writes ``classifiers_<provider>.json`` and ``.png`` to ``--out`` (default
``benchmarks/results``) and prints the table.
"""

from __future__ import annotations

import argparse
import sys

import families
import outside
import torch
from rich.console import Console


class _Logits(torch.nn.Module):
    """A transformers classifier's logits for inputs given by position."""

    def __init__(self, model: torch.nn.Module, *names: str):
        super().__init__()
        self.model, self.names = model.eval(), names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, inputs, strict=True))).logits


def _transformers(kind: str, **config):
    import transformers

    if kind == "vit":
        model = transformers.ViTForImageClassification(transformers.ViTConfig(**config))
        return _Logits(model, "pixel_values"), (torch.randn(1, 3, 224, 224),)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**config))
    mask = torch.ones(1, 128, dtype=torch.int64)
    mask[0, -32:] = 0
    return _Logits(model, "input_ids", "attention_mask"), (torch.randint(0, 1000, (1, 128)), mask)


def _timm(name: str, **config):
    import timm

    return timm.create_model(name, pretrained=False, **config), (torch.randn(1, 3, 224, 224),)


_VIT = {"hidden_size": 192, "num_hidden_layers": 6, "num_attention_heads": 3}
_BERT = {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4}

#: The models, by name (``--models``).
CLASSIFIERS = {
    "vit_classifier": families.Family(
        "transformers", _transformers,
        {"kind": "vit", **_VIT, "intermediate_size": 768, "num_labels": 10}, "vit", 3, 192,
    ),
    "bert_classifier": families.Family(
        "transformers", _transformers,
        {"kind": "bert", **_BERT, "intermediate_size": 1024, "num_labels": 3}, "bert", 4, 256,
    ),
    "timm_vit": families.Family(
        "timm", _timm, {"name": "vit_tiny_patch16_224", "num_classes": 10}, "vit", 3, 192
    ),
    "timm_deit": families.Family(
        "timm", _timm, {"name": "deit_tiny_patch16_224", "num_classes": 10}, "vit", 3, 192
    ),
    "openclip_vit": families.FAMILIES["openclip_vit"],
    "openclip_rn50": families.FAMILIES["openclip_rn50"],
}  # fmt: skip


def bench(name: str, args: argparse.Namespace) -> dict:
    """:func:`families.bench_family` for the model ``name``, with each file's work over the raw
    export's."""
    entry = families.bench_family(CLASSIFIERS[name], args)
    works = {k: v.get("work_multiply_adds") for k, v in entry.get("variants", {}).items()}
    if works.get("ort_raw"):
        entry["work_ratio_to_raw"] = {k: w / works["ort_raw"] for k, w in works.items() if w}
    return entry


#: The table's last columns: the work of normexport's file over the raw export's, and the
#: selections PruneRows moved.
COLUMNS = {
    "work ne / raw": lambda e: f"{e.get('work_ratio_to_raw', {}).get('normexport', 0):.3f}",
    "rows_pruned": lambda e: str(
        e["variants"]["normexport"].get("details", {}).get("rows_pruned", 0)
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write the JSON and the chart; print the table."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/classifiers.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--models", default=",".join(CLASSIFIERS), help="comma-separated names")
    families.add_timing_arguments(p)
    args = p.parse_args(argv)
    names = families.chosen(p, args.models, CLASSIFIERS)
    console = Console(highlight=False, width=200)
    results = families.header(args, console)
    if results is None:
        return 2
    outside.use()
    torch.set_num_threads(families.THREADS)
    families.run_models(names, lambda name: bench(name, args), results, console)
    stem = args.out / f"classifiers_{args.provider}"
    families.save(results, stem, f"Class-token classifiers, {args.provider}: above 1, faster")
    families.print_table(results, console, COLUMNS)
    console.print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
