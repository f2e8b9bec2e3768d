"""Which exact form of GELU runs fastest on one ONNX Runtime provider: the decomposed forms the
exporters write, ONNX Runtime's contrib ops (what :mod:`fusion.fuse_gelu` emits for
``--target ort``) and ONNX's ``Gelu`` (what it emits for ``--target onnx``).

Each model is a stack of :data:`LAYERS` transformer MLP blocks over a float32 input ``x`` of
shape (B, S, D), built with ``onnx.helper`` at opset 20: ``x + MatMul(gelu(MatMul(x, W1) + b1),
W2)``, weights normal with standard deviation 1 / sqrt(fan-in), biases normal. The GELU with
its bias, in the forms of :data:`FORMS`, erf and tanh (Hendrycks & Gimpel 2016):

- ``decomposed_erf`` / ``decomposed_tanh``: the bias Add, then ``Mul(Mul(0.5, x), Add(1,
  Erf(Mul(x, 1/sqrt 2))))`` / the tanh approximation with ``Pow(x, 3)``, as tf2onnx writes them;
- ``ms_bias_gelu`` / ``ms_fast_gelu``: ``com.microsoft.BiasGelu(h, b1)`` / ``FastGelu(h, b1)``;
- ``onnx_gelu`` / ``onnx_gelu_tanh``: the bias Add, then ``Gelu`` (approximate none / tanh).

Each family (erf, tanh) is timed on its own with its decomposed form's A/A control (other
sessions of the same model), ``--copies`` sessions per form (ORT_ENABLE_ALL; 2 intra-op threads
on the CPU provider, spinning off) opened ABBA and timed interleaved, each round in a random
order; ratios ``decomposed / form`` per round with 95% bootstrap intervals (above 1: the form
is faster). Every form's output is compared with the decomposed one's first.

    python benchmarks/gelu_forms.py [--only bert_mlp] [--provider cpu|cuda] [--budget 15]

Writes ``gelu_<provider>.json`` and ``.png`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console
from rich.table import Table

from normexport import report, runtime
from normexport.bench.render import fmt_ratio
from normexport.bench.results import Machine
from normexport.io.files import save_figure
from normexport.latency.measure import (
    counterbalanced,
    paired_ratio,
    rotating,
    runner,
    time_interleaved,
)

THREADS = 2
LAYERS = 4
#: Per family, its forms: the decomposed one first (the baseline), then the fused ones.
FORMS = {
    "erf": ("decomposed_erf", "ms_bias_gelu", "onnx_gelu"),
    "tanh": ("decomposed_tanh", "ms_fast_gelu", "onnx_gelu_tanh"),
}
#: The cases, (B, S, D, F): BERT-base's MLP at 128 tokens, ViT-S/16's at 197, a small one.
CASES = {
    "bert_mlp": (1, 128, 768, 3072),
    "vit_s_mlp": (1, 197, 384, 1536),
    "small": (8, 64, 256, 1024),
}


def _gelu(form: str, h: str, b: str, out: str, i: int, consts: dict) -> list:
    """The nodes of ``form`` computing GELU(h + b) into ``out`` (layer ``i``)."""
    if form == "ms_bias_gelu":
        return [helper.make_node("BiasGelu", [h, b], [out], domain="com.microsoft")]
    if form == "ms_fast_gelu":
        return [helper.make_node("FastGelu", [h, b], [out], domain="com.microsoft")]
    x = f"x{i}"
    nodes = [helper.make_node("Add", [h, b], [x])]
    if form.startswith("onnx_gelu"):
        approximate = "tanh" if form.endswith("tanh") else "none"
        return [*nodes, helper.make_node("Gelu", [x], [out], approximate=approximate)]
    if form == "decomposed_erf":
        f = [helper.make_node("Mul", [x, "inv_sqrt2"], [f"u{i}"]),
             helper.make_node("Erf", [f"u{i}"], [f"f{i}"])]  # fmt: skip
    else:
        f = [helper.make_node("Pow", [x, "three"], [f"c{i}"]),
             helper.make_node("Mul", ["cubic", f"c{i}"], [f"t{i}"]),
             helper.make_node("Add", [x, f"t{i}"], [f"a{i}"]),
             helper.make_node("Mul", ["sqrt_2_pi", f"a{i}"], [f"u{i}"]),
             helper.make_node("Tanh", [f"u{i}"], [f"f{i}"])]  # fmt: skip
    consts.update(inv_sqrt2=1 / math.sqrt(2), three=3.0, cubic=0.044715, half=0.5, one=1.0)
    consts["sqrt_2_pi"] = math.sqrt(2 / math.pi)
    return [*nodes, *f,
            helper.make_node("Add", ["one", f"f{i}"], [f"g{i}"]),
            helper.make_node("Mul", ["half", x], [f"hx{i}"]),
            helper.make_node("Mul", [f"hx{i}", f"g{i}"], [out])]  # fmt: skip


def build(case: tuple[int, int, int, int], form: str, seed: int = 0) -> bytes:
    """The stack of MLP blocks of ``case`` with the GELU in ``form``, serialized."""
    b, s, d, f = case
    rng = np.random.default_rng(seed)
    nodes, inits, consts, x = [], [], {}, "x"
    for i in range(LAYERS):
        weights = {
            f"w1_{i}": rng.standard_normal((d, f)) / math.sqrt(d),
            f"b1_{i}": rng.standard_normal(f),
            f"w2_{i}": rng.standard_normal((f, d)) / math.sqrt(f),
        }
        inits += [numpy_helper.from_array(a.astype(np.float32), n) for n, a in weights.items()]
        nodes.append(helper.make_node("MatMul", [x, f"w1_{i}"], [f"h{i}"]))
        nodes += _gelu(form, f"h{i}", f"b1_{i}", f"g_out{i}", i, consts)
        nodes.append(helper.make_node("MatMul", [f"g_out{i}", f"w2_{i}"], [f"o{i}"]))
        nodes.append(helper.make_node("Add", [x, f"o{i}"], [f"r{i}"]))
        x = f"r{i}"
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in consts.items()]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, d])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [b, s, d])], inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    return model.SerializeToString()


def measure(case: tuple, family: str, provider: str, budget_s: float, copies: int) -> dict:
    """The forms of ``family`` on ``case``: outputs compared, then timed interleaved with the
    decomposed form's control."""
    forms = FORMS[family]
    models = {form: build(case, form) for form in forms}
    control = f"{forms[0]}_again"
    models[control] = models[forms[0]]
    feeds = {"x": np.random.default_rng(1).standard_normal(case[:3]).astype(np.float32)}
    opens = {
        name: functools.partial(runtime.make_session, m, provider, spinning=False, threads=THREADS)
        for name, m in models.items()
    }
    runners, outputs = {}, {}
    for name, sessions in counterbalanced(opens, copies).items():
        calls = [runner(s, feeds, io_binding=provider == "cuda") for s in sessions]
        runners[name] = rotating([call for call, _ in calls])
        outputs[name] = np.asarray(calls[0][1]()[0])
    want = outputs[forms[0]]
    timings = time_interleaved(runners, budget_s=budget_s, min_runs=10)
    base = timings[forms[0]]
    return {
        "max_abs_diff_vs_decomposed": {
            f: float(np.abs(outputs[f] - want).max()) for f in forms[1:]
        },
        "max_abs_output": float(np.abs(want).max()),
        "timings_ms": {k: t.to_dict() for k, t in timings.items()},
        "ratio_decomposed_over": {
            k: paired_ratio(base, t).to_dict() for k, t in timings.items() if k != forms[0]
        },
    }


def print_and_chart(results: dict, console: Console, path: Path) -> None:
    """The table of ``decomposed / form`` per case and family, and its chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = Table(title="decomposed / form (95% interval); > 1: the form is faster")
    for column in ("case", "family", "decomposed ms", "form: ratio", "max diff"):
        table.add_column(column)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels, x = [], 0
    for name, families in results["cases"].items():
        for family, entry in families.items():
            ratios = entry["ratio_decomposed_over"]
            table.add_row(
                name, family, f"{entry['timings_ms'][FORMS[family][0]]['median_ms']:.2f}",
                "  ".join(f"{k} {fmt_ratio(r)}" for k, r in ratios.items()),
                f"{max(entry['max_abs_diff_vs_decomposed'].values()):.1e}",
            )  # fmt: skip
            for j, (form, r) in enumerate(ratios.items()):
                err = [[r["median"] - r["ci_low"]], [r["ci_high"] - r["median"]]]
                ax.bar(x + 0.25 * j, r["median"], 0.25, yerr=err, capsize=2,
                       color=f"C{j}", label=form)  # fmt: skip
            labels.append((x + 0.25, f"{name}\n{family}"))
            x += 1
    console.print(table)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
    ax.set_ylabel("decomposed / form (median, 95% CI)")
    ax.set_title(f"{LAYERS} MLP blocks, {results['machine']['provider']}: above 1, faster")
    handles, names = ax.get_legend_handles_labels()
    ax.legend(dict(zip(names, handles, strict=True)).values(), dict.fromkeys(names), fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """Measure the chosen cases; write the JSON and the chart; print the table."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/gelu_forms.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--only", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--budget", type=float, default=15.0, help="timing seconds per family")
    p.add_argument("--copies", type=int, default=2, help="sessions of each form, ABBA")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    chosen = [c for c in args.only.split(",") if c]
    if unknown := [c for c in chosen if c not in CASES]:
        p.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    runtime.resolve_provider(args.provider)
    results = {
        "machine": Machine.probe(args.provider).to_dict(),
        "threads": THREADS if args.provider == "cpu" else None,
        "layers": LAYERS,
        "cases": {
            name: {
                f: measure(CASES[name], f, args.provider, args.budget, args.copies) for f in FORMS
            }  # fmt: skip
            for name in chosen
        },
    }
    stem = args.out / f"gelu_{args.provider}"
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(results, stem.with_suffix(".json"))
    print_and_chart(results, Console(highlight=False, width=200), stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
