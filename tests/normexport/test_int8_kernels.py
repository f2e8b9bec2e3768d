"""Int8 and ONNX Runtime's kernels: the convs int8 is slower for kept float
(:data:`normexport.precision.int8.MIN_INT8_MACS`), and a node kept float after an activation
ONNX Runtime's quantizer removed reads the clipped values.

Real graphs (random weights and biases, a depthwise conv as MobileNets have, a first conv on an
image's three channels), quantized by ONNX Runtime's ``quantize_static`` through
:func:`normexport.precision.int8.quantize` and run on ONNX Runtime against the float model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto

from normexport.precision import int8
from tests.support.graphs import make_model

C, HW = 16, 16


def _convnet(path: Path, rng: np.random.Generator) -> Path:
    """images (1, 3, HW, HW) -> stem Conv 3x3 (3 -> C: 27 multiply-adds per output) -> Relu ->
    dense Conv 3x3 (C -> C: 144) -> Relu -> depthwise Conv 3x3 (group C: 9) -> dense Conv 1x1
    (C -> C): a MobileNet's pattern, each conv with a bias (a BatchNorm folded in)."""

    def conv(o, i, k):
        w = rng.standard_normal((o, i, k, k)) / np.sqrt(i * k * k)
        return w.astype(np.float32), (0.3 * rng.standard_normal(o)).astype(np.float32)

    weights = {}
    shapes = {"stem": (C, 3, 3), "dense": (C, C, 3), "dw": (C, 1, 3), "pw": (C, C, 1)}
    for name, shape in shapes.items():
        weights[f"{name}_w"], weights[f"{name}_b"] = conv(*shape)
    pad = {"pads": [1, 1, 1, 1]}
    nodes = [
        ("Conv", ["images", "stem_w", "stem_b"], ["s"], {"name": "stem", **pad}),
        ("Relu", ["s"], ["s_relu"], {"name": "stem_relu"}),
        ("Conv", ["s_relu", "dense_w", "dense_b"], ["d"], {"name": "dense", **pad}),
        ("Relu", ["d"], ["d_relu"], {"name": "dense_relu"}),
        ("Conv", ["d_relu", "dw_w", "dw_b"], ["e"], {"name": "depthwise", "group": C, **pad}),
        ("Conv", ["e", "pw_w", "pw_b"], ["y"], {"name": "pointwise"}),
    ]
    f32 = TensorProto.FLOAT
    model = make_model(
        nodes, {"images": (f32, [1, 3, HW, HW])}, {"y": (f32, [1, C, HW, HW])}, weights
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, path)
    return path


def _outputs(path: Path, feeds: list[dict]) -> list[np.ndarray]:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return [session.run(None, f)[0] for f in feeds]


def test_convs_with_few_multiply_adds_stay_float_and_read_clipped_values(tmp_path, rng):
    """The stem conv (27 multiply-adds per output), the depthwise conv (9) and the 1x1 conv
    (16) are kept float, reason ``int8_slower``; the dense 3x3 conv (144) is int8. The
    depthwise conv follows a Relu that ONNX Runtime's quantizer removes (the
    dense conv's quantized range clips instead): it reads that clipped round trip, not the
    unclipped conv output, and the int8 model stays within 5% relative L2 error of the float
    one (reading the unclipped values, the error is of order 1)."""
    src = _convnet(tmp_path / "m.onnx", rng)
    kept = int8.kept_ops(src)
    assert {(k.node, k.reason) for k in kept} == {
        ("stem", "int8_slower"),
        ("depthwise", "int8_slower"),
        ("pointwise", "int8_slower"),
    }, kept
    assert "27 multiply-adds" in next(k.detail for k in kept if k.node == "stem")
    feeds = [{"images": rng.uniform(0, 1, (1, 3, HW, HW)).astype(np.float32)} for _ in range(6)]
    dst = tmp_path / "int8.onnx"
    int8.quantize(
        src, dst, precision="int8", calibration=feeds[:4], kept=[k.node for k in kept],
        external_data=False,
    )  # fmt: skip
    graph = onnx.load(dst).graph
    nodes = {n.name: n for n in graph.node}
    producer = {o: n for n in graph.node for o in n.output}
    assert "dense_relu" not in nodes  # removed by the quantizer: the premise of this test
    assert producer[nodes["depthwise"].input[0]].op_type == "DequantizeLinear"
    assert producer[nodes["dense"].input[1]].op_type == "DequantizeLinear"  # int8 weights
    for name in ("stem", "depthwise", "pointwise"):
        assert nodes[name].input[1] in {t.name for t in graph.initializer}, name  # float
    error = int8.rel_l2(_outputs(dst, feeds[4:]), _outputs(src, feeds[4:]))
    assert error < 0.05, error
