"""Build small ONNX graphs without PyTorch, run them on ONNX Runtime, compare two models.

For the fast, graph-level pass tests (``make test-fast``): every graph is written node by node
with :mod:`onnx.helper`, so a test shows exactly the pattern it exercises, and runs in
milliseconds. Parameters come from a seeded generator: randomize every weight and statistic.
"""

from __future__ import annotations

import collections
import os
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper, numpy_helper

from fusion.base import Op
from fusion.registry import KINDS

#: A node as ``(op_type, inputs, outputs, attributes)``; add ``"domain"`` to the attributes
#: dict as ``{"domain": "com.microsoft"}`` for a contrib op.
NodeSpec = tuple[str, Sequence[str], Sequence[str], Mapping]


def make_model(
    nodes: Sequence[NodeSpec],
    inputs: Mapping[str, tuple[int, Sequence[int | str]]],
    outputs: Mapping[str, tuple[int, Sequence[int | str] | None]],
    initializers: Mapping[str, np.ndarray] = (),
    *,
    opset: int = 18,
    ir_version: int = 10,
) -> ir.Model:
    """An onnx_ir model of one graph.

    Args:
        nodes: the nodes in order, each ``(op_type, inputs, outputs, attributes)``.
        inputs: graph inputs, name -> ``(onnx.TensorProto dtype, shape)``.
        outputs: graph outputs, name -> ``(dtype, shape or None)``.
        initializers: name -> array (constants of the graph).
        opset: the ai.onnx opset (com.microsoft version 1 is imported when a node uses it).
    """
    protos = []
    for op_type, node_inputs, node_outputs, attributes in nodes:
        attrs = dict(attributes)
        domain = attrs.pop("domain", "")
        protos.append(
            helper.make_node(op_type, list(node_inputs), list(node_outputs), domain=domain, **attrs)
        )
    graph = helper.make_graph(
        protos,
        "g",
        [helper.make_tensor_value_info(n, t, list(s)) for n, (t, s) in inputs.items()],
        [
            helper.make_tensor_value_info(n, t, None if s is None else list(s))
            for n, (t, s) in outputs.items()
        ],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in dict(initializers).items()],
    )
    imports = [helper.make_opsetid("", opset)]
    if any(p.domain == "com.microsoft" for p in protos):
        imports.append(helper.make_opsetid("com.microsoft", 1))
    proto = helper.make_model(graph, opset_imports=imports, ir_version=ir_version)
    proto = onnx.shape_inference.infer_shapes(proto)
    return ir.serde.deserialize_model(proto)


def stft_front_end(rng: np.random.Generator, kernel: int = 400, *, state: bool = False) -> ir.Model:
    """An STFT-as-Conv audio front end: ``wave`` (batch, samples) float32 through a Conv of
    ``kernel`` samples (random weights), stride 160, averaged over its frames into ``y`` (batch,
    8); with ``state``, a recurrent state (2, batch, 8) averaged and added, as a voice-activity
    detector takes one. It runs only on ``kernel`` samples or more."""
    weights = {
        "w": (rng.standard_normal((8, 1, kernel)) * 0.05).astype(np.float32),
        "b": rng.standard_normal(8).astype(np.float32),
        "one": np.array([1], np.int64),
        "two": np.array([2], np.int64),
        "zero": np.array([0], np.int64),
    }
    nodes = [
        ("Unsqueeze", ["wave", "one"], ["w3"], {}),
        ("Conv", ["w3", "w", "b"], ["c"], {"strides": [160]}),
        ("ReduceMean", ["c", "two"], ["y0" if state else "y"], {"keepdims": 0}),
    ]
    inputs = {"wave": (onnx.TensorProto.FLOAT, ["batch", "samples"])}
    if state:
        nodes += [
            ("ReduceMean", ["state", "zero"], ["s"], {"keepdims": 0}),
            ("Add", ["y0", "s"], ["y"], {}),
        ]
        inputs["state"] = (onnx.TensorProto.FLOAT, [2, "batch", 8])
    outputs = {"y": (onnx.TensorProto.FLOAT, ["batch", 8])}
    return make_model(nodes, inputs, outputs, weights, opset=18)


def run(model: ir.Model, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``model`` on ``feeds``, on ORT's CPU provider with graph optimizations off
    (so that ONNX Runtime's own fusions do not hide what a pass did)."""
    return cpu_session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, dict(feeds))


def cpu_session(
    model: ir.Model | str | os.PathLike,
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
) -> ort.InferenceSession:
    """An ONNX Runtime session of ``model`` (in memory, its tensors maybe still in a file's
    external data, or a file with its external data beside it) on the CPU provider, with the
    graph optimizations of ``level`` (by default ORT_ENABLE_ALL, what a deployed model gets).
    A model in memory is written to a temporary folder first, with external data."""
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.log_severity_level = 3
    if not isinstance(model, ir.Model):
        return ort.InferenceSession(os.fspath(model), options, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.onnx")
        ir.save(model, path, external_data="model.onnx.data", size_threshold_bytes=1024)
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def ops(model: ir.Model) -> list[str]:
    """The op types of the main graph, in order."""
    return [node.op_type for node in model.graph]


def assert_close(
    got: Sequence[np.ndarray], want: Sequence[np.ndarray], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Each pair close (:func:`mismatch`)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        why = mismatch(g, w, atol=atol, rtol=rtol)
        assert why is None, f"output {i}: {why}"


def mismatch(got: np.ndarray, want: np.ndarray, *, atol: float, rtol: float) -> str | None:
    """Why ``got`` is not close to ``want`` (None where it is): a shape of its own, NaN or Inf
    where ``want`` is finite, or ``max |got - want|`` above ``atol + rtol * max |want|`` (over
    the elements where ``want`` is finite; the others are not compared). The rule is
    normexport's (:func:`normexport.verdict.tolerance.closeness`), written again on purpose:
    fusion's tests import no normexport, and an oracle that shared the product's code could
    not catch a mistake in it."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape} vs {want.shape}"
    finite = np.isfinite(want)
    diff = np.abs(np.where(finite, got - want, 0.0))
    error = float(np.where(np.isnan(diff), np.inf, diff).max(initial=0.0))
    tolerance = atol + rtol * float(np.abs(np.where(finite, want, 0.0)).max(initial=0.0))
    if error <= tolerance:
        return None
    return f"max abs err {error:.3g} > tolerance {tolerance:.3g}"


def op_counts(model: ir.Model) -> collections.Counter[Op]:
    """How many nodes of each op ``model`` holds, in every graph (If / Loop bodies too)."""
    nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    return collections.Counter(Op(n.op_type, n.domain) for n in nodes)


def excess_ops(
    raw: ir.Model, published: ir.Model, fused: Mapping[str, int], allowed: Sequence[Op] = ()
) -> dict[Op, tuple[int, int]]:
    """The ops of which ``published`` holds more nodes than ``raw`` (:func:`op_counts`), each
    with ``(raw's count, published's)``, but those a rewrite wrote: the ops the kinds of rewrite
    that ``fused`` counts above 0 (a report's ``fusions.counts``) declare
    (:attr:`fusion.base.Kind.ops`), and ``allowed``. Empty: no node the raw model would not
    have unless a rewrite made it."""
    written = {op for kind in KINDS if fused.get(kind.name, 0) for op in kind.ops}
    written |= set(allowed)
    before, after = op_counts(raw), op_counts(published)
    return {op: (before[op], n) for op, n in after.items() if n > before[op] and op not in written}
