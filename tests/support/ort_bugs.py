"""The graphs of ONNX Runtime's known LayerNorm-fusion bugs, built node by node as their issues
build them (docs/parity.md#judged-as-deployed), shared by fusion's and normexport's tests."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

from tests.support.graphs import make_model

F = TensorProto.FLOAT


def layernorm(
    shape: list[int], keepdims: int, scale: list[int], bias: list[int] | None, *, rms=False
) -> ir.Model:
    """``x -> [ReduceMean, Sub,] Pow, ReduceMean, Add(eps), Sqrt, Div, Mul(scale, .)[, Add(.,
    bias)]`` over the last axis with ``keepdims`` (opset 17: axes an attribute), the constant
    first in the Mul as the issues write it; random scale and bias of the shapes given; the
    output's shape is the broadcast one."""
    rng = np.random.default_rng(len(shape) + keepdims + len(scale))
    inits = {"eps": np.array(1e-5, np.float32), "two": np.array(2.0, np.float32)}
    inits["g"] = rng.uniform(0.5, 2, scale).astype(np.float32)
    nodes = []
    centred = "x"
    if not rms:
        nodes += [("ReduceMean", ["x"], ["mn"], {"axes": [-1], "keepdims": keepdims})]
        nodes += [("Sub", ["x", "mn"], ["ct"], {})]
        centred = "ct"
    nodes += [
        ("Pow", [centred, "two"], ["sq"], {}),
        ("ReduceMean", ["sq"], ["vr"], {"axes": [-1], "keepdims": keepdims}),
        ("Add", ["vr", "eps"], ["ve"], {}),
        ("Sqrt", ["ve"], ["sd"], {}),
        ("Div", [centred, "sd"], ["nm"], {}),
        ("Mul", ["g", "nm"], ["y" if bias is None else "scaled"], {}),
    ]
    if bias is not None:
        inits["b"] = rng.standard_normal(bias).astype(np.float32)
        nodes.append(("Add", ["scaled", "b"], ["y"], {}))
    out = list(np.broadcast_shapes(tuple(shape), tuple(scale), tuple(bias or ())))
    return make_model(nodes, {"x": (F, shape)}, {"y": (F, out)}, inits, opset=17, ir_version=8)


#: ONNX Runtime issue -> its graph: #30513 (keepdims=0 where the broadcast lines up: x [B, S,
#: D] with B = S = D), #31147 (a rank-1 input, keepdims=1: the Div's output taken as scale),
#: #31980 (an RMSNorm of x [1, 1] whose scale [2] broadcasts it to [1, 2]).
GRAPHS = {
    "onnxruntime#30513": lambda: layernorm([8, 8, 8], 0, [8], [8]),
    "onnxruntime#31147": lambda: layernorm([8], 1, [8], [8]),
    "onnxruntime#31980": lambda: layernorm([1, 1], 1, [2], None, rms=True),
}


def feeds(model: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 feeds for ``model``'s input ``x``."""
    shape = [d if isinstance(d, int) else 1 for d in model.graph.inputs[0].shape]
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}
