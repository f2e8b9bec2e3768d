"""FuseSkip: residual Add + norm -> com.microsoft SkipLayerNormalization / SkipSimplified...

Torch modules (both exporters) give LayerNormalization and, at opset 23, RMSNormalization after
an Add; ONNX Runtime's SimplifiedLayerNormalization, the shape variants and the look-alikes are
built with onnx.helper. Each fused model is run on ONNX Runtime's CPU provider and compared with
PyTorch (or a float64 numpy reference) and with the unfused graph, on random inputs and on the
probes that make eps matter; it must pass fusion.check, and a second run of the pass must change
nothing. Refused candidates must be left byte-identical, with the reason code in the report.
Exports PyTorch modules (slow); the graph-level cases without PyTorch are in
``test_fuse_skip_graphs.py``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import fusion
from fusion import Code
from fusion.base import FusionReport
from fusion.fuse_skip import SKIP_OPS, FuseSkip
from tests.support import exported
from tests.support.graphs import cpu_session
from tests.support.norm_testing import assert_matches

pytestmark = pytest.mark.slow

torch.set_num_threads(1)

B, S, H = 2, 5, 16


def _probes(shape=(B, S, H)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``(a, b)`` pairs: random, and sums that are constant rows, zeros, tiny and huge."""
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=shape), rng.normal(size=shape)
    rows = np.broadcast_to(np.arange(shape[-2]).reshape(-1, 1), shape)
    found = {
        "random": (a, b),
        "constant rows": (np.full(shape, 1.25) + rows, np.full(shape, 2.0)),
        "zeros": (np.zeros(shape), np.zeros(shape)),
        "1e-4 scale": (a * 1e-4, b * 1e-4),
        "1e3 scale": (a * 1e3, b * 1e3),
    }
    return {k: (x.astype(np.float32), y.astype(np.float32)) for k, (x, y) in found.items()}


def _fuse(model: ir.Model) -> tuple[FusionReport, bool]:
    fusion_pass = FuseSkip()
    modified = fusion_pass(model).modified
    return fusion_pass.outcomes, modified


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def _assert_second_run_is_noop(model: ir.Model) -> None:
    before = ir.to_proto(model).SerializeToString()
    report, modified = _fuse(model)
    assert not modified
    assert report.fused == []
    assert ir.to_proto(model).SerializeToString() == before


# ---- torch modules ----


class PostNorm(torch.nn.Module):
    """``norm(x + y)``: the residual sum is read by the norm only."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, y):
        return self.norm(x + y)


class PreNorm(torch.nn.Module):
    """``h = x + y; norm(h) * 2 + h``: the sum is the residual stream, read again later."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, y):
        h = x + y
        return self.norm(h) * 2.0 + h


def _layer_norm(bias: bool = True) -> torch.nn.Module:
    norm = torch.nn.LayerNorm(H, eps=1e-6, bias=bias)
    with torch.no_grad():
        norm.weight.uniform_(-2.0, 2.0)
        if bias:
            norm.bias.uniform_(-1.0, 1.0)
    return norm


def _rms_norm() -> torch.nn.Module:
    norm = torch.nn.RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(-2.0, 2.0)
    return norm


# name -> (module factory, the norm op it exports to: at opset 23 for RMSNorm, else 17)
MODULES = {
    "post_layernorm": (lambda: PostNorm(_layer_norm()), "LayerNormalization"),
    "post_layernorm_no_bias": (lambda: PostNorm(_layer_norm(bias=False)), "LayerNormalization"),
    "pre_layernorm": (lambda: PreNorm(_layer_norm()), "LayerNormalization"),
    "post_rmsnorm_opset23": (lambda: PostNorm(_rms_norm()), "RMSNormalization"),
    "pre_rmsnorm_opset23": (lambda: PreNorm(_rms_norm()), "RMSNormalization"),
}
CASES = [
    (name, exporter)
    for name, (_, norm_op) in MODULES.items()
    for exporter in ("dynamo", "torchscript")
    if not (norm_op == "RMSNormalization" and exporter == "torchscript")  # no aten::rms_norm
]


@pytest.mark.parametrize(("name", "exporter"), CASES)
def test_fuses_torch_module(name, exporter):
    factory, norm_op = MODULES[name]
    torch.manual_seed(0)
    module = factory().eval()
    x, y = (torch.randn(B, S, H) for _ in range(2))
    opset = 23 if norm_op == "RMSNormalization" else 17
    model = exported.export(module, (x, y), input_names=["x", "y"], exporter=exporter, opset=opset)
    assert [op for op in _ops(model) if op in ("Add", norm_op)][:2] == ["Add", norm_op]
    outputs = [v.name for v in model.graph.outputs]
    unfused = cpu_session(model)

    report, modified = _fuse(model)

    assert modified
    assert report.refused == []
    skip_op = SKIP_OPS[norm_op]
    (fused,) = report.fused
    assert fused.kind == "skip_fused"
    assert fused.became.startswith(skip_op)
    assert ("output 3" in fused.became) == name.startswith("pre_")
    assert norm_op not in _ops(model) and skip_op in _ops(model)
    assert _ops(model).count("Add") == (1 if name.startswith("pre_") else 0)
    assert model.opset_imports["com.microsoft"] == 1
    assert [v.name for v in model.graph.outputs] == outputs
    fusion.check(model)
    session = cpu_session(model)
    for probe, (a, b) in _probes().items():
        with torch.no_grad():
            eager = module(torch.from_numpy(a), torch.from_numpy(b)).numpy()
        feeds = {"x": a, "y": b}
        out = session.run(None, feeds)[0]
        assert_matches(out, eager, f"{probe} vs torch", rtol=1e-3)
        assert_matches(out, unfused.run(None, feeds)[0], f"{probe} vs unfused", rtol=1e-3)
    _assert_second_run_is_noop(model)


# ---- hand-built graphs ----


def _graph_model(
    op: str,
    shapes: tuple,
    *,
    dtype=TensorProto.FLOAT,
    outputs=("y",),
    norm_outputs=("y",),
    extra_nodes=(),
    norm_attrs=None,
    param_shape=(H,),
) -> ir.Model:
    """``norm(Add(a, b))`` (eps 1e-5) with random gamma (and beta), inputs a, b of ``shapes``
    (None: no shape), graph outputs ``outputs``."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(-2, 2, param_shape).astype(np_dtype), "gamma")]
    if op == "LayerNormalization":
        inits.append(
            numpy_helper.from_array(rng.uniform(-1, 1, param_shape).astype(np_dtype), "beta")
        )
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
        helper.make_node(
            op,
            ["sum", "gamma"] + (["beta"] if op == "LayerNormalization" else []),
            list(norm_outputs),
            name="norm",
            epsilon=1e-5,
            **(norm_attrs or {}),
        ),
        *extra_nodes,
    ]
    inputs = [
        helper.make_tensor_value_info(name, dtype, shape)
        for name, shape in zip("ab", shapes, strict=True)
    ]
    full = max((s for s in shapes if s is not None), key=len)  # the Add output's shape
    out_shapes = {"mean": [*full[:-1], 1]}
    graph_outputs = [
        helper.make_tensor_value_info(o, dtype, out_shapes.get(o, full)) for o in outputs
    ]
    graph = helper.make_graph(nodes, "g", inputs, graph_outputs, inits)
    opset = 23 if op == "RMSNormalization" else 17
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return ir.from_proto(proto)


def _reference(op: str, a: np.ndarray, b: np.ndarray, model: ir.Model) -> np.ndarray:
    """float64 norm of ``a + b`` (the sum rounded to the input type, as the Add does)."""
    s = (a + b).astype(a.dtype).astype(np.float64)
    gamma = model.graph.initializers["gamma"].const_value.numpy().astype(np.float64)
    if op == "LayerNormalization":
        beta = model.graph.initializers["beta"].const_value.numpy().astype(np.float64)
        centered = s - s.mean(-1, keepdims=True)
        return centered / np.sqrt((centered**2).mean(-1, keepdims=True) + 1e-5) * gamma + beta
    return s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * gamma


NORMS = ["LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization"]
SHAPES = {
    "same_3d": ((B, S, H), (B, S, H)),
    "same_2d_tokens": ((B * S, H), (B * S, H)),
    "skip_SH": ((B, S, H), (S, H)),
    "skip_1SH_first": ((1, S, H), (B, S, H)),
    "symbolic_batch": (("batch", S, H), ("batch", S, H)),
}


@pytest.mark.parametrize("shapes", list(SHAPES))
@pytest.mark.parametrize("op", NORMS)
def test_fuses_graph(op, shapes):
    model = _graph_model(op, SHAPES[shapes])
    rng = np.random.default_rng(2)
    concrete = [tuple(3 if d == "batch" else d for d in s) for s in SHAPES[shapes]]
    a, b = (rng.normal(size=s).astype(np.float32) for s in concrete)
    feeds = {"a": a, "b": b}
    unfused = cpu_session(model).run(None, feeds)[0]

    report, modified = _fuse(model)

    assert modified, report.refused
    skip = next(n for n in model.graph if n.domain == "com.microsoft")
    data, residual = (v.name for v in skip.inputs[:2])
    # the operand with the full shape is the Skip op's input, the broadcast one its skip
    assert (data, residual) == (("b", "a") if shapes == "skip_1SH_first" else ("a", "b"))
    assert skip.attributes["epsilon"].value == np.float32(1e-5)
    fusion.check(model)
    fused = cpu_session(model).run(None, feeds)[0]
    assert_matches(fused, _reference(op, a, b, model), "vs float64")
    assert_matches(fused, unfused, "vs unfused")
    _assert_second_run_is_noop(model)


def test_sum_read_elsewhere_comes_from_output_3_and_keeps_its_graph_output_name():
    extra = [helper.make_node("Mul", ["sum", "sum"], ["squared"], name="mul")]
    model = _graph_model(
        "LayerNormalization", ((B, S, H),) * 2, outputs=("y", "sum", "squared"), extra_nodes=extra
    )
    rng = np.random.default_rng(3)
    feeds = {k: rng.normal(size=(B, S, H)).astype(np.float32) for k in "ab"}
    expected = cpu_session(model).run(None, feeds)

    report, modified = _fuse(model)

    assert modified
    assert report.fused[0].became == "SkipLayerNormalization (with the sum as output 3)"
    assert _ops(model) == ["SkipLayerNormalization", "Mul"]
    skip = next(iter(model.graph))
    assert [v.name for v in skip.outputs] == ["y", "", "", "sum"]
    assert [v.name for v in model.graph.outputs] == ["y", "sum", "squared"]
    fusion.check(model)
    for got, want, what in zip(
        cpu_session(model).run(None, feeds), expected, ["y", "sum", "sq"], strict=True
    ):
        assert_matches(got, want, what)
    np.testing.assert_array_equal(cpu_session(model).run(None, feeds)[1], feeds["a"] + feeds["b"])


@pytest.mark.parametrize("op", NORMS)
def test_fuses_float16(op):
    model = _graph_model(op, ((B, S, H),) * 2, dtype=TensorProto.FLOAT16)
    rng = np.random.default_rng(4)
    feeds = {k: rng.normal(size=(B, S, H)).astype(np.float16) for k in "ab"}
    unfused = cpu_session(model).run(None, feeds)[0]

    report, modified = _fuse(model)

    assert modified, report.refused
    fusion.check(model)
    fused = cpu_session(model).run(None, feeds)[0]
    assert fused.dtype == np.float16
    reference = _reference(op, feeds["a"], feeds["b"], model)
    # one float16 ulp at the output's magnitude (the op adds in float32 without rounding the sum)
    ulp = 2.0**-10 * 2.0 ** np.ceil(np.log2(np.abs(reference).max()))
    assert np.abs(fused.astype(np.float64) - reference).max() <= ulp
    assert np.abs(fused.astype(np.float64) - unfused.astype(np.float64)).max() <= ulp


def _assert_refused(model: ir.Model, code: Code, *detail_parts: str) -> None:
    before = ir.to_proto(model).SerializeToString()
    report, modified = _fuse(model)
    assert not modified
    assert report.fused == []
    assert ir.to_proto(model).SerializeToString() == before
    (refusal,) = report.refused
    assert (refusal.family, refusal.node, refusal.code) == ("skip", "norm", code), refusal
    for part in detail_parts:
        assert part in refusal.detail, refusal.detail


@pytest.mark.parametrize(
    ("op", "shapes", "kwargs", "code", "detail"),
    [
        (
            "LayerNormalization",
            ((B, S, H),) * 2,
            {"norm_attrs": {"axis": -2}, "param_shape": (S, H)},
            Code.NOT_LAST_AXIS,
            "normalizes axes 1..2 of a rank-3 input",
        ),
        ("LayerNormalization", ((B, 3, S, H),) * 2, {}, Code.UNSUPPORTED_RANK, "rank 4"),
        (
            "SimplifiedLayerNormalization",
            ((B, S, H), (B, 1, H)),
            {},
            Code.SHAPE_MISMATCH,
            "shapes (2, 5, 16) and (2, 1, 16)",
        ),
        ("RMSNormalization", ((S, H), (1, H)), {}, Code.SHAPE_MISMATCH, "needs equal shapes"),
        (
            "LayerNormalization",
            ((B, S, H),) * 2,
            {"dtype": TensorProto.DOUBLE},
            Code.UNSUPPORTED_DTYPE,
            "the data type is DOUBLE",
        ),
        (
            "RMSNormalization",
            ((B, S, H),) * 2,
            {"dtype": TensorProto.FLOAT16, "norm_attrs": {"stash_type": 0}},
            Code.STASH_TYPE_ZERO,
            "stash_type=0",
        ),
        (
            "LayerNormalization",
            ((B, S, H),) * 2,
            {"outputs": ("y", "mean"), "norm_outputs": ("y", "mean")},
            Code.STATS_OUTPUTS_USED,
            "statistics outputs are in use",
        ),
        (
            "LayerNormalization",
            (None, (B, S, H)),
            {},
            Code.UNKNOWN_SHAPE,
            "the rank of the LayerNormalization input is unknown",
        ),
    ],
    ids=[
        "two_axes",
        "rank4",
        "broadcast_middle",
        "2d_broadcast",
        "float64",
        "fp16_stash0",
        "mean_used",
        "unknown_shape",
    ],
)
def test_refuses(op, shapes, kwargs, code, detail):
    model = _graph_model(op, shapes, **kwargs)
    _assert_refused(model, code, detail)


def test_bias_add_is_no_candidate():
    """``LayerNorm(x + bias)`` (a Linear's bias, then a norm) has no residual: left alone, and
    not reported either."""
    rng = np.random.default_rng(5)
    params = {k: rng.normal(size=H).astype(np.float32) for k in ("bias", "gamma", "beta")}
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "bias"], ["sum"]),
            helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], name="norm"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, S, H])],
        [numpy_helper.from_array(v, k) for k, v in params.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    model = ir.from_proto(proto)
    before = ir.to_proto(model).SerializeToString()
    report, modified = _fuse(model)
    assert not modified
    assert (report.fused, report.refused) == ([], [])
    assert ir.to_proto(model).SerializeToString() == before
