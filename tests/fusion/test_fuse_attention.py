"""FuseAttention: onnxscript's attention and GELU rules, run after the norm passes (ORT only)."""

import numpy as np
import onnx_ir as ir
import pytest
import torch

import fusion
from tests.support import exported
from tests.support.encoders import TinyBert, export_tiny_bert, tiny_bert_feeds
from tests.support.graphs import cpu_session

pytestmark = pytest.mark.slow


def _contrib_ops(model: ir.Model) -> list[str]:
    return sorted(n.op_type for n in model.graph if n.domain == "com.microsoft")


def test_bert_layer_attention_and_gelu_fused_and_exact():
    module = TinyBert()
    model = export_tiny_bert(module)
    report = fusion.optimize(model, target="ort")
    assert report.counts["attention_fused"] == 1, _contrib_ops(model)
    assert report.counts["gelu_fused"] == 1, _contrib_ops(model)
    assert {"Attention", "MultiHeadAttention"} & set(_contrib_ops(model))
    assert report.counts["layernorm_fused"] == 0  # BERT's LayerNorms are exported as one op
    fusion.check(model)
    session = cpu_session(model)
    for batch, seq in ((3, 8), (1, 5)):  # also another size than the export's
        feeds = {k: v[:batch, :seq] for k, v in tiny_bert_feeds().items()}
        with torch.no_grad():
            expected = module(*(torch.from_numpy(a) for a in feeds.values())).numpy()
        (got,) = session.run(None, feeds)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5)


def test_portable_target_keeps_attention_unfused():
    model = export_tiny_bert(TinyBert())
    report = fusion.optimize(model, target="onnx")
    assert report.counts["attention_fused"] == 0 and report.counts["gelu_fused"] == 0
    assert _contrib_ops(model) == []
    with pytest.raises(ValueError, match="target='ort'"):
        fusion.optimize(model, target="onnx", attention=True)


def test_opting_out_keeps_attention_unfused():
    """``attention=False`` leaves the attention; the GELU (its own pass) is still one op."""
    model = export_tiny_bert(TinyBert())
    report = fusion.optimize(model, target="ort", attention=False)
    assert report.counts["attention_fused"] == 0 and report.counts["gelu_fused"] == 1
    assert _contrib_ops(model) == ["BiasGelu"]


class TinyEpsDivide(torch.nn.Module):
    """Not a norm: an L1 row scaling with eps 1e-8, the constant onnxscript's own optimizer
    takes for zero and deletes (docs/model-files.md, "How the export is done")."""

    def forward(self, x):
        return x / (x.abs().sum(-1, keepdim=True) + 1e-8)


def test_an_eps_of_1e_8_outside_any_norm_survives():
    x = torch.zeros(2, 4, 8)
    model = exported.export(TinyEpsDivide(), [x], input_names=["x"])
    fusion.optimize(model, target="ort")
    (got,) = cpu_session(model).run(None, {"x": x.numpy()})
    assert np.isfinite(got).all() and not got.any()  # 0 / (0 + 1e-8) = 0, not NaN


def test_llama_attention_takes_key_and_value_split_into_heads_and_is_exact():
    from models.llama import CONFIG, TinyLlama

    module = TinyLlama()
    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], size=(2, 16))
    model = exported.export(
        module, [torch.from_numpy(ids)], input_names=["input_ids"],
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
    )  # fmt: skip
    report = fusion.optimize(model, target="ort", gqa=False)  # GroupQueryAttention's otherwise
    mhas = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
    assert report.counts["attention_fused"] == len(mhas) == CONFIG["num_hidden_layers"]
    for mha in mhas:  # (B, N, L, H), not a Reshape of a Transpose back to (B, L, N*H)
        for kv in mha.inputs[1:3]:
            assert kv.shape is not None and len(kv.shape) == 4, kv
            assert kv.shape[1] == CONFIG["num_attention_heads"], kv
    session = cpu_session(model)
    for batch, seq in ((2, 16), (3, 7)):
        feeds = {"input_ids": ids[:1].repeat(batch, 0)[:, :seq].copy()}
        feeds["input_ids"][-1] = ids[1, :seq]
        with torch.no_grad():
            expected = module(torch.from_numpy(feeds["input_ids"])).numpy()
        (got,) = session.run(None, feeds)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _mha_on_split_key_value(heads_in_source: int) -> ir.Model:
    """MultiHeadAttention (4 heads, hidden 64) whose key and value are
    ``Reshape(Transpose(x, [0, 2, 1, 3]), [0, 0, -1])`` of x (B, heads_in_source, L, 64 / n)."""
    head = 64 // heads_in_source
    q = ir.Value(name="q", shape=ir.Shape(["B", "S", 64]), type=ir.TensorType(ir.DataType.FLOAT))
    k4, v4 = (
        ir.Value(
            name=name,
            shape=ir.Shape(["B", heads_in_source, "L", head]),
            type=ir.TensorType(ir.DataType.FLOAT),
        )
        for name in ("k", "v")
    )
    to_3d = ir.Value(name="to_3d", const_value=ir.tensor(np.array([0, 0, -1], dtype=np.int64)))
    nodes, flat = [], []
    for x in (k4, v4):
        transpose = ir.node("Transpose", [x], attributes={"perm": [0, 2, 1, 3]})
        reshape = ir.node("Reshape", [transpose.outputs[0], to_3d])
        nodes += [transpose, reshape]
        flat.append(reshape.outputs[0])
    mha = ir.node(
        "MultiHeadAttention", [q, *flat], attributes={"num_heads": 4}, domain="com.microsoft"
    )
    mha.outputs[0].name = "out"
    graph = ir.Graph(
        [q, k4, v4], mha.outputs, nodes=[*nodes, mha], initializers=[to_3d],
        opset_imports={"": 18, "com.microsoft": 1},
    )  # fmt: skip
    return ir.Model(graph, ir_version=8)


@pytest.mark.parametrize("heads_in_source", [4, 2])
def test_key_value_split_into_heads_passed_only_when_the_split_is_the_ops(heads_in_source):
    model = _mha_on_split_key_value(heads_in_source)
    rng = np.random.default_rng(0)
    feeds = {
        "q": rng.standard_normal((2, 5, 64), dtype=np.float32),
        "k": rng.standard_normal((2, heads_in_source, 7, 64 // heads_in_source), np.float32),
        "v": rng.standard_normal((2, heads_in_source, 7, 64 // heads_in_source), np.float32),
    }
    (before,) = cpu_session(model).run(None, feeds)
    fusion.optimize(model, target="ort")
    mha = next(n for n in model.graph if n.op_type == "MultiHeadAttention")
    passed = [kv.name for kv in mha.inputs[1:3]] == ["k", "v"]
    # 2 heads of 32 in x are not the op's 4 heads of 16: passing x would change the function
    assert passed == (heads_in_source == 4)
    assert sum(n.op_type == "Transpose" for n in model.graph) == (0 if passed else 2)
    (after,) = cpu_session(model).run(None, feeds)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
