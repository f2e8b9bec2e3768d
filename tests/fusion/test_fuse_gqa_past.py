"""FuseGroupQueryAttention with a KV cache or a run-time mask: ONNX's Attention and
RotaryEmbedding at opset 23, or, where the model cannot be raised to it, GroupQueryAttention
behind an If whose other branch is the model's own attention; run on ONNX Runtime against the
export it came from at inputs that the op computes and inputs it refuses or computes otherwise
(rows all masked, a batch of chunks after a past)."""

import numpy as np
import onnx_ir as ir
import pytest
import torch

import fusion
from fusion.fuse_gqa import standard
from models.llama import WithPast
from tests.support import decoder_testing as dt
from tests.support.graphs import cpu_session

pytestmark = pytest.mark.slow


def _export_with_past(module: torch.nn.Module, path) -> None:
    """``module``'s decode step (:class:`models.llama.WithPast`) exported by the dynamo exporter
    at ``path``, its batch and lengths symbolic."""
    example = dt.feeds(np.random.default_rng(1), 2, 3, 5, 0)
    dims = {n: torch.export.Dim(n) for n in ("batch", "sequence", "past", "total")}
    shapes = {
        "input_ids": {0: dims["batch"], 1: dims["sequence"]},
        "attention_mask": {0: dims["batch"], 1: dims["total"]},
        "past": tuple({0: dims["batch"], 2: dims["past"]} for _ in dt.CACHE),
    }
    program = torch.onnx.export(
        WithPast(module), tuple(torch.from_numpy(a) for a in example.values()), dynamo=True,
        dynamic_shapes=shapes, input_names=list(example), output_names=["logits", *dt.PRESENT],
    )  # fmt: skip
    program.save(str(path), external_data=True)


def _exported(family: str, export_cache, tmp_path):
    """The path of a copy of the family's decode-step export (:func:`_export_with_past` of
    :func:`tests.support.decoder_testing.causal_lm`, seeded: the same model every time), made
    once per session: several tests read one family's export."""
    folder, _ = export_cache.copy(
        f"gqa-past-{family}",
        lambda to: _export_with_past(dt.causal_lm(family), to / "model.onnx"),
        tmp_path / "export",
    )
    return folder / "model.onnx"


def _optimized(family: str, export_cache, tmp_path):
    """The family's decode-step export, optimized for ONNX Runtime: ``(model, report, path
    of the export, its opset)``."""
    path = _exported(family, export_cache, tmp_path)
    model = ir.load(path)
    opset = model.opset_imports[""]
    return model, fusion.optimize(model, target="ort"), path, opset


def _assert_computes_the_export(model: ir.Model, path) -> None:
    optimized, original = cpu_session(model), cpu_session(ir.load(path))
    rng = np.random.default_rng(0)
    for point in dt.POINTS:
        feeds = dt.feeds(rng, *point)
        for got, expected in zip(
            optimized.run(None, feeds), original.run(None, feeds), strict=True
        ):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5, err_msg=str(point))


def _assert_projections(model: ir.Model, family: str) -> None:
    """A decode step's query, key and value projections are one MatMul (Qwen3 norms q and k
    apart; Phi-3 has one already and its gate and up too)."""
    matmuls = [n for n in model.graph if n.op_type == "MatMul"]
    per_layer = {"llama": 5, "qwen2": 5, "qwen3": 7, "phi3": 4}[family.split("_")[0]]
    assert len(matmuls) == dt.LAYERS * per_layer + 1, len(matmuls)


def _assert_rotation_from_the_frequencies(model: ir.Model) -> None:
    """The rotations read the model's ``f`` of ``cat(f, f)`` expanded to the batch (no
    ``position_ids``); the model's cos and sin of the concatenation are gone."""
    for node in dt.nodes(model, "RotaryEmbedding"):
        assert len(node.inputs) == 3, node
    for node in dt.nodes(model, "Cos") + dt.nodes(model, "Sin"):
        assert node.inputs[0].producer().op_type != "Concat", node


@pytest.mark.parametrize("family", sorted(dt.FAMILIES))
def test_a_decoder_with_its_kv_cache_becomes_onnx_attention_and_computes_the_export_everywhere(
    family, export_cache, tmp_path
):
    model, report, path, opset = _optimized(family, export_cache, tmp_path)
    nodes = dt.nodes(model, "Attention")
    assert report.counts["gqa_fused"] == len(nodes) == dt.LAYERS, report.refused
    assert model.opset_imports[""] == standard.OPSET
    assert any(f"raised from {opset} to 23" in note for note in report.notes), report.notes
    assert len(dt.nodes(model, "RotaryEmbedding")) == 2 * dt.LAYERS
    _assert_rotation_from_the_frequencies(model)
    # raised before the norms: the RMSNorms are ONNX's, the model standard ONNX 23 throughout
    assert len(dt.nodes(model, "RMSNormalization")) == report.counts["rmsnorm_fused"] > 0
    assert fusion.onnxruntime_ops(model) == {}
    packed = [n for n in dt.nodes(model, "Split") if "gqa_qkv" in str(n.inputs[0].producer())]
    assert len(packed) == (dt.LAYERS if family in ("llama", "llama_yarn", "qwen2") else 0)
    assert not dt.nodes(model, "If") and not dt.nodes(model, "GroupQueryAttention")
    assert [v.name for v in model.graph.outputs] == ["logits", *dt.PRESENT]
    for node in nodes:
        assert node.inputs[4].name in dt.CACHE and node.inputs[5].name in dt.CACHE  # the past
        assert node.attributes["is_causal"].value == 0
        assert node.inputs[3] is not None  # the model's mask
    _assert_projections(model, family)
    _assert_computes_the_export(model, path)


@pytest.mark.parametrize("family", sorted(dt.WINDOWED))
def test_sliding_window_caches_and_soft_capped_scores_become_onnx_attention(
    family, export_cache, tmp_path
):
    """A sliding-window cache crops the past before the new keys join it: the keys' length is
    not provably the mask's, which the model adds, so spans them wherever the model runs; ONNX's
    Attention takes the cropped past and the mask. Gemma 2 caps its scores before the mask, as
    ``softcap`` does (Operators.md, Attention-23). Every layer fuses and computes the export."""
    path = _exported(family, export_cache, tmp_path)
    model = ir.load(path)
    report = fusion.optimize(model, target="ort")
    nodes = dt.nodes(model, "Attention")
    assert report.counts["gqa_fused"] == len(nodes) == dt.LAYERS, report.refused
    softcap = 50.0 if family == "gemma2" else 0.0
    assert all(n.attributes.get_float("softcap", 0.0) == softcap for n in nodes)
    _assert_computes_the_export(model, path)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_below_opset_23_groupqueryattention_goes_behind_an_if(
    family, export_cache, tmp_path, monkeypatch
):
    """As for a model whose opset onnxscript's converter does not take (below 18)."""
    monkeypatch.setattr(standard, "convertible", lambda model: False)
    model, report, path, opset = _optimized(family, export_cache, tmp_path)
    nodes = dt.nodes(model, "GroupQueryAttention")
    assert report.counts["gqa_fused"] == len(nodes) == dt.LAYERS, report.refused
    assert model.opset_imports[""] == opset
    assert len([n for n in model.graph if n.op_type == "If"]) == dt.LAYERS
    # the report's "needs ONNX Runtime" line counts the ops inside the If's branches too
    assert fusion.onnxruntime_ops(model)["com.microsoft.GroupQueryAttention"] == dt.LAYERS
    for node in nodes:
        assert node.inputs[3].name in dt.CACHE and node.inputs[4].name in dt.CACHE  # the past
        assert node.attributes["causal"].value == 0 and node.attributes["do_rotary"].value == 1
        packed = node.inputs[1] is None and node.inputs[2] is None  # one MatMul, not three
        assert packed == (family != "qwen3"), node.inputs[:3]
    _assert_projections(model, family)
    _assert_computes_the_export(model, path)


def test_below_opset_23_a_sliding_window_cache_is_refused_with_the_reason(
    export_cache, tmp_path, monkeypatch
):
    """GroupQueryAttention's attention_bias must be as long as the keys; a sliding-window
    cache's mask is not provably so: without ONNX's Attention, the layers stay as they are."""
    monkeypatch.setattr(standard, "convertible", lambda model: False)
    path = _exported("mistral", export_cache, tmp_path)
    model = ir.load(path)
    report = fusion.optimize(model, target="ort", attention=False)
    assert report.counts["gqa_fused"] == 0
    reasons = [r.detail for r in report.refused if r.family == "gqa"]
    assert len(reasons) == dt.LAYERS and all("sliding-window" in r for r in reasons), reasons
    _assert_computes_the_export(model, path)


def test_under_skip_kv_cache_a_model_with_a_kv_cache_gets_the_skip_ops(export_cache, tmp_path):
    """``skip="kv_cache"`` (the CPU provider's choice, with ``gqa`` and no transposed SDPA):
    a decode step's residual Adds and RMSNorms become SkipSimplifiedLayerNormalization (a model
    without a cache keeps them: the explain tests, test_explain.py)."""
    path = _exported("llama", export_cache, tmp_path)
    model = ir.load(path)
    report = fusion.optimize(model, target="ort", skip="kv_cache", gqa=True, sdpa_transposed=False)
    assert report.counts["skip_fused"] == len(dt.nodes(model, "SkipSimplifiedLayerNormalization"))
    assert report.counts["skip_fused"] == 2 * dt.LAYERS  # before attention and MLP, one per layer
    _assert_computes_the_export(model, path)


def test_a_decode_step_matches_pytorch_and_keeps_the_cache_layout(export_cache, tmp_path):
    module = dt.causal_lm("llama")  # the model the cached export came from (seeded)
    path = _exported("llama", export_cache, tmp_path)
    model = ir.load(path)
    fusion.optimize(model, target="ort")
    feeds = dt.feeds(np.random.default_rng(2), 2, 1, 9, 4)
    got = cpu_session(model).run(None, feeds)
    with torch.no_grad():
        expected = WithPast(module)(*(torch.from_numpy(a) for a in feeds.values()))
    assert got[1].shape == (2, dt.COMMON["num_key_value_heads"], 10, 16)
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-4, atol=2e-5)


class Masked(torch.nn.Module):
    """A causal LM's logits for ``input_ids`` and a padding ``attention_mask``, no cache."""

    def __init__(self):
        super().__init__()
        self.model = dt.causal_lm("llama")

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def test_a_prefill_with_an_attention_mask_input_takes_the_mask_as_the_ops_bias(tmp_path):
    path = tmp_path / "model.onnx"
    feeds = dt.feeds(np.random.default_rng(3), 2, 6, 0, 0)
    example = tuple(torch.from_numpy(feeds[n]) for n in ("input_ids", "attention_mask"))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    torch.onnx.export(
        Masked(), example, str(path), dynamo=True, input_names=["input_ids", "attention_mask"],
        dynamic_axes=axes,
    )  # fmt: skip
    model = ir.load(path)
    report = fusion.optimize(model, target="ort")
    nodes = dt.nodes(model, "Attention")
    assert report.counts["gqa_fused"] == len(nodes) == dt.LAYERS, report.refused
    assert all(n.inputs[3] is not None for n in nodes)  # the model's mask, as computed
    optimized, original = cpu_session(model), cpu_session(ir.load(path))
    rng = np.random.default_rng(4)
    for batch, length, padding in ((2, 6, 0), (3, 9, 4), (1, 5, 0)):  # 4: rows all masked
        feeds = dt.feeds(rng, batch, length, 0, padding)
        feeds = {n: feeds[n] for n in ("input_ids", "attention_mask")}
        (got,), (expected,) = optimized.run(None, feeds), original.run(None, feeds)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5)
