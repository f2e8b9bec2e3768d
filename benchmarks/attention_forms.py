"""Which exact form of scaled dot-product attention runs fastest on one ONNX Runtime provider:
the decomposed form a PyTorch export writes, ONNX's ``Attention`` (what
:mod:`fusion.fuse_sdpa` emits) and ONNX Runtime's ``MultiHeadAttention``.

Each model is a stack of :data:`LAYERS` attention layers over a float32 input ``x`` of shape
(B, S, D), D = N * H, random weights (normal, standard deviation 1 / sqrt(D)), built with
``onnx.helper`` at opset 23. A layer: three MatMul projections of its input (B, S, D) (the key
and value ones of ``context`` (B, L, D) in a cross-attention case), each Reshape to
(B, S, N, H) and Transpose to (B, N, S, H); the attention core; Transpose back and Reshape to
(B, S, D), the next layer's input. The core, in three exact forms (scale 1 / sqrt(H)):

- ``decomposed``: torch's decomposition of ``scaled_dot_product_attention`` as the dynamo
  exporter writes it at its default opset (18): ``Q * sqrt(scale)`` and
  ``Transpose(K, [0, 1, 3, 2]) * sqrt(scale)``, MatMul, ``Softmax(axis=-1)``, MatMul with V;
- ``onnx_attention``: ``Attention`` (ai.onnx, opset 23; onnx.ai/onnx/operators/onnx__Attention)
  on the 4-D Q, K, V with ``scale`` set;
- ``ms_mha``: ``MultiHeadAttention`` (com.microsoft; onnxruntime docs/ContribOperators.md) with
  the 3-D query (B, S, N * H), the projection's output before its Reshape, and the 4-D key and
  value (B, N, L, H); its output is (B, S, N * H), so no Transpose and Reshape follow it.

The cases (:data:`CASES`, (B, N, S, L, H)) are the attention of ViT-B, a small CLIP ViT, a
UNet at a 32x32 latent (self- and cross-attention, ``unet_cross`` over 77 tokens), whisper-tiny's
encoder, SAM's image encoder (windowed and global), BERT, and the one-head attention of a VAE's
mid block (``AutoencoderKL`` at the size of ``benchmarks/families.py``), beside the same width in
two heads (``vae_mid_two_heads``: ONNX Runtime's CPU ``Attention`` runs one thread per batch and
head, :mod:`fusion.fuse_sdpa`); ``bert_bias`` is BERT's with a
score bias: each core adds a (1, N, S, L) input ``bias`` to the scores before the Softmax (an
Add in ``decomposed``, ``attn_mask`` of ``Attention``, ``attention_bias`` of
``MultiHeadAttention``).

Before any timing, each form's output on the timed inputs is compared with ``decomposed``'s
(``max_abs_diff``, beside the largest |output|; ``agree``: within :data:`AGREE` of it). Each
form, and the A/A control ``decomposed_again`` (other sessions of the decomposed model), is
``--copies`` ONNX Runtime sessions (ORT_ENABLE_ALL; on the CPU provider 2 intra-op threads,
spinning off; IO binding) opened in ABBA order and timed in turn, every round in a random order
(:func:`normexport.latency.measure.counterbalanced`, ``rotating``, ``time_interleaved``). The
ratios ``decomposed / form`` are per-round paired, with 95% bootstrap intervals
(:func:`~normexport.latency.measure.paired_ratio`; above 1: the form is faster); the control's
ratio is what two session sets of one model differ by, and a difference no larger is no
difference. Each form also records the ops ONNX Runtime ran (after its session optimizations).

    python benchmarks/attention_forms.py [--only vit_b,bert] [--provider cpu|cuda]
                                         [--budget 35] [--copies 2] [--out DIR]

Writes ``attention_forms_<provider>.json`` and ``.png`` to ``--out`` (default
``benchmarks/results``) and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import math
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from forms import ort_ran
from onnx import helper, numpy_helper
from rich.console import Console
from rich.table import Table

from normexport import report, runtime
from normexport.bench.render import fmt_ratio
from normexport.bench.results import Machine
from normexport.errors import UsageError
from normexport.io.files import save_figure
from normexport.latency.measure import (
    counterbalanced,
    paired_ratio,
    rotating,
    runner,
    time_interleaved,
)

#: ONNX Runtime's intra-op threads on the CPU provider.
THREADS = 2
#: Attention layers in each model.
LAYERS = 4
OPSET = 23
#: The forms of the core (see the module docstring); the first is the one the others are
#: compared with.
FORMS = {
    "decomposed": "Mul(Q, sqrt(scale)), Mul(Transpose(K), sqrt(scale)), MatMul, Softmax, MatMul "
    "(torch's dynamo export of scaled_dot_product_attention)",
    "onnx_attention": "Attention (opset 23) on 4-D Q, K, V, scale set (fusion.fuse_sdpa's form)",
    "ms_mha": "com.microsoft MultiHeadAttention, 3-D query, 4-D key and value, 3-D output",
}
#: The A/A control: other sessions of the decomposed model.
CONTROL = "decomposed_again"
#: Timed rounds at most: the small cases' rounds take milliseconds, and more of them narrow
#: their intervals.
MAX_ROUNDS = 2000
#: What ``decomposed`` is compared with: the other forms and the control.
COMPARED = (*list(FORMS)[1:], CONTROL)
#: Forms agree where their outputs differ from ``decomposed``'s by at most this times
#: max(1, the largest |output|) (float32 sums in another order; TF32 on CUDA).
AGREE = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention shape.

    Attributes:
        batch, heads, seq, kv_seq, head_size: B, N, S (query length), L (key length), H.
        cross: key and value are projected from a second input ``context`` (B, L, D), not
            from the layer's input (then L may differ from S).
        bias: the scores get a (1, N, S, L) float32 input ``bias`` added before the Softmax.
    """

    batch: int
    heads: int
    seq: int
    kv_seq: int
    head_size: int
    cross: bool = False
    bias: bool = False

    @property
    def hidden(self) -> int:
        """D = N * H."""
        return self.heads * self.head_size


#: The attention of the models normexport's users run, (B, N, S, L, H).
CASES = {
    "vit_b": Case(1, 12, 197, 197, 64),
    "clip_vit_small": Case(1, 4, 37, 37, 64),
    "unet_self": Case(2, 8, 1024, 1024, 40),
    "unet_cross": Case(2, 8, 1024, 77, 40, cross=True),
    "whisper_tiny_encoder": Case(1, 6, 1500, 1500, 64),
    "sam_windowed": Case(25, 4, 196, 196, 64),
    "sam_global": Case(1, 4, 1024, 1024, 64),
    "bert": Case(1, 4, 128, 128, 64),
    "bert_bias": Case(1, 4, 128, 128, 64, bias=True),
    "vae_mid": Case(1, 1, 1024, 1024, 64),
    "vae_mid_two_heads": Case(1, 2, 1024, 1024, 32),
}


class _Builder:
    """Nodes and initializers of one model, named after their outputs."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, array) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def add(self, op: str, inputs: list[str], out: str, domain: str = "", **attributes) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], out, domain=domain, **attributes))
        return out


def _core(g: _Builder, form: str, case: Case, q3: str, q: str, k: str, v: str, i: int) -> str:
    """Layer ``i``'s attention core in ``form`` on the heads ``q``, ``k``, ``v`` (B, N, S|L, H)
    (``q3``: the query (B, S, D) before its Reshape); its output (B, S, D)."""
    scale = 1.0 / math.sqrt(case.head_size)
    mask = ["bias"] if case.bias else []
    if form == "ms_mha":
        inputs = [q3, k, v, "", "", *mask]  # no bias, no key_padding_mask
        mha = functools.partial(g.add, domain="com.microsoft", num_heads=case.heads)
        return mha("MultiHeadAttention", inputs, f"mha{i}", scale=scale)
    if form == "onnx_attention":
        heads = g.add("Attention", [q, k, v, *mask], f"attention{i}", scale=scale)
    else:
        qs = g.add("Mul", [q, "sqrt_scale"], f"q_scaled{i}")
        kt = g.add("Transpose", [k], f"k_t{i}", perm=[0, 1, 3, 2])
        ks = g.add("Mul", [kt, "sqrt_scale"], f"k_t_scaled{i}")
        scores = g.add("MatMul", [qs, ks], f"scores{i}")
        if case.bias:
            scores = g.add("Add", [scores, "bias"], f"biased{i}")
        weights = g.add("Softmax", [scores], f"weights{i}", axis=-1)
        heads = g.add("MatMul", [weights, v], f"heads{i}")
    merged = g.add("Transpose", [heads], f"merged{i}", perm=[0, 2, 1, 3])
    return g.add("Reshape", [merged, "model_shape"], f"out{i}")


def build(case: Case, form: str, layers: int = LAYERS, seed: int = 0) -> bytes:
    """The stack of ``layers`` attention layers with its core in ``form`` (one of
    :data:`FORMS`; see the module docstring), serialized; the same weights for every form.

    Inputs ``x`` (B, S, D), ``context`` (B, L, D) where ``case.cross``, ``bias`` (1, N, S, L)
    where ``case.bias``; output ``y`` (B, S, D); all float32.
    """
    b, n, s, kv, h, d = (*dataclasses.astuple(case)[:5], case.hidden)
    rng = np.random.default_rng(seed)
    g = _Builder()
    g.const("q_heads", np.array([b, s, n, h], np.int64))
    g.const("kv_heads", np.array([b, kv, n, h], np.int64))
    g.const("model_shape", np.array([b, s, d], np.int64))
    g.const("sqrt_scale", np.float32(math.sqrt(1.0 / math.sqrt(h))))
    hidden = "x"
    for i in range(layers):
        source = "context" if case.cross else hidden
        projected, heads = {}, {}
        for p, read, shape in (
            ("q", hidden, "q_heads"),
            ("k", source, "kv_heads"),
            ("v", source, "kv_heads"),
        ):
            weight = (rng.standard_normal((d, d)) / math.sqrt(d)).astype(np.float32)
            projected[p] = g.add("MatMul", [read, g.const(f"w{p}{i}", weight)], f"{p}{i}")
            split = g.add("Reshape", [projected[p], shape], f"{p}_split{i}")
            heads[p] = g.add("Transpose", [split], f"{p}_heads{i}", perm=[0, 2, 1, 3])
        hidden = _core(g, form, case, projected["q"], heads["q"], heads["k"], heads["v"], i)
    g.nodes[-1].output[0] = "y"
    float_input = functools.partial(helper.make_tensor_value_info, elem_type=onnx.TensorProto.FLOAT)
    inputs = [float_input("x", shape=[b, s, d])]
    if case.cross:
        inputs.append(float_input("context", shape=[b, kv, d]))
    if case.bias:
        inputs.append(float_input("bias", shape=[1, n, s, kv]))
    graph = helper.make_graph(
        g.nodes, "attention_stack", inputs, [float_input("y", shape=[b, s, d])], g.initializers
    )
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=11)
    return model.SerializeToString()


def feeds(case: Case, seed: int = 1) -> dict[str, np.ndarray]:
    """Standard normal float32 inputs of :func:`build`'s model for ``case``."""
    rng = np.random.default_rng(seed)
    b, n, s, kv, d = case.batch, case.heads, case.seq, case.kv_seq, case.hidden
    shapes = {"x": (b, s, d)}
    if case.cross:
        shapes["context"] = (b, kv, d)
    if case.bias:
        shapes["bias"] = (1, n, s, kv)
    return {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}


def measure(case: Case, provider: str, budget_s: float, copies: int) -> dict:
    """Check the forms of ``case`` agree, then time them and the control interleaved,
    ``copies`` sessions of each (ABBA); their timings, ``decomposed / form`` ratios, output
    differences and the ops ONNX Runtime ran."""
    models = {form: build(case, form) for form in FORMS}
    models[CONTROL] = models["decomposed"]
    inputs = feeds(case)
    opens = {
        name: functools.partial(
            runtime.make_session, model, provider, spinning=False, threads=THREADS
        )
        for name, model in models.items()
    }
    runners, outputs = {}, {}
    for name, sessions in counterbalanced(opens, copies).items():
        calls = [runner(s, inputs, io_binding=True) for s in sessions]
        runners[name] = rotating([call for call, _ in calls])
        outputs[name] = calls[0][1]()[0]
    want = outputs["decomposed"]
    largest = float(np.abs(want).max())
    diffs = {f: float(np.abs(outputs[f] - want).max()) for f in COMPARED if f != CONTROL}
    timings = time_interleaved(runners, budget_s=budget_s, min_runs=10, max_runs=MAX_ROUNDS)
    base = timings["decomposed"]
    return {
        "case": dataclasses.asdict(case),
        "max_abs_diff_vs_decomposed": diffs,
        "max_abs_output": largest,
        "agree": all(d <= AGREE * max(1.0, largest) for d in diffs.values()),
        "timings_ms": {k: t.to_dict() for k, t in timings.items()},
        "ratio_decomposed_over": {
            k: paired_ratio(base, t).to_dict() for k, t in timings.items() if k != "decomposed"
        },
        "ort_ran": {f: dict(collections.Counter(ort_ran(models[f], provider))) for f in FORMS},
    }


def print_table(results: dict, console: Console) -> None:
    """Per case: decomposed's median, each form's and the control's ``decomposed / form``,
    the largest output difference."""
    table = Table(title="decomposed / form (95% interval); > 1: the form is faster")
    for column in ("case", "B, N, S, L, H", "decomposed ms", *COMPARED, "max diff"):
        table.add_column(column)
    for name, entry in results["cases"].items():
        c, ratios = entry["case"], entry["ratio_decomposed_over"]
        diff = max(entry["max_abs_diff_vs_decomposed"].values())
        table.add_row(
            name,
            ", ".join(str(c[k]) for k in ("batch", "heads", "seq", "kv_seq", "head_size")),
            f"{entry['timings_ms']['decomposed']['median_ms']:.2f}",
            *[fmt_ratio(ratios[k]) for k in COMPARED],
            f"{diff:.1e}" + ("" if entry["agree"] else " DISAGREE"),
        )
    console.print(table)


def chart(results: dict, path: Path) -> None:
    """``decomposed / form`` per case (median, 95% interval; above 1: the form is faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases)), 4.5))
    width = 0.8 / len(COMPARED)
    for i, name in enumerate(COMPARED):
        r = [entry["ratio_decomposed_over"][name] for entry in cases.values()]
        med = np.array([x["median"] for x in r])
        err = [med - [x["ci_low"] for x in r], [x["ci_high"] for x in r] - med]
        ax.bar(np.arange(len(cases)) + i * width, med, width, yerr=err, capsize=2, label=name)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, list(cases), rotation=30, ha="right")
    ax.set_ylabel("decomposed / form (median, 95% CI)")
    ax.set_title(
        f"{LAYERS} attention layers, {results['machine']['provider']}: above 1, the form is faster"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen cases; write the JSON and the chart; print the table."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/attention_forms.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--only", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--budget", type=float, default=35.0, help="timing seconds per case")
    p.add_argument(
        "--copies", type=int, default=2, help="sessions of each form, opened ABBA, timed in turn"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    chosen = [n for n in args.only.split(",") if n]
    unknown = [n for n in chosen if n not in CASES]
    if unknown:
        p.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    console = Console(highlight=False, width=200)
    try:
        runtime.resolve_provider(args.provider)
    except UsageError as err:
        console.print(f"error: {err}")
        return 2
    results = {
        "machine": Machine.probe(args.provider).to_dict(),
        "threads": THREADS if args.provider == "cpu" else None,
        "spinning": False,
        "io_binding": True,
        "layers": LAYERS,
        "forms": FORMS | {CONTROL: "other sessions of the decomposed model: the A/A control"},
        "copies": args.copies,
        "budget_s": args.budget,
        "cases": {},
    }
    for name in chosen:
        start = time.perf_counter()
        entry = measure(CASES[name], args.provider, args.budget, args.copies)
        results["cases"][name] = entry | {"wall_s": time.perf_counter() - start}
        console.print(f"{name}: done ({time.perf_counter() - start:.0f} s)")
    stem = args.out / f"attention_forms_{args.provider}"
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(results, stem.with_suffix(".json"))
    chart(results, stem.with_suffix(".png"))
    print_table(results, console)
    console.print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
