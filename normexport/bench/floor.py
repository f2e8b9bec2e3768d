"""The elementwise floor: the first fused norm of normexport's model, alone, against one
elementwise op (Relu: one read, one write) over the same tensor on the same provider: how far
the norm is from the memory-bound limit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from fusion.base import Op
from fusion.registry import FUSED_NORM_OPS
from normexport import runtime
from normexport.bench import variants
from normexport.bench.results import Floor
from normexport.latency.measure import paired_ratio, runner, time_interleaved


def _norm_input_shapes(model: Path, feeds, provider: str) -> tuple[ir.Model, ir.Node, dict]:
    """normexport's model, its first fused norm node, and that node's input shapes (probed by
    running a copy of the model with the node's inputs added as graph outputs)."""
    copy = ir.load(model)
    node = next((n for n in copy.graph if Op(n.op_type, n.domain) in FUSED_NORM_OPS), None)
    if node is None:
        return copy, None, {}
    probed = [
        v for v in node.inputs if v is not None and ir.convenience.get_const_tensor(v) is None
    ]
    extra = [v for v in probed if not v.is_graph_output() and not v.is_graph_input()]
    copy.graph.outputs.extend(extra)
    session = runtime.make_session(copy, provider, spinning=False)
    names = [o.name for o in session.get_outputs()]
    arrays = dict(zip(names, runtime.run(session, feeds), strict=True)) | feeds
    for value in extra:
        copy.graph.outputs.remove(value)
    return copy, node, {v.name: tuple(arrays[v.name].shape) for v in probed}


def norm_floor(
    model: Path, feeds: dict[str, np.ndarray], provider: str, budget_s: float = 3.0
) -> Floor | None:
    """Time the first fused norm (:data:`fusion.registry.FUSED_NORM_OPS`) of the model file
    ``model`` alone and one Relu over its input tensor.

    Both run with IO binding on ``provider``, interleaved, for ``budget_s`` seconds. Relu reads
    the tensor once and writes it once, the least any op over it can do: ``norm_over_floor``
    says how far the norm is from that memory-bound limit.

    Returns:
        The :class:`~normexport.bench.results.Floor` (timings in ms), or None when the model has
        no fused norm.
    """
    copy, node, shapes = _norm_input_shapes(model, feeds, provider)
    if node is None:
        return None
    x = node.inputs[0].name
    shape = shapes[x]
    single = variants.isolate_node(copy, node, shapes)
    rng = np.random.default_rng(0)
    norm_feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    relu = variants.op_model("Relu", shape)
    runners = {}
    for name, m, f in (
        ("norm", single, norm_feeds),
        ("elementwise", relu, {"x": norm_feeds[x]}),
    ):
        session = runtime.make_session(m, provider, spinning=False)
        runners[name] = runner(session, f, io_binding=True)[0]
    t = time_interleaved(runners, budget_s=budget_s)
    return Floor(
        node=node.name,
        op=node.op_type,
        shape=list(shape),
        provider=runtime.PROVIDERS[provider][0],
        norm=t["norm"],
        elementwise=t["elementwise"],
        norm_over_floor=paired_ratio(t["norm"], t["elementwise"]),
    )
