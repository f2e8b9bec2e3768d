"""The benchmark size of ``tools/make_exporter_files.py`` (its ``--bench``): larger models, each
built with the framework's own layers and exported with a symbolic batch axis.

This module only builds them: each framework's list gives, per file, a function that builds the
model from a seed (each layer's own random initializer), the input shape it is exported at and a
description. ``make_exporter_files.py`` randomizes the norms and biases, exports, checks and
records them, as it does its test files. Nothing here imports a framework until a model is
built, so each list can be read in any environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

HIDDEN, HEADS, FFN, SEQ, BLOCKS = 256, 4, 1024, 128, 4
IMAGE = (224, 224)  # the Keras and Paddle CNNs' input size; the Flax CNN's is 64 x 64


class BenchModel(NamedTuple):
    """One benchmark file: its name, its model, its exported input shape, its description."""

    name: str
    build: Callable[[int], Any]  # the seed -> the model (its initializers' weights)
    shape: tuple  # batch symbolic (None, or jax2onnx's "B"); checked at batch 1
    description: str


_ENCODER = f"{BLOCKS} blocks, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, FFN {FFN}"


# --------------------------------------------------------------------------------------------
# TensorFlow: Keras 3 (applications and layers)


def _keras_application(cls: str) -> Callable[[int], Any]:
    def build(seed: int) -> Any:
        import keras

        keras.utils.set_random_seed(seed)
        return getattr(keras.applications, cls)(weights=None)

    return build


def _keras_encoder(seed: int) -> Any:
    """A post-norm Transformer encoder: MultiHeadAttention, Add, LayerNormalization; Dense +
    tanh GELU + Dense, Add, LayerNormalization."""
    import keras

    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = inp = keras.Input((SEQ, HIDDEN), name="input")
    for i in range(BLOCKS):
        attn = layers.MultiHeadAttention(HEADS, HIDDEN // HEADS, name=f"attn{i}")(x, x)
        x = layers.LayerNormalization(name=f"ln{i}a")(layers.Add()([x, attn]))
        h = layers.Dense(FFN, name=f"ffn{i}a")(x)
        h = layers.Activation(lambda t: keras.activations.gelu(t, approximate=True))(h)
        h = layers.Dense(HIDDEN, name=f"ffn{i}b")(h)
        x = layers.LayerNormalization(name=f"ln{i}b")(layers.Add()([x, h]))
    return keras.Model(inp, x, name="keras_encoder_big")


def keras_models() -> list[BenchModel]:
    """keras_resnet50, keras_mobilenetv3small, keras_encoder (NHWC, batch None), in this order
    (Keras names its unnamed layers by a count that runs on)."""
    return [
        BenchModel(
            "keras_resnet50.onnx",
            _keras_application("ResNet50"),
            (None, *IMAGE, 3),
            "keras.applications.ResNet50(weights=None), NHWC",
        ),
        BenchModel(
            "keras_mobilenetv3small.onnx",
            _keras_application("MobileNetV3Small"),
            (None, *IMAGE, 3),
            "keras.applications.MobileNetV3Small(weights=None), NHWC",
        ),
        BenchModel(
            "keras_encoder.onnx",
            _keras_encoder,
            (None, SEQ, HIDDEN),
            f"post-norm encoder, {_ENCODER}: MultiHeadAttention, Add, LayerNormalization (eps "
            "1e-3); Dense + gelu(approximate=True) + Dense, Add, LayerNormalization",
        ),
    ]


# --------------------------------------------------------------------------------------------
# Paddle: paddle.vision models and paddle.nn layers


def _paddle_vision(fn: str) -> Callable[[int], Any]:
    def build(seed: int) -> Any:
        import paddle

        paddle.seed(seed)
        return getattr(paddle.vision.models, fn)()

    return build


def _paddle_encoder(seed: int) -> Any:
    """A pre-norm nn.TransformerEncoder (erf GELU, no dropout) with a final LayerNorm."""
    import paddle
    from paddle import nn

    paddle.seed(seed)
    layer = nn.TransformerEncoderLayer(
        HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", normalize_before=True
    )
    return nn.TransformerEncoder(layer, BLOCKS, norm=nn.LayerNorm(HIDDEN))


def paddle_models() -> list[BenchModel]:
    """paddle_resnet18, paddle_mobilenetv3small (NCHW), paddle_encoder; InputSpec batch None."""
    return [
        BenchModel(
            "paddle_resnet18.onnx",
            _paddle_vision("resnet18"),
            (None, 3, *IMAGE),
            "paddle.vision.models.resnet18(), NCHW",
        ),
        BenchModel(
            "paddle_mobilenetv3small.onnx",
            _paddle_vision("mobilenet_v3_small"),
            (None, 3, *IMAGE),
            "paddle.vision.models.mobilenet_v3_small(), NCHW",
        ),
        BenchModel(
            "paddle_encoder.onnx",
            _paddle_encoder,
            (None, SEQ, HIDDEN),
            f"pre-norm nn.TransformerEncoder, {BLOCKS} layers, d_model {HIDDEN}, {HEADS} heads, "
            f"seq {SEQ}, FFN {FFN}, normalize_before=True, activation='gelu' (erf), dropout 0, "
            "final LayerNorm; eps 1e-5",
        ),
    ]


# --------------------------------------------------------------------------------------------
# JAX: Flax NNX modules


def _flax_cnn(seed: int) -> Any:
    """4 x (Conv 3x3 without bias + BatchNorm + relu), 64 channels, the mean over H and W, a
    Linear head."""
    import jax.numpy as jnp
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            chans = [3, 64, 64, 64, 64]
            self.convs = nnx.List(
                [
                    nnx.Conv(
                        chans[i],
                        chans[i + 1],
                        (3, 3),
                        strides=(1, 1) if i == 0 else (2, 2),
                        use_bias=False,
                        rngs=rngs,
                    )
                    for i in range(4)
                ]
            )
            self.bns = nnx.List([nnx.BatchNorm(64, rngs=rngs) for _ in range(4)])
            self.head = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            for conv, bn in zip(self.convs, self.bns, strict=True):
                x = nnx.relu(bn(conv(x)))
            return self.head(jnp.mean(x, axis=(1, 2)))

    return CNN(nnx.Rngs(seed))


def _flax_encoder(seed: int) -> Any:
    """A pre-norm encoder: x + MHA(LayerNorm(x)), x + Linear(gelu(Linear(RMSNorm(x)))); a final
    LayerNorm."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.ln = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, HIDDEN, decode=False, rngs=rngs)
            self.rms = nnx.RMSNorm(HIDDEN, rngs=rngs)
            self.fc1 = nnx.Linear(HIDDEN, FFN, rngs=rngs)
            self.fc2 = nnx.Linear(FFN, HIDDEN, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.ln(x))
            return x + self.fc2(nnx.gelu(self.fc1(self.rms(x))))

    class Encoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
            self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    return Encoder(nnx.Rngs(seed))


def flax_models() -> list[BenchModel]:
    """flax_cnn (NHWC 64 x 64), flax_encoder; jax2onnx batch "B"."""
    return [
        BenchModel(
            "flax_cnn.onnx",
            _flax_cnn,
            ("B", 64, 64, 3),
            "4 x (nnx.Conv 3x3 no bias (stride 1, then 2) + BatchNorm + relu), 64 channels, "
            "mean over H,W, Linear(64, 10); NHWC 64x64",
        ),
        BenchModel(
            "flax_encoder.onnx",
            _flax_encoder,
            ("B", SEQ, HIDDEN),
            f"pre-norm encoder, {_ENCODER}: x + MHA(LayerNorm(x)), x + Linear(gelu(Linear("
            "RMSNorm(x)))) (nnx.gelu default: tanh); final LayerNorm; eps 1e-6",
        ),
    ]


#: Per framework (the tool's first argument), its benchmark models in the order they are made.
MODELS: dict[str, Callable[[], list[BenchModel]]] = {
    "tf": keras_models,
    "jax": flax_models,
    "paddle": paddle_models,
}
