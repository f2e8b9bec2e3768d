"""pack_attention: MultiHeadAttention over three projections of one input made Attention with
packed weights, run on ONNX Runtime against the graph it came from."""

import numpy as np
import onnx_ir as ir
import pytest
import torch
import transformers

import fusion
from tests.support import exported
from tests.support.graphs import cpu_session

HIDDEN, HEADS = 64, 4
FLOAT = ir.TensorType(ir.DataType.FLOAT)


def _const(graph_inits: list, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(
        ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array, name=name))  # fmt: skip
    graph_inits.append(value)
    return value


def _mha_model(cross: bool, with_bias: bool, padding_mask: bool) -> ir.Model:
    """``MultiHeadAttention(x Wq + bq, heads(kv Wk + bk), heads(kv Wv + bv))``, random weights,
    ``kv`` the query's input ``x`` unless ``cross``; an additive ``attention_bias`` input where
    ``with_bias``, a ``key_padding_mask`` where ``padding_mask``."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", shape=ir.Shape(["B", "S", HIDDEN]), type=FLOAT)
    inputs, inits, nodes = [x], [], []
    source = x
    if cross:
        source = ir.Value(name="y", shape=ir.Shape(["B", "S", HIDDEN]), type=FLOAT)
        inputs.append(source)
    split = _const(inits, "split", np.array([0, 0, HEADS, HIDDEN // HEADS]))
    projected = []
    for index, name in enumerate("qkv"):
        weight = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32) / 8
        bias = rng.standard_normal(HIDDEN).astype(np.float32)
        matmul = ir.node("MatMul", [x if index == 0 else source, _const(inits, f"W{name}", weight)])
        add = ir.node("Add", [matmul.outputs[0], _const(inits, f"b{name}", bias)])
        nodes += [matmul, add]
        out = add.outputs[0]
        out.shape, out.type = ir.Shape(["B", "S", HIDDEN]), FLOAT
        if index:  # key and value split into the op's heads
            reshape = ir.node("Reshape", [out, split])
            reshape.outputs[0].shape = ir.Shape(["B", "S", HEADS, HIDDEN // HEADS])
            reshape.outputs[0].type = FLOAT
            transpose = ir.node("Transpose", [reshape.outputs[0]], {"perm": [0, 2, 1, 3]})
            transpose.outputs[0].shape = ir.Shape(["B", HEADS, "S", HIDDEN // HEADS])
            transpose.outputs[0].type = FLOAT
            nodes += [reshape, transpose]
            out = transpose.outputs[0]
        projected.append(out)
    extra = [None, None, None]
    if padding_mask:
        extra[1] = ir.Value(name="mask", shape=ir.Shape(["B", "S"]), type=ir.TensorType(
            ir.DataType.INT32))  # fmt: skip
        inputs.append(extra[1])
    if with_bias:
        extra[2] = ir.Value(name="bias", shape=ir.Shape([1, 1, "S", "S"]), type=FLOAT)
        inputs.append(extra[2])
    mha = ir.node(
        "MultiHeadAttention", [*projected, *extra], {"num_heads": HEADS, "scale": 0.3},
        domain="com.microsoft",
    )  # fmt: skip
    mha.outputs[0].name = "out"
    graph = ir.Graph(
        inputs, mha.outputs, nodes=[*nodes, mha], initializers=inits,
        opset_imports={"": 18, "com.microsoft": 1},
    )  # fmt: skip
    return ir.Model(graph, ir_version=8)


def _feeds(model: ir.Model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    feeds = {}
    for value in model.graph.inputs:
        if value.name == "mask":
            feeds["mask"] = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
        elif value.name == "bias":
            feeds["bias"] = np.triu(np.full((1, 1, 5, 5), -1e4, np.float32), 1)
        else:
            feeds[value.name] = rng.standard_normal((2, 5, HIDDEN)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("with_bias", [False, True])
def test_self_attention_over_projections_of_one_input_is_packed_and_exact(with_bias):
    model = _mha_model(cross=False, with_bias=with_bias, padding_mask=False)
    feeds = _feeds(model)
    (before,) = cpu_session(model).run(None, feeds)
    fusion.optimize(model, target="ort")
    ops = [n.op_type for n in model.graph]
    assert ops.count("Attention") == 1 and "MultiHeadAttention" not in ops, ops
    assert "MatMul" not in ops  # the three projections are the op's one GEMM
    (node,) = [n for n in model.graph if n.op_type == "Attention"]
    assert node.attributes["scale"].value == pytest.approx(0.3)
    assert (len(node.inputs) > 5 and node.inputs[5] is not None) == with_bias
    (after,) = cpu_session(model).run(None, feeds)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("cross", "padding_mask"), [(True, False), (False, True)])
def test_cross_attention_and_a_key_padding_mask_keep_multi_head_attention(cross, padding_mask):
    model = _mha_model(cross=cross, with_bias=False, padding_mask=padding_mask)
    feeds = _feeds(model)
    (before,) = cpu_session(model).run(None, feeds)
    fusion.optimize(model, target="ort")
    ops = [n.op_type for n in model.graph]
    assert "Attention" not in ops and ops.count("MultiHeadAttention") == 1, ops
    (after,) = cpu_session(model).run(None, feeds)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_vit_exported_by_torch_gets_packed_attention_and_stays_exact():
    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=32, patch_size=8,
    )  # fmt: skip
    torch.manual_seed(0)
    module = transformers.ViTModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layernorm" in name or "bias" in name:
                p.copy_(0.3 * torch.randn_like(p) + ("weight" in name))
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    model = exported.export(
        module, [torch.from_numpy(pixels)], input_names=["pixel_values"],
        dynamic_axes={"pixel_values": {0: "batch"}},
    )  # fmt: skip
    report = fusion.optimize(model, target="ort")
    attention = [n for n in model.graph if n.op_type == "Attention"]
    assert report.counts["attention_fused"] == len(attention) == 2, report
    with torch.no_grad():
        expected = module(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()
    (got,) = cpu_session(model).run(None, {"pixel_values": pixels})
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
