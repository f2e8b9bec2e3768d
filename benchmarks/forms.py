"""Which exact form of a norm runs fastest on one ORT provider: the measurements behind the
defaults of :mod:`normexport.tuning.autotune`.

For each shape, three groups of one-op (or two-op) models over the same float32 input, timed
interleaved in one process (:func:`normexport.latency.measure.time_interleaved`, IO binding so that
only the op is timed), each group with its elementwise floor:

- ``rmsnorm``: an RMSNorm as RMSNormalization (opset 23) or ORT's SimplifiedLayerNormalization;
  LayerNormalization (a LayerNorm, which does more work) and Relu for scale;
- ``skip_layernorm``: residual add + LayerNorm as SkipLayerNormalization (com.microsoft) or as
  Add + LayerNormalization, the latter under ORT_ENABLE_ALL (which fuses it back into
  SkipLayerNormalization) and with ORT's SkipLayerNormFusion disabled; Add for scale;
- ``skip_rmsnorm``: residual add + RMSNorm as SkipSimplifiedLayerNormalization, Add +
  SimplifiedLayerNormalization, Add + RMSNormalization; Add for scale.

Each form also records the ops ORT really ran (after its session optimizations).

``--set conv`` measures the conv-net norms instead (issue 13), on (N, C, H, W) inputs, each form
against the raw dynamo export of the hand-written module of :mod:`models.norms` (``decomposed``):

- ``instancenorm``: the "CNN LayerNorm" as InstanceNormalization (what FuseInstanceNorm
  emits), or as LayerNormalization(axis=2) + Mul + Add (what FuseLayerNorm alone made of it);
- ``groupnorm`` (32 groups): nn.GroupNorm's exported form Reshape + InstanceNormalization +
  Reshape + Mul + Add (what FuseGroupNorm keeps or makes), the same with LayerNormalization
  inside (what FuseLayerNorm alone makes of a hand-written one), GroupNormalization-21;
- ``channels_first_layernorm``: Transpose + LayerNormalization + Transpose (the rewrite of
  FuseChannelsFirstLayerNorm), and LayerNormalization + Transpose on a channels-last input (one
  Transpose cancelled); at four more shapes, which decide its batch rule.

Every conv form is checked against ``decomposed`` on the timed input (``max_abs_diff``).

    python benchmarks/forms.py [--provider auto] [--budget 6] [--threads N] [--set conv]

Writes ``forms_<provider>.json`` and ``.png`` (``forms_conv_<provider>`` with ``--set conv``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from rich.console import Console
from rich.table import Table

from models.norms import ChannelsFirstLayerNorm, CnnLayerNorm, HandGroupNorm
from normexport import report, runtime
from normexport.bench import variants
from normexport.bench.render import fmt_ratio
from normexport.bench.results import Machine
from normexport.io.export import export_module
from normexport.io.files import save_figure
from normexport.latency.measure import paired_ratio, runner, time_interleaved
from normexport.tuning.autotune import SKIP_FUSION

SHAPES = ((4, 256, 2048), (8, 512, 768), (1, 128, 768), (32, 128, 384))
#: Group -> [(label, op form, ORT transformers disabled)]; the first entry of each group is the
#: one the others are compared with, the last the floor.
GROUPS = {
    "rmsnorm": [
        ("RMSNormalization", "RMSNormalization", ()),
        ("SimplifiedLayerNormalization", "SimplifiedLayerNormalization", ()),
        ("LayerNormalization (a LayerNorm)", "LayerNormalization", ()),
        ("Relu (floor)", "Relu", ()),
    ],
    "skip_layernorm": [
        ("SkipLayerNormalization", "SkipLayerNormalization", ()),
        ("Add+LayerNormalization (ORT_ENABLE_ALL)", "Add+LayerNormalization", ()),
        (
            "Add+LayerNormalization (SkipLayerNormFusion off)",
            "Add+LayerNormalization",
            (SKIP_FUSION,),
        ),
        ("Add (floor)", "Add", ()),
    ],
    "skip_rmsnorm": [
        ("SkipSimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", ()),
        ("Add+SimplifiedLayerNormalization", "Add+SimplifiedLayerNormalization", ()),
        ("Add+RMSNormalization", "Add+RMSNormalization", ()),
        ("Add (floor)", "Add", ()),
    ],
}


def ort_ran(model: bytes, provider: str, disabled: tuple[str, ...] = ()) -> list[str]:
    """The op types of the graph ONNX Runtime really runs for ``model`` on ``provider`` (after
    its ORT_ENABLE_ALL session optimizations, ``disabled`` transformers left out), in order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ran.onnx"
        runtime.make_session(
            model, provider, optimized_model_path=str(path), disabled_optimizers=disabled
        )
        return [n.op_type for n in onnx.load(path).graph.node]


def measure_group(
    group: str, shape: tuple[int, ...], provider: str, budget_s: float, threads: int | None = None
) -> dict:
    """Time one group at one shape; ratios are per-round paired, to the group's first entry."""
    forms = {
        label: (variants.op_model(form, shape), variants.op_inputs(form, shape), disabled)
        for label, form, disabled in GROUPS[group]
    }
    return time_forms(forms, provider, budget_s, threads)


def time_forms(
    forms: dict[str, tuple[bytes, dict[str, np.ndarray], tuple[str, ...]]],
    provider: str,
    budget_s: float,
    threads: int | None = None,
) -> dict:
    """Time ``label -> (model, feeds, ORT transformers disabled)`` interleaved; ratios are
    per-round paired, to the first form; the last form is the floor, left out of ``fastest``."""
    runners, ran = {}, {}
    for label, (model, feeds, disabled) in forms.items():
        session = runtime.make_session(
            model, provider, spinning=False, disabled_optimizers=disabled, threads=threads
        )
        runners[label] = runner(session, feeds, io_binding=True)[0]
        ran[label] = ort_ran(model, provider, disabled)
    timings = time_interleaved(runners, budget_s=budget_s)
    first, *_, floor = forms
    norms = [label for label in forms if label != floor]
    return {
        "timings_ms": {k: t.to_dict() for k, t in timings.items()},
        "ratio_to_first": {
            k: paired_ratio(t, timings[first]).to_dict() for k, t in timings.items() if k != first
        },
        "ort_ran": ran,
        "fastest": min(norms, key=lambda k: timings[k].median_ms),
    }


# ---- conv-net norms (--set conv) ----

CONV_SHAPES = ((8, 64, 56, 56), (1, 256, 14, 14))
#: Group -> its shapes: the channels-first LayerNorm also at batches 1, 2 and 8 of other sizes.
CONV_GROUP_SHAPES = {
    "instancenorm": CONV_SHAPES,
    "groupnorm": CONV_SHAPES,
    "channels_first_layernorm": (
        *CONV_SHAPES,
        (1, 64, 56, 56),
        (2, 64, 56, 56),
        (8, 256, 14, 14),
        (8, 96, 56, 56),
    ),
}
GN_GROUPS = 32
DECOMPOSED = "decomposed (raw dynamo export)"


def _chain(in_shape: tuple[int, ...], steps: list, opset: int = 18) -> bytes:
    """A model applying ``steps`` in turn to a float32 input ``x`` of ``in_shape``; each step
    ``(op_type, constant inputs after the previous output, attributes)``."""
    value = x = ir.Value(name="x", shape=ir.Shape(in_shape), type=ir.TensorType(ir.DataType.FLOAT))
    nodes, constants = [], []
    for i, (op, arrays, attributes) in enumerate(steps):
        args = [value]
        for j, array in enumerate(arrays):
            array = np.asarray(array)
            name = f"c{i}_{j}"
            dtype = ir.TensorType(ir.DataType.from_numpy(array.dtype))
            constant = ir.Value(name=name, shape=ir.Shape(array.shape), type=dtype)
            constant.const_value = ir.tensor(array, name=name)
            args.append(constant)
            constants.append(constant)
        nodes.append(ir.node(op, args, attributes))
        value = nodes[-1].outputs[0]
    value.name = "y"
    graph = ir.Graph([x], [value], nodes=nodes, initializers=constants, opset_imports={"": opset})
    return ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString()


def _decomposed(module: torch.nn.Module, shape: tuple[int, ...]) -> bytes:
    """The raw dynamo export (opset 18, exact clean-up only) of ``module`` at ``shape``."""
    exported = export_module(
        module, (torch.zeros(shape),), opset=18, input_names=["x"], exporter="dynamo"
    )
    return ir.to_proto(exported.model).SerializeToString()


def _params(module: torch.nn.Module) -> list[np.ndarray]:
    """The module's parameters as float32 arrays, in definition order."""
    return [p.detach().numpy().astype(np.float32) for p in module.parameters()]


def _instancenorm_forms(shape: tuple[int, ...]) -> dict[str, list | bytes]:
    n, c, h, w = shape
    module = CnnLayerNorm(c)
    gamma, beta = _params(module)
    return {
        "InstanceNormalization": [
            ("InstanceNormalization", [gamma.reshape(c), beta.reshape(c)], {"epsilon": 1e-5})
        ],
        DECOMPOSED: _decomposed(module, shape),
        "LayerNormalization(axis=2)+Mul+Add": [
            ("LayerNormalization", [np.ones((h, w), np.float32)], {"axis": 2, "epsilon": 1e-5}),
            ("Mul", [gamma], {}),
            ("Add", [beta], {}),
        ],
    }


def _groupnorm_forms(shape: tuple[int, ...]) -> dict[str, list | bytes]:
    n, c = shape[:2]
    module = HandGroupNorm(c, GN_GROUPS)
    weight, bias = _params(module)
    per_channel = (c, *(1,) * (len(shape) - 2))
    view, back = np.array([0, GN_GROUPS, -1]), np.array(shape)
    affine = [("Reshape", [back], {}), ("Mul", [weight.reshape(per_channel)], {})]
    affine.append(("Add", [bias.reshape(per_channel)], {}))
    ones, zeros = np.ones(GN_GROUPS, np.float32), np.zeros(GN_GROUPS, np.float32)
    inner = np.ones(int(np.prod(shape[1:])) // GN_GROUPS, np.float32)
    return {
        "Reshape+InstanceNormalization+Reshape+Mul+Add": [
            ("Reshape", [view], {}),
            ("InstanceNormalization", [ones, zeros], {"epsilon": 1e-5}),
            *affine,
        ],
        "Reshape+LayerNormalization+Reshape+Mul+Add": [
            ("Reshape", [view], {}),
            ("LayerNormalization", [inner], {"axis": -1, "epsilon": 1e-5}),
            *affine,
        ],
        "GroupNormalization-21": (
            [("GroupNormalization", [weight, bias], {"num_groups": GN_GROUPS, "epsilon": 1e-5})],
            21,
        ),
        DECOMPOSED: _decomposed(module, shape),
    }


def _channels_first_forms(shape: tuple[int, ...]) -> dict[str, list | bytes]:
    rank = len(shape)
    module = ChannelsFirstLayerNorm(shape[1])
    weight, bias = _params(module)
    norm = ("LayerNormalization", [weight, bias], {"axis": -1, "epsilon": 1e-6})
    to_first = ("Transpose", [], {"perm": [0, rank - 1, *range(1, rank - 1)]})
    return {
        "Transpose+LayerNormalization+Transpose": [
            ("Transpose", [], {"perm": [0, *range(2, rank), 1]}),
            norm,
            to_first,
        ],
        DECOMPOSED: _decomposed(module, shape),
        "LayerNormalization+Transpose (channels-last input)": [norm, to_first],
    }


CONV_FORMS = {
    "instancenorm": _instancenorm_forms,
    "groupnorm": _groupnorm_forms,
    "channels_first_layernorm": _channels_first_forms,
}


def measure_conv_group(
    group: str, shape: tuple[int, ...], provider: str, budget_s: float, threads: int | None
) -> dict:
    """Time one conv group at one shape (:func:`time_forms`, Relu as the floor), with each
    form's largest difference to the decomposed form's output on the timed input."""
    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    last = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    forms = {}
    for label, form in CONV_FORMS[group](shape).items():
        if isinstance(form, bytes):
            forms[label] = (form, {"x": x}, ())
            continue
        steps, opset = form if isinstance(form, tuple) else (form, 18)
        feed = last if "channels-last" in label else x
        forms[label] = (_chain(feed.shape, steps, opset), {"x": feed}, ())
    forms["Relu (floor)"] = (_chain(shape, [("Relu", [], {})]), {"x": x}, ())
    result = time_forms(forms, provider, budget_s, threads)
    want = runtime.run(runtime.make_session(forms[DECOMPOSED][0], provider), {"x": x})[0]
    result["max_abs_diff"] = {
        label: float(np.abs(runtime.run(runtime.make_session(m, provider), f)[0] - want).max())
        for label, (m, f, _) in forms.items()
        if label != "Relu (floor)"
    }
    return result


def main(argv: list[str] | None = None) -> int:
    """Measure every group at every shape; write JSON + PNG; print one table per group."""
    p = argparse.ArgumentParser(prog="python benchmarks/forms.py", description=__doc__)
    p.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--budget", type=float, default=6.0, help="timing seconds per group and shape")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads")
    p.add_argument("--set", choices=["transformer", "conv"], default="transformer")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    console = Console(highlight=False, width=160)
    provider, note = runtime.resolve_provider(args.provider)
    if note:
        console.print(note)
    if args.set == "conv":
        results = {
            group: {
                "x".join(map(str, shape)): measure_conv_group(
                    group, shape, provider, args.budget, args.threads
                )
                for shape in CONV_GROUP_SHAPES[group]
            }
            for group in CONV_FORMS
        }
    else:
        results = {
            group: {
                "x".join(map(str, shape)): measure_group(
                    group, shape, provider, args.budget, args.threads
                )
                for shape in SHAPES
            }
            for group in GROUPS
        }
    _print(results, console)
    out = {
        "machine": Machine.probe(provider).to_dict(),
        "provider": runtime.PROVIDERS[provider][0],
        "provider_note": note,
        "threads": args.threads,
        "method": "one process, interleaved rounds in rotated order, IO binding, warm-up 5 "
        "rounds, ORT intra-op spinning off; ratios are medians of per-round ratios with 95% "
        "bootstrap intervals",
        "groups": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"forms_{provider}" if args.set == "transformer" else f"forms_conv_{provider}"
    report.write_json(out, args.out / f"{name}.json")
    _chart(results, runtime.PROVIDERS[provider][0], args.out / f"{name}.png")
    console.print(f"wrote {args.out / name}.json and .png")
    return 0


def _print(results: dict, console: Console) -> None:
    """One table per group: ms per call per form and shape, with the ratio to the first."""
    for group, by_shape in results.items():
        table = Table(title=f"{group}: ms per call, median [95% CI]; ratio to the first form")
        table.add_column("form")
        for shape in by_shape:
            table.add_column(shape, justify="right")
        for label in next(iter(by_shape.values()))["timings_ms"]:
            cells = []
            for r in by_shape.values():
                t = r["timings_ms"][label]
                ratio = r["ratio_to_first"].get(label)
                cells.append(
                    f"{t['median_ms']:.3f} [{t['ci_low_ms']:.3f}, {t['ci_high_ms']:.3f}]"
                    + (f" {fmt_ratio(ratio)}" if ratio else "")
                )
            table.add_row(label, *cells)
        console.print(table)
        for shape, r in by_shape.items():
            console.print(f"  {shape}: fastest {r['fastest']}; ORT ran {r['ort_ran']}")


def _chart(results: dict, provider: str, path: Path) -> None:
    """Grouped bars: median ms per form (95% CI whiskers), per shape; one panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2))
    for ax, (group, by_shape) in zip(axes, results.items(), strict=True):
        labels = list(next(iter(by_shape.values()))["timings_ms"])
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            med = np.array([r["timings_ms"][label]["median_ms"] for r in by_shape.values()])
            lo = med - [r["timings_ms"][label]["ci_low_ms"] for r in by_shape.values()]
            hi = [r["timings_ms"][label]["ci_high_ms"] for r in by_shape.values()] - med
            xs = np.arange(len(by_shape)) + i * width
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=label)
        ax.set_xticks(np.arange(len(by_shape)) + 0.4 - width / 2, list(by_shape), fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(f"ms per call (median, 95% CI), {provider}")
        ax.set_title(group)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
