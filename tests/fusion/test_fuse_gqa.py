"""FuseGroupQueryAttention: decoder attention with its rotary embedding made one
com.microsoft GroupQueryAttention, run on ONNX Runtime against PyTorch."""

import functools
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import transformers

import fusion
from tests.support import exported
from tests.support.graphs import cpu_session

pytestmark = pytest.mark.slow

HIDDEN, HEADS, KV_HEADS, HEAD = 64, 4, 2, 16
COMMON = {
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaModel, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3Model, {"head_dim": HEAD}),
    "gemma": (transformers.GemmaConfig, transformers.GemmaModel, {"head_dim": HEAD}),
    # its logits soft-capped, 50 * tanh(scores / 50): the ops' softcap
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2Model,
        {"head_dim": HEAD, "query_pre_attn_scalar": HEAD, "attn_logit_softcapping": 50.0},
    ),
    "mistral": (transformers.MistralConfig, transformers.MistralModel, {"sliding_window": 4096}),
    "phi3": (transformers.Phi3Config, transformers.Phi3Model, {"pad_token_id": 0}),
}
IDS = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(2, 16))


class Hidden(torch.nn.Module):
    """A transformers decoder returning its last hidden state, every norm weight random."""

    def __init__(self, family: str):
        super().__init__()
        config, model, extra = FAMILIES[family]
        torch.manual_seed(0)
        self.model = model(config(**COMMON, **extra)).eval()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "norm" in name:  # Gemma scales by 1 + w, the others by w
                    p.copy_(0.3 * torch.randn_like(p) + (not family.startswith("gemma")))

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


def _export(module, args, names, **kwargs) -> ir.Model:
    tensors = [torch.from_numpy(a) for a in args]
    return exported.export(module, tensors, input_names=names, **kwargs)


def _fixed_length(family: str) -> ir.Model:
    """A copy of :class:`Hidden` ``(family)``'s export at :data:`IDS`' size, each call its own
    (the export, seconds, made once per family: several tests start from llama's)."""
    return ir.serde.deserialize_model(_fixed_length_proto(family))


@functools.cache
def _fixed_length_proto(family: str) -> onnx.ModelProto:
    return ir.serde.serialize_model(_export(Hidden(family), [IDS], ["input_ids"]))


def _gqa_nodes(model: ir.Model) -> list[ir.Node]:
    """The ops, in the main graph or in the branch of an If that guards them."""
    nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    return [n for n in nodes if n.op_type == "GroupQueryAttention"]


def _assert_onnx_accepts(model: ir.Model) -> None:
    """ONNX's own shape inference takes the model (it refuses a com.microsoft node, in a
    branch too, that the model does not import the domain of; ORT runs it all the same)."""
    assert model.opset_imports.get("com.microsoft") == 1, model.opset_imports
    onnx.shape_inference.infer_shapes(ir.serde.serialize_model(model))


def _assert_matches_torch(module, model, feeds):
    with torch.no_grad():
        expected = module(*(torch.from_numpy(a) for a in feeds.values())).numpy()
    (got,) = cpu_session(model).run(None, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decoders_exported_at_a_fixed_length_get_one_op_per_layer_and_are_exact(family):
    module = Hidden(family)
    model = _fixed_length(family)
    report = fusion.optimize(model, target="ort")
    nodes = _gqa_nodes(model)
    assert report.counts["gqa_fused"] == len(nodes) == COMMON["num_hidden_layers"], report
    assert not [n for n in model.graph if n.op_type in ("Softmax", "MultiHeadAttention")]
    for node in nodes:
        attributes = {k: a.value for k, a in node.attributes.items()}
        assert attributes["num_heads"] == HEADS and attributes["kv_num_heads"] == KV_HEADS
        assert attributes["do_rotary"] == 1 and attributes["causal"] == 1
        assert math.isclose(attributes["scale"], HEAD**-0.5, rel_tol=1e-6)
        assert attributes.get("softcap", 0.0) == (50.0 if family == "gemma2" else 0.0)
        packed = node.inputs[1] is None and node.inputs[2] is None  # Phi-3's qkv_proj as is
        assert packed == (family == "phi3"), node.inputs[:3]
    _assert_onnx_accepts(model)
    _assert_matches_torch(module, model, {"input_ids": IDS})


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_symbolic_lengths_get_the_models_own_rotation_and_are_exact_at_other_sizes(family):
    module = Hidden(family)
    axes = {"input_ids": {0: "batch", 1: "sequence"}}
    model = _export(module, [IDS], ["input_ids"], dynamic_axes=axes)
    report = fusion.optimize(model, target="ort")
    assert report.counts["gqa_fused"] == len(_gqa_nodes(model)) == 2, report.refused
    assert not [n for n in model.graph if n.op_type in ("Softmax", "LessOrEqual")]  # mask gone
    _assert_onnx_accepts(model)
    session = cpu_session(model)
    for batch, length in ((2, 16), (1, 5), (3, 23)):  # 23: longer than the export's
        ids = np.random.default_rng(length).integers(0, COMMON["vocab_size"], (batch, length))
        with torch.no_grad():
            expected = module(torch.from_numpy(ids)).numpy()
        (got,) = session.run(None, {"input_ids": ids})
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_sliding_window_beyond_the_sizes_checked_is_not_taken_for_causal():
    """Mistral's window of 4096 is causal below 4096 tokens, not above: the mask is not made
    causal but passed as it is computed, the mask of ONNX's Attention (opset 23)."""
    module = Hidden("mistral")
    axes = {"input_ids": {0: "batch", 1: "sequence"}}
    model = _export(module, [IDS], ["input_ids"], dynamic_axes=axes)
    report = fusion.optimize(model, target="ort")
    nodes = [n for n in model.graph if n.op_type == "Attention"]
    assert report.counts["gqa_fused"] == len(nodes) == 2, report.refused
    assert model.opset_imports[""] == 23
    for node in nodes:
        assert node.attributes["is_causal"].value == 0
        assert node.inputs[3] is not None and node.inputs[3].const_value is None
    for batch, length in ((2, 16), (1, 5)):
        ids = np.random.default_rng(length).integers(0, COMMON["vocab_size"], (batch, length))
        _assert_matches_torch(module, model, {"input_ids": ids})


class Logits(torch.nn.Module):
    """transformers' LlamaForCausalLM's logits, no cache: its mask also derives the positions
    from the sizes (a subgraph of some 60 nodes), and an export at batch 1 specializes it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**COMMON)
        self.model = transformers.LlamaForCausalLM(config).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_a_causal_lm_mask_is_evaluated_at_sizes_in_a_batch_1_export_too():
    """The batch-1 export's mask, once the export's clean-up has the inferred types
    (``fusion.cleanup.cleanup_with_types``), is the causal one at every size: fused, exact."""
    module = Logits()
    axes = {"input_ids": {0: "batch", 1: "sequence"}}
    model = _export(module, [IDS], ["input_ids"], dynamic_axes=axes)
    assert fusion.optimize(model, target="ort").counts["gqa_fused"] == 2
    _assert_matches_torch(module, model, {"input_ids": IDS[:, :9].repeat(2, 0)})
    one = _export(module, [IDS[:1]], ["input_ids"], dynamic_axes=axes)
    report = fusion.optimize(one, target="ort")
    assert report.counts["gqa_fused"] == 2 and not report.refused
    _assert_matches_torch(module, one, {"input_ids": IDS[:1, :9]})


def test_torch_onnx_export_with_dynamic_axes_as_users_call_it(tmp_path):
    """``torch.onnx.export(dynamo=True, dynamic_axes=...)`` leaves the key's Reshapes with no
    dimension known; FillShapes fills them from inference and the attention is fused."""
    module = Logits()
    path = tmp_path / "model.onnx"
    program = torch.onnx.export(
        module, (torch.from_numpy(IDS),), dynamo=True, input_names=["input_ids"],
        output_names=["logits"], dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}},
    )  # fmt: skip
    program.save(str(path))
    model = ir.load(path)
    assert fusion.optimize(model, target="ort").counts["gqa_fused"] == 2
    _assert_matches_torch(module, model, {"input_ids": IDS[:1, :11]})


def test_opting_out_and_the_portable_target_and_cuda_keep_the_attention():
    for target, options in (("ort", {"gqa": False}), ("onnx", {})):
        model = _fixed_length("llama")
        report = fusion.optimize(model, target=target, attention=False, **options)
        assert report.counts["gqa_fused"] == 0 and not _gqa_nodes(model)
    with pytest.raises(ValueError, match="target='ort'"):
        fusion.optimize(_fixed_length("llama"), target="onnx", gqa=True)


class HandAttention(torch.nn.Module):
    """Attention written out as the transformers models write it, with rotary tables and a
    mask given as constants: ``cos``/``sin`` ``(S, H)``, ``mask`` ``(S, S)`` additive or None.
    """

    def __init__(self, cos, sin, mask):
        super().__init__()
        torch.manual_seed(1)
        self.q = torch.nn.Linear(HIDDEN, HEADS * HEAD)
        self.k = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD, bias=False)
        self.v = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD, bias=False)
        self.register_buffer("cos", torch.as_tensor(cos))
        self.register_buffer("sin", torch.as_tensor(sin))
        self.mask = None if mask is None else torch.as_tensor(mask)

    @staticmethod
    def _rotate_half(x):
        return torch.cat((-x[..., HEAD // 2 :], x[..., : HEAD // 2]), dim=-1)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD).transpose(1, 2)
        k = self.k(x).view(b, s, KV_HEADS, HEAD).transpose(1, 2)
        v = self.v(x).view(b, s, KV_HEADS, HEAD).transpose(1, 2)
        q = q * self.cos + self._rotate_half(q) * self.sin
        k = k * self.cos + self._rotate_half(k) * self.sin
        repeat = HEADS // KV_HEADS
        k = k[:, :, None].expand(b, KV_HEADS, repeat, s, HEAD).reshape(b, HEADS, s, HEAD)
        v = v[:, :, None].expand(b, KV_HEADS, repeat, s, HEAD).reshape(b, HEADS, s, HEAD)
        scores = q @ k.transpose(-1, -2) * HEAD**-0.5
        if self.mask is not None:
            scores = scores + self.mask
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, HEADS * HEAD)


SEQ = 12
_angles = np.arange(SEQ)[:, None] / 10000 ** (np.arange(0, HEAD, 2) / HEAD)
ROPE = [np.concatenate([f(_angles)] * 2, axis=-1).astype(np.float32) for f in (np.cos, np.sin)]
CAUSAL = np.triu(np.full((SEQ, SEQ), np.finfo(np.float32).min, np.float32), 1)
WINDOW = CAUSAL + np.tril(np.full((SEQ, SEQ), -np.inf, np.float32), -4)
X = np.random.default_rng(2).standard_normal((2, SEQ, HIDDEN)).astype(np.float32)


def _hand(cos, sin, mask):
    module = HandAttention(cos, sin, mask).eval()
    model = _export(module, [X], ["x"])
    return module, model, fusion.optimize(model, target="ort")


@pytest.mark.parametrize(
    ("mask", "causal", "bias"),
    [(CAUSAL, 1, False), (None, 0, False), (WINDOW, 0, True)],
    ids=["causal", "no_mask", "sliding_window"],
)
def test_the_mask_becomes_causal_or_none_or_the_ops_bias(mask, causal, bias):
    module, model, report = _hand(*ROPE, mask)
    (node,) = _gqa_nodes(model)
    assert report.counts["gqa_fused"] == 1
    assert node.attributes["causal"].value == causal
    assert (len(node.inputs) > 10 and node.inputs[10] is not None) == bias
    _assert_matches_torch(module, model, {"x": X})


def test_rotary_tables_whose_halves_differ_are_not_the_ops_rotation():
    rng = np.random.default_rng(3)
    cos, sin = (rng.standard_normal((SEQ, HEAD)).astype(np.float32) for _ in range(2))
    module, model, report = _hand(cos, sin, CAUSAL)
    assert report.counts["gqa_fused"] == 0 and not _gqa_nodes(model)
    assert [(r.family, r.code) for r in report.refused] == [("gqa", "not_per_channel")]
    _assert_matches_torch(module, model, {"x": X})


def test_a_mask_with_a_row_all_masked_is_left_alone():
    mask = CAUSAL.copy()
    mask[3] = -np.inf  # softmax of that row is NaN in the model; the op would differ
    _, model, report = _hand(*ROPE, mask)
    assert report.counts["gqa_fused"] == 0
    assert [(r.family, r.code) for r in report.refused] == [("gqa", "shape_mismatch")]


class CrossAttention(torch.nn.Module):
    """Queries from ``x`` (B, S, D), keys and values from ``y`` (B, T, D), causal over the last
    S of the T keys: no rotation, a causal mask, T != S."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.q, self.k, self.v = (torch.nn.Linear(HIDDEN, HEADS * HEAD) for _ in range(3))

    def forward(self, x, y):
        b, s, _ = x.shape
        t = y.shape[1]
        q = self.q(x).view(b, s, HEADS, HEAD).transpose(1, 2)
        k = self.k(y).view(b, t, HEADS, HEAD).transpose(1, 2)
        v = self.v(y).view(b, t, HEADS, HEAD).transpose(1, 2)
        mask = torch.triu(torch.full((s, t), float("-inf")), 1 + t - s)
        out = torch.softmax(q @ k.transpose(-1, -2) * HEAD**-0.5 + mask, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, HEADS * HEAD)


def test_keys_of_another_length_than_the_queries_are_left_alone():
    y = np.random.default_rng(5).standard_normal((2, SEQ + 4, HIDDEN)).astype(np.float32)
    model = _export(CrossAttention().eval(), [X, y], ["x", "y"])
    report = fusion.optimize(model, target="ort")
    assert report.counts["gqa_fused"] == 0
    assert [(r.family, r.code) for r in report.refused] == [("gqa", "shape_mismatch")]


def test_unknown_dimensions_do_not_prove_a_key_transposed():
    """onnx_ir's ``==`` takes two unknown dimensions for equal; the matcher must not: the
    Reshapes' unknown axes may be any sizes."""
    from fusion.fuse_gqa import parts

    key = ir.Value(name="k", shape=ir.Shape([None, 4, None, 16]))
    inner = ir.node("Reshape", [key, ir.Value(name="t1")])
    transpose = ir.node("Transpose", [inner.outputs[0]], {"perm": [0, 2, 1]})
    outer = ir.node("Reshape", [transpose.outputs[0], ir.Value(name="t2")])
    inner.outputs[0].shape = ir.Shape([None, None, 16])
    outer.outputs[0].shape = ir.Shape([None, 4, 16, None])
    assert parts.transposed_key(outer.outputs[0]) is None
    key.shape = ir.Shape(["b", 4, "s", 16])  # the same graph with the axes named
    inner.outputs[0].shape = ir.Shape([None, "s", 16])
    outer.outputs[0].shape = ir.Shape(["b", 4, 16, "s"])
    assert parts.transposed_key(outer.outputs[0]) == (key, [outer, transpose, inner])
