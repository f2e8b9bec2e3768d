"""FuseGroupQueryAttention on a decoder that takes its ``position_ids`` (Optimum's and
``generate``'s inputs): the rotary tables differ per batch row, which only ONNX's
``RotaryEmbedding`` takes (3-D caches, one row per batch row and position). Run on ONNX Runtime
against the export at positions as ``generate`` makes them under left padding and at arbitrary
ones."""

import numpy as np
import onnx_ir as ir
import pytest
import torch

import fusion
from models.llama import WithPositions
from tests.support import decoder_testing as dt
from tests.support.graphs import cpu_session

pytestmark = pytest.mark.slow

NAMES = ["input_ids", "attention_mask", "position_ids", *dt.CACHE]


def _with_positions(feeds: dict, positions: np.ndarray) -> dict[str, np.ndarray]:
    ordered = {n: feeds[n] for n in ("input_ids", "attention_mask")}
    return {**ordered, "position_ids": positions, **{n: feeds[n] for n in dt.CACHE}}


def _generate_positions(mask: np.ndarray, length: int) -> np.ndarray:
    """``generate``'s positions of the last ``length`` tokens: the count of attended tokens
    before each, 0 over the padding."""
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -length:]


#: Optimum's names of the symbolic axes (its TorchScript export of a decoder with past).
OPTIMUM_AXES = {
    "input_ids": {0: "batch_size", 1: "sequence_length"},
    "attention_mask": {0: "batch_size", 1: "past_sequence_length + sequence_length"},
    "position_ids": {0: "batch_size", 1: "sequence_length"},
    **{name: {0: "batch_size", 2: "past_sequence_length"} for name in dt.CACHE},
    "logits": {0: "batch_size", 1: "sequence_length"},
    **{name: {0: "batch_size", 2: "past_sequence_length + sequence_length"} for name in dt.PRESENT},
}


def _export(path, family: str, dynamo: bool) -> None:
    """The decoder of ``family`` with ``position_ids``, exported by torch.onnx's dynamo exporter
    (symbolic shapes everywhere) or by its TorchScript exporter as Optimum runs it
    (``dynamic_axes``; no intermediate shapes, the head count written as ``-1``)."""
    feeds = dt.feeds(np.random.default_rng(1), 2, 3, 5, 0)
    example = _with_positions(feeds, np.tile(np.arange(5, 8), (2, 1)))
    args = (
        WithPositions(dt.causal_lm(family)),
        tuple(torch.from_numpy(a) for a in example.values()),
    )
    names = {"input_names": NAMES, "output_names": ["logits", *dt.PRESENT]}
    if not dynamo:
        torch.onnx.export(*args, str(path), dynamo=False, dynamic_axes=OPTIMUM_AXES, **names)
        return
    dims = {n: torch.export.Dim(n) for n in ("batch", "sequence", "past", "total")}
    shapes = {
        "input_ids": {0: dims["batch"], 1: dims["sequence"]},
        "attention_mask": {0: dims["batch"], 1: dims["total"]},
        "position_ids": {0: dims["batch"], 1: dims["sequence"]},
        "past": tuple({0: dims["batch"], 2: dims["past"]} for _ in dt.CACHE),
    }
    program = torch.onnx.export(*args, dynamo=True, dynamic_shapes=shapes, **names)
    program.save(str(path), external_data=True)


@pytest.mark.parametrize(
    "family, dynamo",
    [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", False), ("phi3", False)],
)
def test_tables_per_batch_row_become_rotary_embedding_caches_and_compute_the_export(
    tmp_path, family, dynamo
):
    path = tmp_path / "model.onnx"
    _export(path, family, dynamo)
    model = ir.load(path)
    report = fusion.optimize(model, target="ort")
    assert report.counts["gqa_fused"] == len(dt.nodes(model, "Attention")) == dt.LAYERS, (
        report.refused
    )
    rotations = dt.nodes(model, "RotaryEmbedding")
    assert len(rotations) == 2 * dt.LAYERS
    for node in rotations:  # (B, S, H/2) caches of the model's own rows: no position_ids
        assert len(node.inputs) == 3 and node.inputs[1].producer().op_type != "Expand"
    optimized, original = cpu_session(model), cpu_session(ir.load(path))
    rng = np.random.default_rng(5)
    for batch, length, past, padding in dt.POINTS:
        feeds = dt.feeds(rng, batch, length, past, padding)
        arbitrary = rng.integers(0, dt.COMMON["max_position_embeddings"], (batch, length))
        for positions in (_generate_positions(feeds["attention_mask"], length), arbitrary):
            inputs = _with_positions(feeds, positions)
            for got, want in zip(
                optimized.run(None, inputs), original.run(None, inputs), strict=True
            ):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=str(positions))


class Prefill(torch.nn.Module):
    """Logits of ``input_ids`` at ``position_ids``, no cache and no mask input: a causal mask
    computed from the sizes, which GroupQueryAttention would take, not ONNX's Attention."""

    def __init__(self):
        super().__init__()
        self.model = dt.causal_lm("llama")

    def forward(self, input_ids, position_ids):
        return self.model(input_ids=input_ids, position_ids=position_ids).logits


def test_tables_per_batch_row_without_a_cache_or_mask_are_refused_with_the_reason(tmp_path):
    path = tmp_path / "model.onnx"
    ids, positions = torch.zeros(2, 6, dtype=torch.int64), torch.arange(6).repeat(2, 1)
    axes = {name: {0: "batch", 1: "sequence"} for name in ("input_ids", "position_ids")}
    torch.onnx.export(
        Prefill(), (ids, positions), str(path), dynamo=True, dynamic_axes=axes,
        input_names=list(axes),
    )  # fmt: skip
    model = ir.load(path)
    report = fusion.optimize(model, target="ort", attention=False)
    assert report.counts["gqa_fused"] == 0
    reasons = [r.detail for r in report.refused if r.family == "gqa"]
    assert len(reasons) == dt.LAYERS and all("position_ids" in r for r in reasons), reasons
