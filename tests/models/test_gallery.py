"""One table-driven test over the gallery (:data:`models.norms.GALLERY`), through both exporters.

For each entry and export: ``fusion.optimize`` must produce the entry's fused op (and nothing
of the decomposed norm), fold its BatchNorm, or refuse it with the declared reason and change
no op; the result must pass the full ONNX checker, load in ONNX Runtime, match PyTorch on random
inputs and on the eps probes (constant, zeros, 1e-4 and 1e3 scales) within the entry's
tolerances, never with NaN / Inf where PyTorch has none, and within float32 noise of the raw
export (no noise-ratio warning: every rewrite is exact); and a second ``fusion.optimize`` must
change nothing.

The matrix: every entry on dynamo opset 18 and TorchScript opset 17 (where it exports), the
LayerNorm and RMSNorm entries also on dynamo opset 23 (RMSNormalization). Dynamo exports
dominate the run time; ``NORMEXPORT_GALLERY=full`` runs every export of ``Entry.exports()``
(dynamo opset 20 too, about twice as long).
"""

from __future__ import annotations

import os
from collections import Counter

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import fusion
from fusion.registry import KINDS
from models.norms import DECOMPOSED, FOLDED, GALLERY, Entry, torch_outputs
from normexport.io.export import ExportError, export_module
from normexport.io.inputs import input_sets
from normexport.runtime import cuda_kernels, make_session, run
from normexport.verdict.parity import check_parity

pytestmark = pytest.mark.slow  # exports every gallery entry

torch.set_num_threads(1)

#: The report count each family's rewrites go to.
COUNT_KEY = {kind.family: kind.name for kind in KINDS if kind.norm}  # each norm family's count

IR_DTYPE = {
    torch.float32: ir.DataType.FLOAT,
    torch.float16: ir.DataType.FLOAT16,
    torch.bfloat16: ir.DataType.BFLOAT16,
}


AS_WRITTEN = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

FULL = os.environ.get("NORMEXPORT_GALLERY") == "full"


def _selected(entry: Entry, exporter: str, opset: int) -> bool:
    return (
        FULL
        or (exporter, opset) in {("dynamo", 18), ("torchscript", 17)}
        or (opset == 23 and entry.family != "batchnorm")
    )


CASES = [
    pytest.param(entry, exporter, opset, id=f"{entry.name}-{exporter}{opset}")
    for entry in GALLERY
    for exporter, opset in entry.exports()
    if _selected(entry, exporter, opset)
]


def _ops(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


def _check_expectation(entry: Entry, opset: int, raw: Counter, model: ir.Model, report) -> None:
    """What ``fusion.optimize`` must have made of the entry (see ``Entry.expect``)."""
    ops = _ops(model)
    count = report.counts[COUNT_KEY[entry.family]]
    if entry.expect is None:
        family = entry.refused_by or entry.family
        reasons = [r.detail for r in report.refused if r.family == family]
        assert any(entry.refused in reason for reason in reasons), report.refused
        assert count == 0 and ops == raw, (report.to_dict(), ops)
        return
    assert not DECOMPOSED[entry.family] & set(ops), ops
    # a block's branches: the TorchScript exporter folds some Conv + BatchNorm pairs itself
    norms = raw["BatchNormalization"] if entry.convs is not None else entry.norms
    assert count == (0 if ops == raw else norms), (report.to_dict(), raw, ops)
    if entry.expect == FOLDED:
        assert fusion.norm_ops(model) == {}
        assert entry.convs is None or ops["Conv"] == entry.convs, ops
        return
    op = entry.expected_op(opset)
    assert fusion.norm_ops(model) == {op: entry.norms}
    assert ops["Cast"] == entry.casts(), ops
    for node in (n for n in model.graph if n.op_type == op):
        assert node.inputs[0].dtype == IR_DTYPE[entry.fused_dtype]
        if op != "SimplifiedLayerNormalization":
            assert node.attributes.get_int("stash_type", 1) == 1


def _fallbacks(model: ir.Model) -> Counter:
    """The ops of ``model`` the CUDA provider has no kernel for, with their node counts."""
    return Counter(f.op for f in cuda_kernels.without_kernel(model))


def _runner(model: ir.Model):
    """``model`` (as it is now) run on ONNX Runtime's CPU provider as written; None where ORT
    has no kernel for its ops there (the bfloat16 entries' Mul, before the passes)."""
    try:
        session = make_session(model, "cpu", optimization_level=AS_WRITTEN)
    except ort.capi.onnxruntime_pybind11_state.NotImplemented:
        return None
    return lambda feeds: run(session, feeds)


@pytest.mark.parametrize(("entry", "exporter", "opset"), CASES)
def test_gallery_entry(entry: Entry, exporter: str, opset: int):
    module = entry.build()
    example = entry.example()
    try:
        model = export_module(
            module, (example,), opset=opset, input_names=["x"], exporter=exporter
        ).model
    except ExportError as err:
        if exporter == "dynamo" and "No ONNX function found" in str(err):  # asked of this torch
            # aten.adaptive_max_pool2d on torch 2.9.1 and 2.10.0; 2.13 and later export it
            # (docs/compat.md, measured by make compat)
            pytest.skip(
                f"torch {torch.__version__}'s dynamo exporter has no ONNX function for an op of "
                f"{entry.name!r} (asked with --exporter dynamo): {err}"
            )
        raise
    raw = _ops(model)
    raw_run = _runner(model)  # before the passes
    raw_fallbacks = _fallbacks(model)

    report = fusion.optimize(model)

    _check_expectation(entry, opset, raw, model, report)
    # what the passes wrote runs on CUDA wherever the export did (ONNX Runtime's kernel table)
    assert _fallbacks(model) <= raw_fallbacks, cuda_kernels.without_kernel(model)
    fusion.check(model)
    make_session(model, "cpu")  # loads as deployed, under ORT's own optimizations
    # Parity of the model as written: ORT's session fusions would judge ORT (they turn the
    # float64 LayerNorm into a LayerNormalization accurate to float32 only, 1e-7 off).
    session = make_session(model, "cpu", optimization_level=AS_WRITTEN)
    parity = check_parity(
        lambda feeds: run(session, feeds),
        lambda feeds: torch_outputs(module, feeds),
        input_sets({"x": example.numpy()}, n_random=2),
        ["y"],
        reference_kind="pytorch",
        atol=entry.atol,
        rtol=entry.rtol,
        raw=raw_run,
    )
    assert parity.passed, parity.failures()
    assert not parity.warnings(), parity.warnings()  # exact: within float32 noise of the raw
    before = ir.to_proto(model).SerializeToString()
    again = fusion.optimize(model)
    assert not any(again.counts.values()), again.to_dict()
    assert ir.to_proto(model).SerializeToString() == before
