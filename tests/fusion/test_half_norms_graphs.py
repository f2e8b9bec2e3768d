"""Hand-written norms in float16 and bfloat16 (issue 61), node by node (no PyTorch): each fused
into the opset's op on its own type with ``stash_type=1`` (statistics in float32), run on ONNX
Runtime before and after the pass, and compared with the float64 reference within normexport's
half-precision rule (docs/precision.md#parity-in-half-precision); a bfloat16 RMSNorm where ONNX
Runtime's CPU provider has no kernel for the fused op is refused. The facts of the kernel table
(:data:`fusion.norm_match.ORT_CPU_TYPES`) are asked of ONNX Runtime here, by opening sessions.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto

from fusion import Code
from fusion.fuse_layernorm import FuseLayerNorm
from fusion.fuse_rmsnorm import FuseRMSNorm
from fusion.norm_match import ORT_CPU_TYPES
from tests.support.graphs import cpu_session, make_model, ops, run
from tests.support.norm_graphs import SHAPE, Graph, assert_refused, fuse_and_compare, inputs

H = SHAPE[-1]
FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
NUMPY = {FLOAT16: np.float16, BFLOAT16: ml_dtypes.bfloat16}

#: normexport's half-precision rule (docs/precision.md#parity-in-half-precision): the relative
#: L2 error against the float64 oracle an output of the type may have. Written again here on
#: purpose: fusion's tests import no normexport.
HALF_REL_L2 = {FLOAT16: 1e-2, BFLOAT16: 8e-2}


def _half_norm(g: Graph, rng, dtype: int, *, rms=False, eps=1e-5, x="x") -> tuple[str, dict]:
    """A LayerNorm (or with ``rms`` an RMSNorm) written by hand in ``dtype`` throughout:
    ``(x - mean) / sqrt(var + eps) * w + b`` (``x * Reciprocal(sqrt(mean(x^2) + eps)) * w``),
    every constant of that type; return its output and the parameters as float64."""
    t = NUMPY[dtype]
    w = (1 + 0.5 * rng.standard_normal(H)).astype(t)
    b = rng.standard_normal(H).astype(t)
    two, e = g.const("two", t(2)), g.const("eps", t(eps))
    v = x if rms else g.node("Sub", [x, g.reduce("ReduceMean", x, "m", (-1,))], "d")
    ms = g.reduce("ReduceMean", g.node("Pow", [v, two], "sq"), "ms", (-1,))
    den = g.node("Sqrt", [g.node("Add", [ms, e], "ms_eps")], "den")
    normed = g.node("Mul", [v, g.node("Reciprocal", [den], "inv")], "normed")
    y = g.node("Mul", [normed, g.const("w", w)], "scaled")
    params = {"w": w.astype(np.float64), "eps": float(t(eps))}
    if not rms:
        y = g.node("Add", [y, g.const("b", b)], "y")
        params["b"] = b.astype(np.float64)
    return y, params


def _reference(x: np.ndarray, params: dict, rms: bool) -> np.ndarray:
    """The norm in float64, of the input as the model holds it (rounded to its type)."""
    x = x.astype(np.float64)
    v = x if rms else x - x.mean(-1, keepdims=True)
    y = v / np.sqrt((v * v).mean(-1, keepdims=True) + params["eps"]) * params["w"]
    return y + params["b"] if "b" in params else y


def _assert_within_half_rule(got: np.ndarray, want: np.ndarray, dtype: int) -> float:
    """The relative L2 error of ``got`` against the float64 ``want`` is within the rule."""
    got = np.asarray(got, np.float64)
    error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert np.isfinite(got).all() and error <= HALF_REL_L2[dtype], error
    return error


@pytest.mark.parametrize(
    ("rms", "opset", "target", "op"),
    [
        (False, 17, "onnx", "LayerNormalization"),
        (True, 23, "onnx", "RMSNormalization"),
        (True, 18, "ort", "SimplifiedLayerNormalization"),
    ],
    ids=["layernorm", "rmsnorm_23", "rmsnorm_ort"],
)
def test_a_float16_norm_fuses_on_float16(rng, rms, opset, target, op):
    """Statistics in float16 as written; the fused op takes them in float32 (stash_type=1):
    not bit-identical, so held to the half rule against float64, as the verdict holds it."""
    g = Graph(opset)
    y, params = _half_norm(g, rng, FLOAT16, rms=rms)
    model = g.model({"x": (FLOAT16, SHAPE)}, {y: (FLOAT16, SHAPE)})
    fusion_pass = FuseRMSNorm(target) if rms else FuseLayerNorm(target)
    feeds = inputs(rng, model)
    unfused = run(model, feeds)[0]
    report = fuse_and_compare(model, fusion_pass, rng, rtol=2e-3, check=target == "onnx")
    assert not report.refused and ops(model) == [op]
    (node,) = model.graph
    assert node.inputs[0].dtype == node.inputs[1].dtype == ir.DataType.FLOAT16
    assert node.attributes.get_float("epsilon") == np.float32(np.float16(1e-5))
    if op != "SimplifiedLayerNormalization":
        assert node.attributes.get_int("stash_type") == 1
    want = _reference(feeds["x"], params, rms)
    _assert_within_half_rule(unfused, want, FLOAT16)
    _assert_within_half_rule(run(model, feeds)[0], want, FLOAT16)


def _bfloat16_model(g: Graph, y: str, opset: int) -> ir.Model:
    """Float32 in and out (ONNX Runtime's Python API holds no bfloat16 arrays), bfloat16
    between: ``Cast(x, bfloat16)`` first, ``Cast(y, float32)`` last."""
    g.nodes.insert(0, ("Cast", ["x32"], ["x"], {"to": BFLOAT16}))
    out = g.node("Cast", [y], "y32", to=FLOAT)
    return g.model({"x32": (FLOAT, SHAPE)}, {out: (FLOAT, SHAPE)})


def test_a_bfloat16_layernorm_fuses_on_bfloat16(rng):
    """ONNX Runtime's CPU provider has no bfloat16 ReduceMean: the hand-written norm does not
    run there, the fused LayerNormalization does, within bfloat16's rule of float64."""
    g = Graph(18)
    y, params = _half_norm(g, rng, BFLOAT16)
    model = _bfloat16_model(g, y, 18)
    assert FuseLayerNorm("onnx")(model).modified
    assert ops(model) == ["Cast", "LayerNormalization", "Cast"]
    assert model.graph.node(1).inputs[0].dtype == ir.DataType.BFLOAT16
    feeds = inputs(rng, model)
    x = feeds["x32"].astype(ml_dtypes.bfloat16)
    _assert_within_half_rule(run(model, feeds)[0], _reference(x, params, False), BFLOAT16)


def _bfloat16_round_trip_rmsnorm(opset: int) -> ir.Model:
    """A float32 RMSNorm between ``Cast(bfloat16)`` and ``Cast(float32)`` of a bfloat16 input,
    then back to bfloat16 (the Hugging Face habit), float32 in and out."""
    g = Graph(opset)
    x = g.node("Cast", ["x"], "x_up", to=FLOAT)
    ms = g.reduce("ReduceMean", g.node("Mul", [x, x], "sq"), "ms", (-1,))
    den = g.node("Sqrt", [g.node("Add", [ms, g.const("eps", np.float32(1e-6))], "e")], "den")
    normed = g.node("Div", [x, den], "normed")
    return _bfloat16_model(g, g.node("Cast", [normed], "normed16", to=BFLOAT16), opset)


def test_a_bfloat16_rmsnorm_becomes_the_op_onnx_runtime_runs(rng):
    """Opset 23, ``target="ort"``: RMSNormalization has no bfloat16 kernel in ONNX Runtime's
    CPU provider, SimplifiedLayerNormalization has one."""
    model = _bfloat16_round_trip_rmsnorm(23)
    report = fuse_and_compare(model, FuseRMSNorm("ort"), rng, rtol=1e-2, check=False)
    assert report.counts["rmsnorm_fused"] == 1
    assert ops(model) == ["Cast", "SimplifiedLayerNormalization", "Cast"]


def test_a_bfloat16_rmsnormalization_is_refused_for_onnx():
    model = _bfloat16_round_trip_rmsnorm(23)
    assert_refused(model, FuseRMSNorm("onnx"), Code.NO_ORT_KERNEL)


@pytest.mark.parametrize("dtype", [FLOAT, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("op", sorted(ORT_CPU_TYPES))
def test_the_kernel_table_is_onnx_runtimes(op, dtype):
    """Each fused norm op loads and runs on ONNX Runtime's CPU provider in exactly the types
    :data:`ORT_CPU_TYPES` lists (float32 in and out, the op between two Casts)."""
    t = NUMPY.get(dtype, np.float32)
    names = ["xt", "w", "b"][: 3 if op == "LayerNormalization" else 2]
    nodes = [
        ("Cast", ["x"], ["xt"], {"to": dtype}),
        (op, names, ["yt"], {"axis": -1, "epsilon": 1e-5}),
        ("Cast", ["yt"], ["y"], {"to": FLOAT}),
    ]
    params = {"w": np.ones(H, t), "b": np.zeros(H, t)}
    model = make_model(
        nodes,
        {"x": (FLOAT, SHAPE)},
        {"y": (FLOAT, SHAPE)},
        {n: params[n] for n in names[1:]},
        opset=23,
        ir_version=11,
    )
    supported = ir.DataType(dtype) in ORT_CPU_TYPES[op]
    try:
        session = cpu_session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        y = session.run(None, {"x": np.ones(SHAPE, np.float32)})[0]
    except Exception as error:  # ORT's NOT_IMPLEMENTED, or a failed run
        assert not supported, error
    else:
        assert supported and np.isfinite(y).all()
