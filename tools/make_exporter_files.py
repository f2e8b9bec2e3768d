"""Make the exporters' own files: tiny test models (or, with ``--bench``, larger benchmark models)
written by tf2onnx, jax2onnx and paddle2onnx.

Each model is built with the framework's own layers (random weights, every norm's statistics and
affine parameters and every bias randomized, none left at its default), exported by that
framework's exporter, checked against the framework on ONNX Runtime (where it is installed), and
written to the out folder. ``versions.json`` there records, per file, the framework, the
exporter, their versions, the opset, the inputs and outputs, Python, the date and the parity
measured; each run merges into it, so the runs add up. Two sizes:

- The test files (the default), which normexport's tests read, so that they need none of the
  frameworks: tiny dimensions, under 300 KiB each, means and biases drawn from N(0, 0.5), each
  with a reference pair ``NAME.ref.npz`` (``input:NAME`` and ``output:NAME`` arrays: the
  framework's own output for one random input). The ``*_dynamic`` files (keras_cnn,
  keras_encoder, flax_encoder, paddle_encoder) are the same models, the same weights, exported
  with a symbolic batch axis as users' files usually have it (Keras batch None, tf2onnx's
  ``unk__N``; jax2onnx's ``"B"``; Paddle InputSpec ``[None, ...]``, paddle2onnx's
  ``DynamicDimension.0``): their pair is at batch 2, and each is also checked at batch 3
  (``max_abs_diff_by_batch`` in versions.json). They are made after the batch-1 files, so those
  stay as they were.
- The benchmark files (``--bench``), which ``benchmarks/exporters.py`` times (not committed):
  the models of ``tools/exporter_models_bench.py`` (Keras ResNet50, MobileNetV3Small and a
  4-block post-norm encoder; Paddle resnet18, mobilenet_v3_small and a 4-layer pre-norm
  encoder; a Flax CNN and a 4-block pre-norm encoder; about 0.5 to 100 MB each), each exported
  with a symbolic batch axis and its weights seeded afresh, means and biases drawn from
  N(0, 0.2), each with ``NAME.inputs.npz`` (one example input at batch 1, keyed by the ONNX
  input name) instead of the pair; their versions.json entries also give the node count and the
  largest output.
  ``--out`` is required; ``--only NAME,...`` makes only those files (the same weights,
  though Keras and Paddle number their unnamed layers and parameters across a run, so names in
  the file may differ from a full run's).

Run it once per framework and size, each framework in its own virtual environment outside the
repository (the framework and its exporter installed, with onnx, numpy and, for the check,
onnxruntime; not in normexport's environment):

    python tools/make_exporter_files.py tf --out tests/data/exporters      # keras_*.onnx
    python tools/make_exporter_files.py jax --out tests/data/exporters     # flax_*.onnx
    python tools/make_exporter_files.py paddle --out tests/data/exporters  # paddle_*.onnx
    python tools/make_exporter_files.py tf --bench --out DIR [--only keras_encoder]

The versions first used, for both sizes: TensorFlow 2.21.0 (tensorflow-cpu) + Keras 3.15.1 +
tf2onnx 1.17.0 (opset 17); JAX 0.10.2 + Flax 0.12.8 (NNX) + jax2onnx 0.17.1 (its default
opset, 23); PaddlePaddle 3.3.1 + paddle2onnx 2.1.0 (opset 17); Python 3.11. jax2onnx and
paddle2onnx write the same bytes on every run; tf2onnx does not (its node names carry Python
object ids and its node order varies), though the weights and the function are the same.
paddle2onnx folds constants with polygraphy, which pip-installs onnx_graphsurgeon and sympy on
its first run where they are missing.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

SEED = 0
MAX_BYTES = 300 * 1024
HIDDEN, HEADS, FFN, SEQ = 32, 2, 64, 8
#: The batch sizes a file with a symbolic batch axis is checked at (the first one's pair saved).
DYNAMIC_BATCHES = (2, 3)


@dataclass(frozen=True)
class Size:
    """What one size of files differs in."""

    spread: float  # the normal means and biases are drawn from (variances, scales: U(0.5, 2))
    max_bytes: int | None  # the largest file allowed
    reference: bool  # NAME.ref.npz (the input and the framework's output), else NAME.inputs.npz


TESTS = Size(0.5, MAX_BYTES, reference=True)
BENCH = Size(0.2, None, reference=False)


@dataclass(frozen=True)
class Framework:
    """One framework and its exporter, as both sizes use them."""

    meta: dict  # the versions.json fields naming the framework and the exporter
    prepare: Callable[[Any, np.random.Generator, float], None]  # randomize; inference mode
    run: Callable[[Any, np.ndarray], np.ndarray]  # the framework's own output
    write: Callable[[Any, tuple, Path], str]  # export at an input shape; the input's name


def _rng(name: str) -> np.random.Generator:
    """One generator per model, so one model's change leaves the others' weights alone."""
    return np.random.default_rng([SEED, int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)])


def _norm_value(
    kind: str, shape: tuple[int, ...], rng: np.random.Generator, spread: float
) -> np.ndarray:
    """A random value for a norm's parameter: never the default (0 or 1), variances positive."""
    if kind in ("variance", "scale"):
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    return rng.normal(0.0, spread, shape).astype(np.float32)  # mean, bias (beta), a Linear's bias


def _dynamic_inputs(name: str, shape: tuple) -> list[np.ndarray]:
    """Random inputs at each of :data:`DYNAMIC_BATCHES` for a shape whose batch axis is symbolic."""
    rng = _rng(name)
    return [rng.normal(0.0, 1.0, (b, *shape[1:])).astype(np.float32) for b in DYNAMIC_BATCHES]


def _same_function(name: str, got: np.ndarray, static: np.ndarray) -> None:
    """The symbolic-batch model gives, on its batch's first sample, what the batch-1 model gives
    on that sample alone (the same weights, the batch axis independent); fail otherwise."""
    diff = float(np.max(np.abs(got - static)))
    if diff > 1e-5:
        raise SystemExit(
            f"{name}: differs from the batch-1 model by {diff:.3g}: not the same weights"
        )


def _check_randomized(name: str, value: np.ndarray) -> None:
    """Fail if a norm parameter is still constant (its initializer's 0 or 1)."""
    if value.size > 1 and np.ptp(value) == 0:
        raise SystemExit(f"{name} was left at a constant value {value.flat[0]}")


def _ort():
    """onnxruntime, or None where it is not installed (the files are then not run)."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return onnxruntime


def _parity(name: str, path: Path, runs: list) -> tuple[float | None, dict[str, float]]:
    """The largest abs diff between ONNX Runtime and the framework over ``runs`` ((feeds,
    expected) pairs), and per batch size; None where onnxruntime is not installed."""
    diff, by_batch = None, {}
    for feeds, expected in runs:
        if (ort := _ort()) is None:
            break
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(None, feeds)  # on ONNX Runtime's CPU provider
        if len(got) != len(expected):
            raise SystemExit(f"{name}: {len(got)} outputs, the framework gave {len(expected)}")
        if not all(np.all(np.isfinite(g)) for g in got):
            raise SystemExit(f"{name}: non-finite output on ONNX Runtime")
        d = max(float(np.max(np.abs(g - e))) for g, e in zip(got, expected, strict=True))
        by_batch[str(next(iter(feeds.values())).shape[0])] = d
        diff = d if diff is None else max(diff, d)
    return diff, by_batch


def _save(out: Path, stem: str, model, feeds: dict, expected: list, size: Size) -> dict:
    """Write the file's arrays beside it (its reference pair, or its example inputs); the
    versions.json fields naming them."""
    if not size.reference:
        np.savez(out / f"{stem}.inputs.npz", **feeds)
        return {
            "example_inputs": f"{stem}.inputs.npz",
            "nodes": len(model.graph.node),
            "max_abs_output": max(float(np.max(np.abs(e))) for e in expected),
        }
    arrays = {f"input:{k}": v for k, v in feeds.items()}
    output_names = [o.name for o in model.graph.output]
    arrays.update({f"output:{k}": v for k, v in zip(output_names, expected, strict=True)})
    np.savez(out / f"{stem}.ref.npz", **arrays)
    return {"reference": f"{stem}.ref.npz"}


def _finish(
    out: Path,
    name: str,
    feeds: dict[str, np.ndarray],
    expected: list[np.ndarray],
    meta: dict,
    size: Size = TESTS,
    also: list[tuple[dict[str, np.ndarray], list[np.ndarray]]] = (),
) -> dict:
    """Check the written file against the framework's outputs, save its arrays, describe it.

    ``also``: further (feeds, expected) pairs the file is checked on, not saved (a file with a
    symbolic batch axis is checked at a second batch size); its diff is the largest of all.
    """
    import onnx

    path = out / name
    nbytes = path.stat().st_size
    if size.max_bytes is not None and nbytes > size.max_bytes:
        raise SystemExit(f"{name}: {nbytes} bytes, over the {size.max_bytes} allowed")
    model = onnx.load(str(path))
    onnx.checker.check_model(str(path))
    input_names = [i.name for i in model.graph.input]
    if sorted(input_names) != sorted(feeds):
        raise SystemExit(f"{name}: inputs {input_names}, expected {sorted(feeds)}")
    diff, by_batch = _parity(name, path, [(feeds, expected), *also])
    if diff is not None:
        at = f" (batch {', '.join(by_batch)})" if also else ""
        print(
            f"{name}: {nbytes} bytes, max abs diff vs the framework on ONNX Runtime {diff:.3g}{at}"
        )
    else:
        print(f"{name}: {nbytes} bytes (onnxruntime not installed: not run)")
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    entry = dict(meta)
    entry.update(
        opset=opsets.get("ai.onnx"),
        opset_imports=opsets,
        ir_version=model.ir_version,
        producer=f"{model.producer_name} {model.producer_version}".strip(),
        inputs={i.name: _shape(i) for i in model.graph.input},
        outputs={o.name: _shape(o) for o in model.graph.output},
        bytes=nbytes,
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        **_save(out, path.stem, model, feeds, expected, size),
        max_abs_diff_vs_framework=diff,
        **({"max_abs_diff_by_batch": by_batch} if also and diff is not None else {}),
        checked_with=f"onnxruntime {ort.__version__}" if (ort := _ort()) else None,
        onnx=onnx.__version__,
        numpy=np.__version__,
        python=platform.python_version(),
        date=datetime.date.today().isoformat(),
        seed=SEED,
    )
    return {name: entry}


def _shape(value_info) -> list:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in dims]


def _dist_version(name: str) -> str | None:
    """The installed distribution's version, None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def export(
    fw: Framework, size: Size, out: Path, model, name: str, shape: tuple, extra: dict
) -> dict:
    """``model`` randomized (``size.spread``), in inference mode, exported at the input ``shape``
    (batch 1, or symbolic) to out/name, and checked and saved on one random input at batch 1."""
    rng = _rng(name)
    fw.prepare(model, rng, size.spread)
    x = rng.normal(0.0, 1.0, (1, *shape[1:])).astype(np.float32)
    expected = fw.run(model, x)
    in_name = fw.write(model, shape, out / name)
    return _finish(out, name, {in_name: x}, [expected], fw.meta | extra, size)


def export_dynamic(
    fw: Framework, out: Path, model, static, name: str, shape: tuple, extra: dict
) -> dict:
    """``model``, with the weights of the batch-1 model ``static`` (exported already, as
    ``extra["same_weights_as"]``), exported with the symbolic batch axis ``shape[0]``: a test
    file, its pair at batch 2, also checked at batch 3."""
    xs = _dynamic_inputs(name, shape)
    expected = [fw.run(model, x) for x in xs]
    _same_function(name, expected[0][:1], fw.run(static, xs[0][:1]))
    in_name = fw.write(model, shape, out / name)
    feeds = [{in_name: x} for x in xs]
    also = [(f, [e]) for f, e in zip(feeds[1:], expected[1:], strict=True)]
    return _finish(out, name, feeds[0], [expected[0]], fw.meta | extra, TESTS, also)


# --------------------------------------------------------------------------------------------
# TensorFlow: Keras 3 layers, tf2onnx


def _keras() -> Framework:
    """Keras on TensorFlow, and tf2onnx at opset 17."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras
    import tensorflow as tf
    import tf2onnx

    opset = 17
    meta = {
        "framework": "tensorflow",
        "framework_version": tf.__version__,
        "framework_package": f"tensorflow-cpu {cpu}"
        if (cpu := _dist_version("tensorflow-cpu"))
        else f"tensorflow {tf.__version__}",
        "frontend": f"keras {keras.__version__}",
        "exporter": "tf2onnx",
        "exporter_version": tf2onnx.__version__,
        "export_call": f"tf2onnx.convert.from_keras(model, input_signature, opset={opset})",
    }

    def write(model: keras.Model, shape: tuple, path: Path) -> str:
        import onnx

        spec = [tf.TensorSpec(shape, tf.float32, name="input")]
        tf2onnx.convert.from_keras(model, spec, opset=opset, output_path=str(path))
        return onnx.load(str(path), load_external_data=False).graph.input[0].name

    return Framework(
        meta, _randomize_keras, lambda model, x: np.asarray(model(x, training=False)), write
    )


def _randomize_keras(model, rng: np.random.Generator, spread: float) -> None:
    import keras

    kinds = {"moving_variance": "variance", "gamma": "scale", "scale": "scale"}
    kinds |= {"beta": "bias", "moving_mean": "bias", "bias": "bias"}
    for var in model.weights:
        kind = kinds.get(var.path.split("/")[-1])
        if kind:  # else a kernel: the layer's own random initializer, kept
            var.assign(_norm_value(kind, tuple(var.shape), rng, spread))
    layers = keras.layers
    norms = (layers.BatchNormalization, layers.LayerNormalization, layers.RMSNormalization)
    for layer in model.layers:
        if isinstance(layer, norms):
            for var in layer.weights:
                _check_randomized(var.path, np.asarray(var))


def _keras_cnn(batch_size: int | None):
    """Two Conv2D + BatchNormalization + ReLU blocks (one conv without bias, one with), global
    average pooling, a Dense head. Channels last, as Keras writes it."""
    import keras

    layers = keras.layers
    x = inp = keras.Input((32, 32, 3), batch_size=batch_size, name="input")
    x = layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv1")(x)
    x = layers.BatchNormalization(name="bn1")(x)
    x = layers.ReLU(name="relu1")(x)
    x = layers.Conv2D(16, 3, strides=2, padding="same", name="conv2")(x)
    x = layers.BatchNormalization(epsilon=1e-5, name="bn2")(x)
    x = layers.ReLU(name="relu2")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    x = layers.Dense(10, name="head")(x)
    return keras.Model(inp, x, name="keras_cnn")


def _keras_encoder(batch_size: int | None):
    """A post-norm Transformer encoder: two blocks of MultiHeadAttention + Add + LayerNorm, Dense
    MLP + Add + LayerNorm; block 1's GELU is Keras's tanh one (approximate=True), block 2's the
    erf one written out (keras.ops.erf); block 2's norms have eps 1e-6; a final
    RMSNormalization."""
    import keras

    layers = keras.layers
    x = inp = keras.Input((SEQ, HIDDEN), batch_size=batch_size, name="input")
    for i, approximate in ((1, True), (2, False)):
        eps = 1e-3 if i == 1 else 1e-6
        attn = layers.MultiHeadAttention(HEADS, HIDDEN // HEADS, name=f"attn{i}")(x, x)
        x = layers.LayerNormalization(epsilon=eps, name=f"ln{i}a")(layers.Add()([x, attn]))

        def gelu(t, approximate=approximate):
            if approximate:
                return keras.activations.gelu(t, approximate=True)
            # Keras's gelu(approximate=False) is TensorFlow's 0.5 * x * erfc(-x / sqrt(2)),
            # and tf2onnx 1.17 has no Erfc: the erf GELU written out, as models do by hand.
            return 0.5 * t * (1.0 + keras.ops.erf(t / np.sqrt(2.0).astype(np.float32)))

        h = layers.Dense(FFN, activation=gelu, name=f"ffn{i}a")(x)
        h = layers.Dense(HIDDEN, name=f"ffn{i}b")(h)
        x = layers.LayerNormalization(epsilon=eps, name=f"ln{i}b")(layers.Add()([x, h]))
    x = layers.RMSNormalization(epsilon=1e-6, name="final_rms")(x)
    return keras.Model(inp, x, name="keras_encoder")


def _keras_mobilenet_block():
    """A MobileNetV2 inverted residual: 1x1 expand + BN + ReLU6, 3x3 DepthwiseConv2D + BN +
    ReLU6, 1x1 project + BN, residual Add."""
    import keras

    layers = keras.layers
    x = inp = keras.Input((16, 16, 8), batch_size=1, name="input")
    h = layers.Conv2D(32, 1, use_bias=False, name="expand")(x)
    h = layers.ReLU(6.0, name="relu6a")(layers.BatchNormalization(name="bn_expand")(h))
    h = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="depthwise")(h)
    h = layers.ReLU(6.0, name="relu6b")(layers.BatchNormalization(name="bn_depthwise")(h))
    h = layers.Conv2D(8, 1, use_bias=False, name="project")(h)
    h = layers.BatchNormalization(name="bn_project")(h)
    x = layers.Add(name="residual")([x, h])
    return keras.Model(inp, x, name="keras_mobilenet_block")


def make_tf(out: Path) -> dict:
    """keras_cnn, keras_encoder, keras_mobilenet_block (NHWC, opset 17) via tf2onnx; keras_cnn and
    keras_encoder also with a symbolic batch axis (``*_dynamic``: Keras batch None, tf2onnx's
    ``unk__N``), the same weights."""
    fw = _keras()
    import keras

    keras.utils.set_random_seed(SEED)
    cnn_doc = (
        "Conv2D(no bias)+BN(eps 1e-3)+ReLU, Conv2D(stride 2, bias)+BN(eps 1e-5)+ReLU, "
        "GlobalAveragePooling2D, Dense; NHWC"
    )
    encoder_doc = (
        "post-norm encoder, 2 blocks, hidden 32, 2 heads, seq 8: MultiHeadAttention, Add, "
        "LayerNormalization; Dense(64, gelu) + Dense(32), Add, LayerNormalization; block 1 "
        "keras gelu approximate=True (tanh), eps 1e-3; block 2 erf GELU written with "
        "keras.ops.erf, eps 1e-6; final RMSNormalization eps 1e-6"
    )
    encoder_note = (
        "keras.activations.gelu(approximate=False) is TensorFlow's Erfc form, which tf2onnx 1.17 "
        "does not convert (it writes an Erfc node no runtime has): block 2 spells the erf GELU "
        "out instead"
    )
    mobilenet_doc = (
        "MobileNetV2 inverted residual: Conv2D 1x1 + BN + ReLU6, DepthwiseConv2D 3x3 + BN + "
        "ReLU6, Conv2D 1x1 + BN, Add; NHWC; BN eps 1e-3"
    )
    test = partial(export, fw, TESTS, out)
    static = {"keras_cnn": _keras_cnn(1)}
    files = test(static["keras_cnn"], "keras_cnn.onnx", (1, 32, 32, 3), {"description": cnn_doc})
    static["keras_encoder"] = _keras_encoder(1)
    extra = {"description": encoder_doc, "note": encoder_note}
    files |= test(static["keras_encoder"], "keras_encoder.onnx", (1, SEQ, HIDDEN), extra)
    extra = {"description": mobilenet_doc}
    files |= test(_keras_mobilenet_block(), "keras_mobilenet_block.onnx", (1, 16, 16, 8), extra)

    # The same CNN and encoder with batch None (built after the batch-1 models, so that their
    # weights, drawn in order from the seed, stay as they were), the batch-1 models' weights.
    for stem, build, shape, doc in (
        ("keras_cnn", _keras_cnn, (None, 32, 32, 3), ""),
        ("keras_encoder", _keras_encoder, (None, SEQ, HIDDEN), ": " + encoder_doc),
    ):
        model = build(None)
        model.set_weights(static[stem].get_weights())
        doc = f"{stem}.onnx's model and weights with batch None (a symbolic batch axis){doc}"
        extra = {"description": doc, "same_weights_as": f"{stem}.onnx"}
        files |= export_dynamic(fw, out, model, static[stem], f"{stem}_dynamic.onnx", shape, extra)
    return files


# --------------------------------------------------------------------------------------------
# JAX: Flax NNX modules, jax2onnx


def _flax() -> Framework:
    """Flax NNX on JAX, and jax2onnx at its default opset."""
    import flax
    import jax
    import jax.numpy as jnp
    import jax2onnx
    import onnx

    meta = {
        "framework": "jax",
        "framework_version": jax.__version__,
        "frontend": f"flax {flax.__version__} (nnx)",
        "exporter": "jax2onnx",
        "exporter_version": _dist_version("jax2onnx"),
        "export_call": "jax2onnx.to_onnx(model, [shape]) (default opset and normalization_mode)",
    }

    def prepare(model, rng: np.random.Generator, spread: float) -> None:
        _randomize_flax(model, rng, spread)
        model.eval()

    def write(model, shape: tuple, path: Path) -> str:
        proto = jax2onnx.to_onnx(model, [shape], model_name=path.stem)
        onnx.save(proto, str(path))
        return proto.graph.input[0].name

    return Framework(meta, prepare, lambda model, x: np.asarray(model(jnp.asarray(x))), write)


def _randomize_flax(model, rng: np.random.Generator, spread: float) -> None:
    import jax.numpy as jnp
    from flax import nnx

    for path, module in nnx.iter_modules(model):
        where = "/".join(str(p) for p in path)
        kinds = {}
        if isinstance(module, nnx.BatchNorm):
            kinds = {"mean": "bias", "var": "variance", "scale": "scale", "bias": "bias"}
        elif isinstance(module, nnx.LayerNorm | nnx.RMSNorm):
            kinds = {"scale": "scale", "bias": "bias"}
        elif isinstance(module, nnx.Linear | nnx.LinearGeneral | nnx.Conv):
            kinds = {"bias": "bias"}  # kernels: the layer's own random initializer
        for attr, kind in kinds.items():
            var = getattr(module, attr, None)
            if var is None:
                continue
            value = _norm_value(kind, tuple(var[...].shape), rng, spread)
            var[...] = jnp.asarray(value)
            _check_randomized(f"{where}.{attr}", value)


def _flax_models() -> tuple[type, type]:
    """The test models' classes: a CNN (two Conv + BatchNorm + relu, the mean over H and W, a
    Linear head) and a pre-norm encoder (two blocks, a tanh GELU then an erf one)."""
    import jax.numpy as jnp
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.conv1 = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
            self.bn1 = nnx.BatchNorm(8, rngs=rngs)
            self.conv2 = nnx.Conv(8, 16, (3, 3), strides=(2, 2), rngs=rngs)
            self.bn2 = nnx.BatchNorm(16, epsilon=1e-3, rngs=rngs)
            self.head = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.bn1(self.conv1(x)))
            x = nnx.relu(self.bn2(self.conv2(x)))
            return self.head(jnp.mean(x, axis=(1, 2)))

    class Block(nnx.Module):
        def __init__(self, approximate: bool, rngs: nnx.Rngs) -> None:
            self.ln = nnx.LayerNorm(HIDDEN, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, HIDDEN, decode=False, rngs=rngs)
            self.rms = nnx.RMSNorm(HIDDEN, rngs=rngs)
            self.fc1 = nnx.Linear(HIDDEN, FFN, rngs=rngs)
            self.fc2 = nnx.Linear(FFN, HIDDEN, rngs=rngs)
            self.approximate = approximate

        def __call__(self, x):
            x = x + self.attn(self.ln(x))
            h = nnx.gelu(self.fc1(self.rms(x)), approximate=self.approximate)
            return x + self.fc2(h)

    class Encoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.block1 = Block(True, rngs)
            self.block2 = Block(False, rngs)
            self.norm = nnx.LayerNorm(HIDDEN, epsilon=1e-5, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.block2(self.block1(x)))

    return CNN, Encoder


def make_jax(out: Path) -> dict:
    """flax_cnn, flax_encoder (NHWC, jax2onnx's default opset) via jax2onnx; flax_encoder also
    with a symbolic batch axis (``flax_encoder_dynamic``: the shape ``("B", 8, 32)``), the same
    model."""
    fw = _flax()
    from flax import nnx

    cnn, encoder = (cls(nnx.Rngs(SEED)) for cls in _flax_models())
    cnn_doc = (
        "nnx.Conv(no bias)+BatchNorm(eps 1e-5)+relu, Conv(stride 2, bias)+BatchNorm(eps 1e-3)"
        "+relu, mean over H,W, Linear; NHWC"
    )
    encoder_doc = (
        "pre-norm encoder, 2 blocks, hidden 32, 2 heads, seq 8: x + MHA(LayerNorm(x)), "
        "x + Linear(gelu(Linear(RMSNorm(x)))); block 1 gelu approximate=True (tanh), block 2 "
        "approximate=False (erf); LayerNorm/RMSNorm eps 1e-6; final LayerNorm eps 1e-5"
    )
    test = partial(export, fw, TESTS, out)
    files = test(cnn, "flax_cnn.onnx", (1, 32, 32, 3), {"description": cnn_doc})
    files |= test(encoder, "flax_encoder.onnx", (1, SEQ, HIDDEN), {"description": encoder_doc})
    doc = (
        "flax_encoder.onnx's model and weights with a symbolic batch axis (jax2onnx shape "
        "('B', 8, 32)): " + encoder_doc
    )
    extra = {"description": doc, "same_weights_as": "flax_encoder.onnx"}
    shape = ("B", SEQ, HIDDEN)
    files |= export_dynamic(fw, out, encoder, encoder, "flax_encoder_dynamic.onnx", shape, extra)
    return files


# --------------------------------------------------------------------------------------------
# Paddle: paddle.nn layers, paddle2onnx


def _paddle() -> Framework:
    """Paddle, and paddle.onnx.export (paddle2onnx) at opset 17."""
    import paddle
    import paddle2onnx

    opset = 17
    meta = {
        "framework": "paddle",
        "framework_version": paddle.__version__,
        "exporter": "paddle2onnx",
        "exporter_version": paddle2onnx.__version__,
        "export_call": f"paddle.onnx.export(layer, path, input_spec, opset_version={opset})",
        # paddle2onnx folds constants with polygraphy, which installs onnx_graphsurgeon itself
        "folding": {n: v for n in ("polygraphy", "onnx_graphsurgeon") if (v := _dist_version(n))},
    }

    def prepare(model, rng: np.random.Generator, spread: float) -> None:
        _randomize_paddle(model, rng, spread)
        model.eval()

    def write(model, shape: tuple, path: Path) -> str:
        spec = [paddle.static.InputSpec(list(shape), "float32", "input")]
        with tempfile.TemporaryDirectory() as tmp:
            prefix = os.path.join(tmp, path.stem)
            paddle.onnx.export(model, prefix, input_spec=spec, opset_version=opset)
            written = Path(prefix + ".onnx")
            if not written.exists():
                raise SystemExit(f"{path.name}: paddle2onnx wrote nothing (see its log above)")
            path.write_bytes(written.read_bytes())
        return "input"

    return Framework(meta, prepare, lambda model, x: model(paddle.to_tensor(x)).numpy(), write)


def _randomize_paddle(model, rng: np.random.Generator, spread: float) -> None:
    from paddle import nn

    for where, layer in model.named_sublayers(include_self=True):
        kinds = {}
        if isinstance(layer, nn.layer.norm._BatchNormBase):
            kinds = {"_mean": "bias", "_variance": "variance", "weight": "scale", "bias": "bias"}
        elif isinstance(layer, nn.LayerNorm):
            kinds = {"weight": "scale", "bias": "bias"}
        elif isinstance(layer, nn.Linear | nn.Conv2D):
            kinds = {"bias": "bias"}  # weights: the layer's own random initializer
        for attr, kind in kinds.items():
            param = getattr(layer, attr, None)
            if param is None:
                continue
            value = _norm_value(kind, tuple(param.shape), rng, spread)
            param.set_value(value)
            _check_randomized(f"{where}.{attr}", value)


def _paddle_models() -> tuple[type, type]:
    """The test models' classes: a CNN (two Conv2D + BatchNorm2D + relu, pooling, a Linear head)
    and a pre-norm encoder (a TransformerEncoderLayer, then a hand-assembled pre-norm block)."""
    import paddle
    from paddle import nn
    from paddle.nn import functional as F

    class CNN(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2D(3, 8, 3, padding=1, bias_attr=False)
            self.bn1 = nn.BatchNorm2D(8)
            self.conv2 = nn.Conv2D(8, 16, 3, stride=2, padding=1)
            self.bn2 = nn.BatchNorm2D(16, epsilon=1e-3)
            self.pool = nn.AdaptiveAvgPool2D(1)
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            x = F.relu(self.bn1(self.conv1(x)))
            x = F.relu(self.bn2(self.conv2(x)))
            return self.head(paddle.flatten(self.pool(x), 1))

    class TanhBlock(nn.Layer):
        """A hand-assembled pre-norm block: LayerNorm + MultiHeadAttention, tanh-GELU MLP."""

        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(HIDDEN, epsilon=1e-6)
            self.attn = nn.MultiHeadAttention(HIDDEN, HEADS)
            self.ln2 = nn.LayerNorm(HIDDEN, epsilon=1e-6)
            self.fc1 = nn.Linear(HIDDEN, FFN)
            self.fc2 = nn.Linear(FFN, HIDDEN)

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=True))

    class Encoder(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(
                HIDDEN, HEADS, FFN, dropout=0.0, activation="gelu", normalize_before=True
            )
            self.block = TanhBlock()
            self.norm = nn.LayerNorm(HIDDEN)

        def forward(self, x):
            return self.norm(self.block(self.layer(x)))

    return CNN, Encoder


def make_paddle(out: Path) -> dict:
    """paddle_cnn, paddle_encoder (NCHW / NLC, opset 17) via paddle.onnx.export; paddle_encoder
    also with a symbolic batch axis (``paddle_encoder_dynamic``: InputSpec ``[None, 8, 32]``), the
    same model."""
    fw = _paddle()
    import paddle

    CNN, Encoder = _paddle_models()
    paddle.seed(SEED)
    cnn_doc = (
        "Conv2D(no bias)+BatchNorm2D(eps 1e-5)+relu, Conv2D(stride 2, bias)+BatchNorm2D"
        "(eps 1e-3)+relu, AdaptiveAvgPool2D(1), flatten, Linear; NCHW"
    )
    test = partial(export, fw, TESTS, out)
    files = test(CNN(), "paddle_cnn.onnx", (1, 3, 32, 32), {"description": cnn_doc})
    encoder = Encoder()  # after the CNN's export, as its weights were first drawn
    encoder_doc = (
        "pre-norm encoder, hidden 32, 2 heads, seq 8: TransformerEncoderLayer(normalize_before="
        "True, activation='gelu' (erf), eps 1e-5), then a hand-assembled pre-norm block "
        "(LayerNorm eps 1e-6 + MultiHeadAttention, LayerNorm + Linear + gelu(approximate=True)"
        " + Linear), final LayerNorm eps 1e-5"
    )
    note = (
        "paddle2onnx 2.1.0 writes F.gelu(approximate=True) as the erf GELU (its approximate is "
        "dropped): the file differs from Paddle there by up to ~5e-4 (tanh vs erf); the "
        ".ref.npz output is Paddle's own"
    )
    extra = {"description": encoder_doc, "note": note}
    files |= test(encoder, "paddle_encoder.onnx", (1, SEQ, HIDDEN), extra)
    doc = (
        "paddle_encoder.onnx's model and weights with a symbolic batch axis (InputSpec "
        "[None, 8, 32]): " + encoder_doc
    )
    extra = {"description": doc, "same_weights_as": "paddle_encoder.onnx", "note": note}
    shape = (None, SEQ, HIDDEN)
    files |= export_dynamic(fw, out, encoder, encoder, "paddle_encoder_dynamic.onnx", shape, extra)
    return files


# --------------------------------------------------------------------------------------------
# The benchmark size (its models: tools/exporter_models_bench.py)

FRAMEWORKS: dict[str, Callable[[], Framework]] = {"tf": _keras, "jax": _flax, "paddle": _paddle}
MAKERS: dict[str, Callable[[Path], dict]] = {"tf": make_tf, "jax": make_jax, "paddle": make_paddle}


def make_bench(framework: str, out: Path, only: set[str] | None = None) -> dict:
    """The benchmark models of ``framework`` (``only`` those files where given), each seeded
    afresh, exported with its symbolic batch axis, ``NAME.inputs.npz`` beside it."""
    import exporter_models_bench as bench  # beside this file, on sys.path as its folder

    models = bench.MODELS[framework]()
    if unknown := sorted((only or set()) - {m.name for m in models}):
        raise SystemExit(f"--only: no {', '.join(unknown)} among {[m.name for m in models]}")
    fw = FRAMEWORKS[framework]()
    files: dict = {}
    for m in models:
        if not only or m.name in only:
            model = m.build(SEED)
            files |= export(fw, BENCH, out, model, m.name, m.shape, {"description": m.description})
    return files


def record(out: Path, files: dict) -> Path:
    """Merge this run's entries into out/versions.json (the other frameworks' stay)."""
    path = out / "versions.json"
    entries = json.loads(path.read_text()) if path.exists() else {}
    entries.update(files)
    blocks = []
    for name, entry in sorted(entries.items()):
        lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entry.items())
        blocks.append(f" {json.dumps(name)}: {{\n{lines}\n }}")
    text = "{\n" + ",\n".join(blocks) + "\n}\n"
    json.loads(text)  # well formed
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("framework", choices=sorted(MAKERS), help="which exporter's files to make")
    p.add_argument("--out", type=Path, help="default: tests/data/exporters (not with --bench)")
    p.add_argument("--bench", action="store_true", help="the benchmark models, not the tests'")
    p.add_argument("--only", default="", help="with --bench: comma-separated names (NAME.onnx)")
    args = p.parse_args(argv)
    only = {n if n.endswith(".onnx") else f"{n}.onnx" for n in args.only.split(",") if n} or None
    if only and not args.bench:
        p.error("--only goes with --bench (the test files share weights: made all together)")
    if args.out is None and args.bench:
        p.error("--bench needs --out DIR (its files are large and not committed)")
    args.out = args.out or Path("tests/data/exporters")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.bench:
        files = make_bench(args.framework, args.out, only)
    else:
        files = MAKERS[args.framework](args.out)
    path = record(args.out, files)
    print(f"{path}: {len(files)} files recorded ({', '.join(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
