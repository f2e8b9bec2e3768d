"""Float16 norms with large residuals on one ONNX Runtime provider: the Skip hazard, checked.

ONNX Runtime's CUDA ``SkipSimplifiedLayerNormalization`` once accumulated the variance in the
input type, so float16 residuals of a few hundred returned zeros or NaN
(microsoft/onnxruntime#29034; ``docs/cuda.md`` says why the pinned 1.31.1 should have the fix).
This runs each norm form that ``--precision fp16`` may emit, in float16, on inputs whose
residual stream carries the overflow probe's outliers (:func:`normexport.precision.with_outliers`:
one feature in eight about 1e3) and checks it against numpy in float64:

- ``skip_simplified``: ``SkipSimplifiedLayerNormalization`` (com.microsoft), input + skip;
- ``skip_layernorm``: ``SkipLayerNormalization`` (com.microsoft), input + skip, with beta;
- ``layernorm``: ``LayerNormalization`` (opset 17) of input + skip, ``stash_type`` 1 (float32);
- ``simplified``: ``SimplifiedLayerNormalization`` (ORT's RMSNorm), ``stash_type`` 1;
- ``rmsnorm``: ``RMSNormalization`` (opset 23), ``stash_type`` 1.

Each form's output (and the Skip forms' sum output) is compared by relative L2 error (the
norm of the difference over the norm of the float64 result) and counted for NaN / Inf and for
rows that came back all zero. Shapes: (4, 256, 2048) and (1, 128, 768).

    python benchmarks/half_norms.py [--provider auto] [--out benchmarks/results]

Writes ``half_norms_<provider>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from normexport import precision, runtime
from normexport.bench.results import Machine
from normexport.precision.feeds import OUTLIER_SCALE

SHAPES = ((4, 256, 2048), (1, 128, 768))
FORMS = ("skip_simplified", "skip_layernorm", "layernorm", "simplified", "rmsnorm")
EPS = 1e-5


def _model(form: str, shape: tuple[int, ...]) -> onnx.ModelProto:
    """The one-op float16 model of ``form`` over inputs ``x`` and ``skip`` of ``shape``;
    weights ``gamma`` and ``beta`` (hidden,) are graph inputs, outputs ``y`` (and ``sum``)."""
    hidden = shape[-1]
    f16 = TensorProto.FLOAT16
    inputs = [helper.make_tensor_value_info(n, f16, shape) for n in ("x", "skip")]
    inputs += [helper.make_tensor_value_info(n, f16, (hidden,)) for n in ("gamma", "beta")]
    outputs = [helper.make_tensor_value_info("y", f16, shape)]
    nodes, opset = [], 17
    if form.startswith("skip_"):
        op = (
            "SkipSimplifiedLayerNormalization"
            if form == "skip_simplified"
            else "SkipLayerNormalization"
        )
        ins = ["x", "skip", "gamma"] + ([] if form == "skip_simplified" else ["beta"])
        nodes.append(
            helper.make_node(op, ins, ["y", "", "", "sum"], domain="com.microsoft", epsilon=EPS)
        )
        outputs.append(helper.make_tensor_value_info("sum", f16, shape))
    else:
        nodes.append(helper.make_node("Add", ["x", "skip"], ["h"]))
        if form == "layernorm":
            nodes.append(
                helper.make_node(
                    "LayerNormalization",
                    ["h", "gamma", "beta"],
                    ["y"],
                    axis=-1,
                    epsilon=EPS,
                    stash_type=1,
                )
            )
        elif form == "simplified":
            nodes.append(
                helper.make_node(
                    "SimplifiedLayerNormalization",
                    ["h", "gamma"],
                    ["y"],
                    axis=-1,
                    epsilon=EPS,
                    stash_type=1,
                )
            )
        else:
            nodes.append(
                helper.make_node(
                    "RMSNormalization", ["h", "gamma"], ["y"], axis=-1, epsilon=EPS, stash_type=1
                )
            )
            opset = 23
    graph = helper.make_graph(nodes, form, inputs, outputs)
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=10 if opset >= 23 else 8)


def _inputs(shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    """float16 inputs: ``x`` standard normal, ``skip`` with the residual stream's outliers
    (:func:`normexport.precision.with_outliers`), random ``gamma`` and ``beta``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    skip = precision.with_outliers(rng, shape)
    hidden = shape[-1]
    gamma, beta = rng.uniform(0.5, 1.5, hidden), rng.standard_normal(hidden) * 0.1
    return {
        k: v.astype(np.float16) for k, v in dict(x=x, skip=skip, gamma=gamma, beta=beta).items()
    }


def _reference(form: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``form`` in float64 numpy on the float16 ``feeds`` (LayerNorm: Ba et al. 2016;
    RMSNorm: Zhang and Sennrich 2019)."""
    f = {k: v.astype(np.float64) for k, v in feeds.items()}
    h = f["x"] + f["skip"]
    if form in ("skip_layernorm", "layernorm"):
        c = h - h.mean(-1, keepdims=True)
        y = c / np.sqrt((c * c).mean(-1, keepdims=True) + EPS) * f["gamma"] + f["beta"]
    else:
        y = h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS) * f["gamma"]
    return {"y": y, "sum": h}


def _check(form: str, shape: tuple[int, ...], provider: str) -> dict:
    """Run ``form`` once on ``provider``; errors of each output against float64."""
    feeds = _inputs(shape)
    try:
        session = runtime.make_session(_model(form, shape).SerializeToString(), provider)
        got = dict(
            zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)
        )
    except Exception as err:  # noqa: BLE001 - a form ORT refuses is a result, not a crash
        return {"form": form, "shape": list(shape), "error": runtime.message(err)}
    want = _reference(form, feeds)
    out = {"form": form, "shape": list(shape), "providers": session.get_providers()}
    for name, value in got.items():
        v = value.astype(np.float64)
        finite = np.isfinite(v)
        rows = v.reshape(-1, shape[-1])
        err = np.linalg.norm(np.where(finite, v, 0) - want[name]) / np.linalg.norm(want[name])
        out[name] = {
            "relative_l2_error": float(err),
            "non_finite": int((~finite).sum()),
            "zero_rows": int((np.abs(rows).max(-1) == 0).sum()),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Check every form at every shape; print one line each and write the JSON."""
    p = argparse.ArgumentParser(prog="python benchmarks/half_norms.py", description=__doc__)
    p.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    provider, note = runtime.resolve_provider(args.provider)
    rows = [_check(f, s, provider) for s in SHAPES for f in FORMS]
    for r in rows:
        cells = r.get("error") or "  ".join(
            f"{k}: rel L2 {r[k]['relative_l2_error']:.2e}, non-finite {r[k]['non_finite']}, "
            f"zero rows {r[k]['zero_rows']}"
            for k in ("y", "sum")
            if k in r
        )
        print(f"{r['form']:16s} {'x'.join(map(str, r['shape'])):12s} {cells}")
    result = {"provider": provider, "note": note, "scale": OUTLIER_SCALE, "rows": rows}
    result["machine"] = Machine.probe(provider).to_dict()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"half_norms_{provider}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
