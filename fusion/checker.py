""":func:`check`: the ONNX checker on a model file (or an in-memory model), ONNX Runtime's
default-domain ops checked as the custom ops they are."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

from fusion.registry import ort_registered


def check(model: ir.Model | str | os.PathLike, *, full_check: bool = True) -> None:
    """Run the ONNX checker on a model file, or on an in-memory model.

    A model is checked from a file, never as one protobuf in memory: the checker then resolves
    external data itself and handles models over protobuf's 2 GiB limit. An in-memory model is
    written to a temporary folder first (with external data).

    The ONNX Runtime ops (:func:`ort_registered`) live in the default domain, where the checker
    looks them up among the standard ops and fails; they are checked as custom-domain ops instead,
    on a copy of the graph (no tensors) written beside the model file, so that every standard op is
    still fully checked (in the subgraphs too). Loading the model in an ONNX Runtime session
    validates those nodes themselves.

    Args:
        model: an .onnx path, or an onnx_ir model.
        full_check: also run ONNX shape inference in strict mode (``check_model``'s
            ``full_check``).

    Raises:
        onnx.checker.ValidationError: the model is not valid ONNX.
        onnx.shape_inference.InferenceError: with ``full_check``, shapes contradict each other.
    """
    if isinstance(model, ir.Model):
        with tempfile.TemporaryDirectory(prefix="fusion-check-") as tmp:
            path = Path(tmp) / "model.onnx"
            ir.save(model, path, external_data="model.onnx.data", size_threshold_bytes=1024)
            check(path, full_check=full_check)
        return
    path = Path(model)
    proto = onnx.load(path, load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    ort_nodes = [n for n in _nodes(proto.graph) if ort_registered(n.op_type, n.domain, opset)]
    if not ort_nodes:
        onnx.checker.check_model(path, full_check=full_check)
        return
    for node in ort_nodes:
        node.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    # Beside the model, so that its external data paths resolve from the copy too.
    fd, copy = tempfile.mkstemp(dir=path.parent, prefix=".check-", suffix=".onnx")
    os.close(fd)
    try:
        onnx.save(proto, copy)
        onnx.checker.check_model(copy, full_check=full_check)
    finally:
        os.unlink(copy)


def _nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` and of its subgraphs (``If``, ``Loop``, ``Scan`` bodies), at any
    depth."""
    nodes = []
    for node in graph.node:
        nodes.append(node)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                nodes += _nodes(sub)
    return nodes
