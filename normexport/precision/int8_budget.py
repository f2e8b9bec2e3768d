"""The int8 budget's search (docs/precision.md#int8): where the int8 model fails its budget,
what quantizing each linear layer costs the output, measured one at a time as ONNX Runtime's
QDQ debugging measures a layer (:func:`layer_costs`, at most :data:`MAX_MEASURED` layers, chosen
by :func:`rounding_errors`), and the costliest kept in float (:func:`costliest`). Each model
measured is one call of :func:`normexport.precision.int8.quantize`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from normexport.precision import int8
from normexport.precision.kept import KeptFloat32

#: The most layers kept in float for the budget (the costliest by :func:`layer_costs`, one
#: more at a time, each a quantization and a verdict); beyond it the float32 model is published.
MAX_KEPT_FOR_BUDGET = 8
#: The most layers :func:`layer_costs` measures one at a time (each a quantization of the whole
#: model): where there are more, those whose input int8 rounds most (:func:`rounding_errors`).
MAX_MEASURED = 2 * MAX_KEPT_FOR_BUDGET


#: The layers :func:`layer_costs` weighs: the linear ops, where int8 does the work (and loses
#: the accuracy); what else ONNX Runtime quantizes (Add, Mul, pooling, Concat) moves values
#: through int8 and loses only a rounding.
LINEAR_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Attention", "FusedConv", "FusedMatMul")


def linear_nodes(path: Path, kept: Iterable[str]) -> list[str]:
    """The names of the :data:`LINEAR_OPS` nodes of the model at ``path`` not in ``kept``."""
    skip = set(kept)
    graph = onnx.load(path, load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type in LINEAR_OPS and n.name and n.name not in skip]


def rel_l2(got: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> float:
    """``||got - ref||_2 / ||ref||_2`` over every output, in float64 (0 where both are 0)."""
    pairs = zip(got, ref, strict=True)
    diff = np.sqrt(sum(np.sum((np.float64(g) - np.float64(r)) ** 2) for g, r in pairs))
    norm = np.sqrt(sum(np.sum(np.float64(r) ** 2) for r in ref))
    return float(diff / norm) if norm > 0 else (0.0 if diff == 0 else float("inf"))


def layer_costs(
    src: Path,
    *,
    precision: str,
    calibration: Sequence[Mapping[str, np.ndarray]],
    feeds: Sequence[Mapping[str, np.ndarray]],
    kept: Sequence[str],
    candidates: Sequence[str],
    cache: Path | None,
) -> tuple[float, dict[str, float]]:
    """What quantizing each of ``candidates`` costs, measured one at a time as ONNX Runtime's QDQ
    debugging measures a layer (``onnxruntime.quantization.qdq_loss_debug``: the quantized model
    against the float one on the same inputs): the int8 model with ``kept`` in float is run on
    ``feeds`` and so is each with one candidate more in float; a candidate's cost is how much
    the output's relative L2 error to the float32 model at ``src`` falls with it in float.
    Each measurement is a quantization of the whole model: of more than :data:`MAX_MEASURED`
    candidates, the :data:`MAX_MEASURED` whose input int8 rounds most
    (:func:`rounding_errors`, one pass) are measured.

    Returns:
        The error with every candidate quantized, and measured candidate -> cost (larger:
        worse).
    """
    import onnxruntime as ort

    from normexport import progress

    if not candidates:
        return 0.0, {}
    if len(candidates) > MAX_MEASURED:
        progress.step(f"the int8 rounding of the inputs of {len(candidates)} layer(s)")
        rounding = rounding_errors(src, feeds, candidates)
        candidates = sorted(candidates, key=rounding.get, reverse=True)[:MAX_MEASURED]
    progress.step(f"the cost of each of {len(candidates)} layer(s), one at a time")

    options = ort.SessionOptions()
    options.log_severity_level = 3

    def error(model: Path) -> float:
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        got = [session.run(None, dict(f)) for f in feeds]
        return rel_l2([a for g in got for a in g], [a for r in refs for a in r])

    float_session = ort.InferenceSession(src, options, providers=["CPUExecutionProvider"])
    refs = [float_session.run(None, dict(f)) for f in feeds]
    del float_session
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "all.onnx"
        int8.quantize(
            src, base, precision=precision, calibration=calibration, kept=kept,
            external_data=False, cache=cache,
        )  # fmt: skip
        everything = error(base)
        costs = {}
        for i, name in enumerate(candidates):
            one = Path(folder) / f"{i}.onnx"
            int8.quantize(
                src, one, precision=precision, calibration=calibration, kept=[*kept, name],
                external_data=False, cache=cache,
            )  # fmt: skip
            costs[name] = everything - error(one)
            one.unlink()
    return everything, costs


def rounding_errors(
    src: Path, feeds: Sequence[Mapping[str, np.ndarray]], candidates: Sequence[str]
) -> dict[str, float]:
    """How much int8 rounds the input of each of ``candidates`` (nodes of the float32 model at
    ``src``), in one pass: the float activations on ``feeds``, collected by ONNX Runtime's QDQ
    debugging tools (``qdq_loss_debug.modify_model_output_intermediate_tensors``,
    ``collect_activations``), each rounded to uint8 over its range on every feed (ONNX Runtime's
    ``quant_utils.quantize_data``: the range MinMax calibration gives, and a bound on the
    ranges ``quantize_dynamic`` takes at run time) and compared with itself (relative L2
    error, :func:`rel_l2`). A layer whose input has outliers, which set the range and round
    every other value coarsely, has a large one. A candidate whose input is no float tensor
    (an integer input) gets 0.

    Returns:
        candidate -> relative L2 error of its input's int8 rounding.
    """
    from onnxruntime.quantization import qdq_loss_debug
    from onnxruntime.quantization.quant_utils import quantize_data

    nodes = {n.name: n for n in onnx.load(src, load_external_data=False).graph.node}
    ops = sorted({nodes[name].op_type for name in candidates})
    with tempfile.TemporaryDirectory() as folder:
        augmented = Path(folder) / "augmented.onnx"
        qdq_loss_debug.modify_model_output_intermediate_tensors(src, augmented, ops)
        activations = qdq_loss_debug.collect_activations(str(augmented), [dict(f) for f in feeds])
    errors = {}
    for name in candidates:
        values = [np.float32(a).ravel() for a in activations.get(nodes[name].input[0], [])]
        if not values:
            errors[name] = 0.0
            continue
        zero_point, scale, rounded = quantize_data(
            np.concatenate(values), onnx.TensorProto.UINT8, False
        )
        dequantized = (np.float64(rounded) - np.float64(zero_point)) * np.float64(scale)
        errors[name] = rel_l2([dequantized], [np.concatenate(values)])
    return errors


def costliest(src: Path, everything: float, costs: Mapping[str, float]) -> list[KeptFloat32]:
    """The :data:`MAX_KEPT_FOR_BUDGET` costliest layers of :func:`layer_costs`' ``costs``
    (``everything``: the error with all quantized), costliest first, as kept in float for the
    budget (the model at ``src`` gives their op types)."""
    ops = {n.name: n.op_type for n in onnx.load(src, load_external_data=False).graph.node}
    worst_first = sorted(costs, key=costs.get, reverse=True)[:MAX_KEPT_FOR_BUDGET]
    return [
        KeptFloat32(
            name,
            ops[name],
            "budget",
            f"out of the int8 budget: quantized, it cost the outputs {costs[name]:.3g} of the "
            f"{everything:.3g} relative L2 error to float32 (each linear layer measured alone)",
        )
        for name in worst_first
    ]
