"""The float64 forms of the ops ONNX Runtime's CPU provider has no float64 kernel for
(:mod:`normexport.verdict.float64_forms`): each graph's oracle, run on ONNX Runtime, against
the op computed in float64 by PyTorch or numpy, and against the graph as written in float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto

from normexport import runtime
from normexport.verdict import oracle
from tests.support.graphs import make_model, stft_front_end

FLOAT = TensorProto.FLOAT


def _oracle(tmp_path: Path, nodes, shape, weights=(), opset: int = 17, x=None, rng=None):
    """The oracle of ``nodes`` (input ``x`` of ``shape``, output ``y``), its output on ``x``
    (random where not given), the graph as written's, and the oracle itself."""
    model = make_model(
        nodes, {"x": (FLOAT, list(shape))}, {"y": (FLOAT, None)}, weights, opset=opset
    )
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    x = rng.standard_normal(shape).astype(np.float32) if x is None else x
    found = oracle.onnx_float64(
        path, lambda f: runtime.run(session, f), {"x": x}, tmp_path, "the input graph"
    )
    assert found.kind == "onnx_float64" and "on ONNX Runtime" in found.notes[0], found.notes
    (y,) = found.run({"x": x})
    (written,) = runtime.run(session, {"x": x})
    assert y.dtype == np.float64
    return x, y, written, found


def _torch_pads(pads: list[int]) -> list[int]:
    """ONNX pads (every begin, then every end) as ``F.pad``'s (last axis first)."""
    n = len(pads) // 2
    return [p for axis in reversed(range(n)) for p in (pads[axis], pads[axis + n])]


CONVS = {
    # x shape, Cout, kernel, attributes
    "dilated_1d": ((2, 3, 700), 4, [3], {"dilations": [128], "pads": [128, 128]}),
    "stem_1d": ((1, 2, 7500), 8, [7], {"pads": [3, 3]}),
    "grouped_strided_asymmetric": (
        (2, 6, 9, 11), 4, [3, 3], {"group": 2, "strides": [2, 1], "pads": [1, 0, 2, 1]}
    ),
    "depthwise": ((2, 6, 9, 11), 6, [3, 3], {"group": 6, "pads": [1, 1, 1, 1]}),
    "depthwise_multiplier_dilated": (
        (2, 4, 9, 11), 8, [3, 2], {"group": 4, "dilations": [2, 3], "strides": [1, 2]}
    ),
    "same_upper": ((1, 4, 9, 10), 8, [3, 3], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "same_lower": ((1, 4, 9, 10), 8, [4, 3], {"auto_pad": "SAME_LOWER", "strides": [2, 3]}),
    "valid_3d": ((1, 2, 5, 6, 7), 3, [2, 3, 2], {"auto_pad": "VALID", "strides": [1, 2, 1]}),
    "wide_input": ((2, 300, 8, 8), 16, [3, 3], {"pads": [1, 1, 1, 1]}),
    "strided_gathered": ((1, 3, 11, 12), 4, [3, 3], {"strides": [2, 3], "pads": [1, 1, 0, 2]}),
    # more taps than TAP_WIDTH: one MatMul over the gathered frames (an STFT window)
    "framed_1d": ((2, 2, 3000), 4, [400], {"strides": [160], "dilations": [2], "pads": [7, 30]}),
}  # fmt: skip


def _same_pads(shape, kernel, attrs) -> list[int]:
    """The pads SAME_UPPER / SAME_LOWER stand for (ONNX spec, Conv)."""
    begins, ends = [], []
    for size, k, s in zip(shape[2:], kernel, attrs.get("strides", [1] * len(kernel)), strict=True):
        total = max(0, (math.ceil(size / s) - 1) * s + k - size)
        small, large = total // 2, total - total // 2
        lower = attrs["auto_pad"] == "SAME_LOWER"
        begins.append(large if lower else small)
        ends.append(small if lower else large)
    return begins + ends


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CONVS))
def test_conv_in_float64(rng, tmp_path, case, bias):
    """Dilated, strided, padded, grouped, depthwise, SAME-padded Conv, 1-D to 3-D, at opsets 7
    (Pad and Slice as attributes, a stride by Gather) to 17, against PyTorch's convolution in
    float64: exact to float64 rounding (the graph as written, float32, is ~1e-6 off); no kernel
    expanded by its dilation (a 1-D Conv of dilation 128 runs)."""
    shape, cout, kernel, attrs = CONVS[case]
    groups = attrs.get("group", 1)
    weights = {"w": rng.standard_normal((cout, shape[1] // groups, *kernel)).astype(np.float32)}
    if bias:
        weights["b"] = rng.standard_normal(cout).astype(np.float32)
    nodes = [("Conv", ["x", *weights], ["y"], attrs)]
    opsets = {"wide_input": 11, "stem_1d": 9, "grouped_strided_asymmetric": 10, "framed_1d": 11}
    opset = {**opsets, "strided_gathered": 7}.get(case, 17)
    x, y, written, found = _oracle(tmp_path, nodes, shape, weights, opset=opset, rng=rng)
    assert "1 Conv" in found.notes[1] and not found.float32, found.notes
    pads = attrs.get("pads", [0] * 2 * len(kernel))
    if attrs.get("auto_pad", "").startswith("SAME"):
        pads = _same_pads(shape, kernel, attrs)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(kernel)]
    exact = conv(
        F.pad(torch.from_numpy(x.astype(np.float64)), _torch_pads(pads)),
        torch.from_numpy(weights["w"].astype(np.float64)),
        torch.from_numpy(weights["b"].astype(np.float64)) if bias else None,
        stride=attrs.get("strides", 1),
        dilation=attrs.get("dilations", 1),
        groups=groups,
    ).numpy()
    scale = np.abs(exact).max()
    assert np.abs(y - exact).max() < 1e-14 * scale * math.sqrt(x.shape[1] * np.prod(kernel))
    assert 1e-9 * scale < np.abs(written - exact).max() < 1e-5 * scale  # float32 is not


@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_in_float64(rng, tmp_path, count_include_pad):
    """AveragePool with pads, counting the pads or not, against PyTorch's in float64."""
    attrs = {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}
    attrs["count_include_pad"] = count_include_pad
    x, y, _, found = _oracle(
        tmp_path, [("AveragePool", ["x"], ["y"], attrs)], (2, 3, 9, 10), rng=rng
    )
    padded = F.pad(torch.from_numpy(x.astype(np.float64)), [0, 1, 1, 1])
    summed = F.avg_pool2d(padded, (3, 2), (2, 1), divisor_override=1).numpy()
    ones = F.pad(torch.ones(1, 1, 9, 10, dtype=torch.float64), [0, 1, 1, 1])
    count = F.avg_pool2d(ones, (3, 2), (2, 1), divisor_override=1).numpy()
    exact = summed / (6 if count_include_pad else count)
    assert np.abs(y - exact).max() < 1e-15 and "1 AveragePool" in found.notes[1]


@pytest.mark.parametrize(
    "op, exact",
    [
        ("GlobalAveragePool", lambda a: a.mean((2, 3), keepdims=True)),
        ("GlobalMaxPool", lambda a: a.max((2, 3), keepdims=True)),
    ],
)
def test_global_pools_in_float64(rng, tmp_path, op, exact):
    x, y, _, found = _oracle(tmp_path, [(op, ["x"], ["y"], {})], (2, 3, 9, 10), rng=rng)
    assert np.abs(y - exact(x.astype(np.float64))).max() < 1e-15 and op in found.notes[1]


def test_instance_norm_in_float64(rng, tmp_path):
    """InstanceNormalization of inputs of magnitude 1e3: float64 statistics (float32's are
    ~1e-4 off here)."""
    weights = {
        "s": rng.uniform(0.5, 1.5, 3).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }
    x = (rng.standard_normal((2, 3, 9, 10)) * 100 + 1000).astype(np.float32)
    nodes = [("InstanceNormalization", ["x", "s", "b"], ["y"], {"epsilon": 1e-5})]
    _, y, written, found = _oracle(tmp_path, nodes, x.shape, weights, x=x)
    wide = x.astype(np.float64)
    centred = wide - wide.mean((2, 3), keepdims=True)
    normed = centred / np.sqrt(np.square(centred).mean((2, 3), keepdims=True) + np.float32(1e-5))
    exact = normed * weights["s"][:, None, None] + weights["b"][:, None, None]
    assert np.abs(y - exact).max() < 1e-13 < np.abs(written - exact).max()
    assert "1 InstanceNormalization" in found.notes[1]


@pytest.mark.parametrize(
    "op, attrs, opset, exact",
    [
        ("LeakyRelu", {"alpha": 0.1}, 9, lambda a: np.where(a < 0, a * np.float32(0.1), a)),
        ("HardSigmoid", {}, 17, lambda a: np.clip(a * np.float32(0.2) + 0.5, 0, 1)),
        ("HardSwish", {}, 17, lambda a: a * np.clip(a / 6 + 0.5, 0, 1)),
        ("Clip", {"min": -1.0, "max": 2.0}, 8, lambda a: np.clip(a, -1, 2)),
    ],
)
def test_activations_in_float64(rng, tmp_path, op, attrs, opset, exact):
    """Activations with no float64 kernel at their opset, on inputs that are not float32
    values (the graph scales them by 1/3 first, in float64)."""
    nodes = [("Mul", ["x", "k"], ["h"], {}), (op, ["h"], ["y"], attrs)]
    third = {"k": np.array(1 / 3, np.float32)}
    x, y, _, found = _oracle(tmp_path, nodes, (4, 50), third, opset=opset, rng=rng)
    h = x.astype(np.float64) * np.float64(third["k"])
    assert np.abs(y - exact(h)).max() < 1e-15 and not found.float32, found.notes


def test_erf_to_float64_rounding(tmp_path):
    """Erf on a dense grid over [-7, 7] and the odd cases (signed zeros, infinities, NaN, the
    ends of its pieces, tiny values) against ``math.erf``: within 1 float64 ulp of erf's
    magnitude, and relatively too near 0; float32's Erf is ~1e-7 off."""
    grid = np.linspace(-7, 7, 100001)
    odd = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-38, 6.0, -6.0, 5.9999, 0.125, 1 / 16]
    x = np.concatenate([grid, odd]).astype(np.float32)
    _, y, written, found = _oracle(tmp_path, [("Erf", ["x"], ["y"], {})], x.shape, x=x)
    exact = np.array([math.erf(v) for v in x.astype(np.float64)])
    finite = ~np.isnan(exact)
    assert np.isnan(y[~finite]).all() and np.array_equal(y[np.isinf(x)], np.sign(x[np.isinf(x)]))
    assert np.abs(y - exact)[finite].max() <= 2.3e-16
    nonzero = finite & (exact != 0)
    assert (np.abs(y - exact)[nonzero] / np.abs(exact[nonzero])).max() < 3e-15
    assert np.abs(written - exact)[finite].max() > 1e-8
    assert "1 Erf" in found.notes[1] and not found.float32


def test_nearest_resize_copies_float64_values(rng, tmp_path):
    """Nearest Resize of float64 values (scaled by 1/3: not float32 values) copies them to
    2**-48 relative (its two float32 halves); the scales stay float32."""
    weights = {
        "k": np.full((1, 2, 1, 1), 1 / 3, np.float32),
        "roi": np.zeros(0, np.float32),
        "scales": np.array([1, 1, 2, 2], np.float32),
    }
    attrs = {"mode": "nearest", "coordinate_transformation_mode": "asymmetric"}
    nodes = [("Mul", ["x", "k"], ["h"], {}), ("Resize", ["h", "roi", "scales"], ["y"], attrs)]
    x, y, _, found = _oracle(tmp_path, nodes, (1, 2, 3, 4), weights, opset=11, rng=rng)
    h = x.astype(np.float64) * np.float64(weights["k"])
    exact = h.repeat(2, axis=2).repeat(2, axis=3)
    assert np.abs(y - exact).max() <= 2**-48 * np.abs(exact).max()
    assert "1 Resize" in found.notes[1] and not found.float32


@pytest.mark.parametrize(
    "op, domain, attrs, opset",
    [
        ("Gelu", "", {}, 20),
        ("Gelu", "com.microsoft", {}, 17),
        ("BiasGelu", "com.microsoft", {}, 17),
    ],
)
def test_gelu_in_float64(rng, tmp_path, op, domain, attrs, opset):
    """GELU, ONNX's and ONNX Runtime's (with and without its bias), as its definition in
    float64 (its erf by the float64 form)."""
    inputs = ["x", "bias"] if op == "BiasGelu" else ["x"]
    bias = {"bias": rng.standard_normal(6).astype(np.float32)} if op == "BiasGelu" else {}
    node = (op, inputs, ["y"], {**attrs, **({"domain": domain} if domain else {})})
    x = (rng.standard_normal((4, 6)) * 3).astype(np.float32)
    _, y, written, found = _oracle(tmp_path, [node], x.shape, bias, opset=opset, x=x)
    h = x.astype(np.float64) + (bias["bias"].astype(np.float64) if bias else 0)
    exact = h / 2 * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    assert np.abs(y - exact).max() < 4e-15 < np.abs(written - exact).max()
    assert f"1 {op}" in found.notes[1] and not found.float32


def test_an_stft_window_of_8000_taps_is_one_matmul_over_its_frames(rng, tmp_path):
    """An audio front end's Conv of 8,000 samples, stride 160 (:func:`tests.support.graphs.
    stft_front_end`): its float64 form is a handful of nodes, not one slice per tap (8,000
    nodes took ONNX Runtime two minutes to load), and exact against numpy's frames in float64
    on two input lengths (the frames' positions follow the input's length)."""
    model = stft_front_end(rng, 8000)
    path = tmp_path / "m.onnx"
    ir.save(model, path)
    session = runtime.make_session(path, "cpu", optimization_level=runtime.AS_WRITTEN)
    wave = rng.standard_normal((2, 8320)).astype(np.float32)
    found = oracle.onnx_float64(
        path, lambda f: runtime.run(session, f), {"wave": wave}, tmp_path, "the input graph"
    )
    assert found.kind == "onnx_float64" and "1 Conv" in found.notes[1], found.notes
    assert len(list(found.run.wide.model.graph)) < 30
    w = model.graph.initializers["w"].const_value.numpy().astype(np.float64)[:, 0]
    b = model.graph.initializers["b"].const_value.numpy().astype(np.float64)
    for length in (8320, 9000):
        x = rng.standard_normal((2, length)).astype(np.float32)
        (y,) = found.run({"wave": x})
        starts = range(0, length - 8000 + 1, 160)
        frames = np.stack([x[:, s : s + 8000] for s in starts], axis=1).astype(np.float64)
        exact = (frames @ w.T + b).mean(axis=1)
        assert np.abs(y - exact).max() < 1e-13 * np.abs(exact).max()
