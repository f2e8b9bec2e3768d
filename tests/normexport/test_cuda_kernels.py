"""The CUDA kernel check (normexport.runtime.cuda_kernels): ONNX Runtime's CUDA kernel table
read, and the nodes of a model it has no kernel for found, without a GPU.

The gallery test (tests/models/test_gallery.py) checks that no pass adds a node the CUDA
provider has no kernel for; here, the check itself on graphs built with onnx-ir.
"""

from __future__ import annotations

import onnx_ir as ir
import pytest

from normexport.runtime import cuda_kernels

F, H, B = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16

TABLE = """\
## Operators implemented by CPUExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|Abs|*in* X:**T**<br> *out* Y:**T**|13+|**T** = tensor(float)|

<a name="cudaexecutionprovider"/>

## Operators implemented by CUDAExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|Add|*in* A:**T**<br> *in* B:**T**<br> *out* C:**T**|14+|**T** = tensor(float), tensor(float16)|
|||[7, 13]|**T** = tensor(float)|
|**Operator Domain:** *com.microsoft*||||
|GroupNorm|*in* X:**T**<br> *out* Y:**T**|1+|**T** = tensor(float), tensor(float16)<br/> \
**M** = seq(tensor(int64))|

<a name="dmlexecutionprovider"/>

## Operators implemented by DmlExecutionProvider
|**Operator Domain:** *ai.onnx*||||
|Abs|*in* X:**T**<br> *out* Y:**T**|13+|**T** = tensor(float)|
"""


def test_the_cuda_section_is_parsed_and_nothing_else():
    assert cuda_kernels.parse(TABLE) == [
        {"domain": "ai.onnx", "op": "Add", "since": 14, "until": None,
         "types": {"T": ["float", "float16"]}},
        {"domain": "ai.onnx", "op": "Add", "since": 7, "until": 13, "types": {"T": ["float"]}},
        {"domain": "com.microsoft", "op": "GroupNorm", "since": 1, "until": None,
         "types": {"T": ["float", "float16"], "M": ["seq(int64)"]}},
    ]  # fmt: skip
    with pytest.raises(ValueError, match="version does not parse"):
        cuda_kernels.parse(TABLE.replace("|14+|", "|14 or later|"))
    with pytest.raises(ValueError, match="no CUDAExecutionProvider"):
        cuda_kernels.parse(TABLE.split('<a name="cudaexecutionprovider"/>')[0])


def test_the_table_kept_names_its_source_and_the_ops_normexport_writes():
    source = cuda_kernels.source()
    assert source["path"] == "docs/OperatorKernels.md" and source["ref"]
    table = cuda_kernels.kernels()
    for op in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization", "GroupNorm"):
        assert ("com.microsoft", op) in table
    assert ("ai.onnx", "LayerNormalization") in table


def _model(op: str, dtype: ir.DataType, *, domain: str = "", opset: int = 18, n_in: int = 1):
    """One ``op`` node on ``n_in`` inputs of ``dtype`` (shape (2, 8)), its output typed alike."""
    inputs = [ir.Value(name=f"x{i}", type=ir.TensorType(dtype), shape=ir.Shape([2, 8]))
              for i in range(n_in)]  # fmt: skip
    node = ir.node(op, inputs, domain=domain, name=f"{op}_0")
    node.outputs[0].name, node.outputs[0].dtype = "y", dtype
    opsets = {"": opset} | ({domain: 1} if domain else {})
    graph = ir.Graph(inputs, [node.outputs[0]], nodes=[node], opset_imports=opsets)
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize(
    ("op", "dtype", "domain", "opset", "n_in"),
    [
        ("SkipSimplifiedLayerNormalization", H, "com.microsoft", 18, 3),
        ("SkipLayerNormalization", B, "com.microsoft", 18, 4),
        ("LayerNormalization", H, "", 17, 2),
        ("SimplifiedLayerNormalization", F, "", 18, 2),
        ("RMSNormalization", B, "", 23, 2),
        ("Add", F, "", 14, 2),
    ],
)
def test_the_forms_normexport_writes_have_cuda_kernels(op, dtype, domain, opset, n_in):
    assert (
        cuda_kernels.without_kernel(_model(op, dtype, domain=domain, opset=opset, n_in=n_in)) == []
    )


def test_nodes_without_a_cuda_kernel_are_named_with_what_is_missing():
    """No kernel at all (LpNormalization), none for the type (GroupQueryAttention takes
    float16 and bfloat16 only, GroupNorm no bfloat16); an op ONNX defines by a function
    (GroupNormalization, CastLike) is inlined by ONNX Runtime, not a fallback."""
    found = cuda_kernels.without_kernel(_model("LpNormalization", F, opset=18))
    assert [(f.node, f.op, f.version) for f in found] == [
        ("LpNormalization_0", "ai.onnx.LpNormalization", 1)
    ]
    assert "no CUDA kernel for ai.onnx.LpNormalization" in found[0].why
    assert cuda_kernels.without_kernel(_model("GroupNormalization", F, opset=21, n_in=3)) == []
    assert cuda_kernels.without_kernel(_model("CastLike", F, opset=21, n_in=2)) == []
    gqa = _model("GroupQueryAttention", F, domain="com.microsoft", n_in=3)
    (found,) = cuda_kernels.without_kernel(gqa)
    assert "input 0 (x0) is float" in found.why and "float16" in found.why
    (norm,) = cuda_kernels.without_kernel(_model("GroupNorm", B, domain="com.microsoft"))
    assert "bfloat16" in norm.why
    assert cuda_kernels.without_kernel(_model("GroupNorm", H, domain="com.microsoft")) == []


def test_the_report_says_which_nodes_fall_back(tmp_path):
    """On the CPU provider the report has no CUDA check (null); with fallbacks (as a CUDA run
    finds them), the terminal names each node and why, and the JSON lists them."""
    import dataclasses

    from rich.console import Console

    import normexport
    from normexport import report as report_mod
    from normexport.io import files

    path = tmp_path / "m.onnx"
    files.save_model(_model("Add", F, opset=14, n_in=2), path, external_data=False)
    report = normexport.optimize(path, output=tmp_path / "o.onnx", benchmark=False)
    assert report.cuda_fallbacks is None and report.to_dict()["cuda_fallbacks"] is None
    found = cuda_kernels.without_kernel(_model("LpNormalization", F, opset=18))
    console = Console(record=True, width=300)
    report_mod.render(dataclasses.replace(report, cuda_fallbacks=found), console)
    text = console.export_text()
    assert "1 node(s) have no CUDA kernel" in text and "LpNormalization_0" in text
    clean = dataclasses.replace(report, cuda_fallbacks=[])
    assert clean.to_dict()["cuda_fallbacks"] == []
    console = Console(record=True, width=300)
    report_mod.render(clean, console)
    assert "every node has a CUDA kernel" in console.export_text()


@pytest.mark.parametrize(("opset", "kept"), [(11, ["Clip"]), (13, [])])
def test_half_conversion_for_cuda_keeps_float32_an_op_whose_kernel_lacks_float16(
    tmp_path, monkeypatch, opset, kept
):
    """Clip-11's CUDA kernel is float32 only: ONNX Runtime loads its float16 node on CUDA
    without an error and runs it on the CPU, so the conversion for CUDA asks the kernel table
    too and keeps Clip float32 (with the session stubbed: no GPU here); Clip-13 has a float16
    kernel and converts."""
    import numpy as np
    from onnx import TensorProto

    from normexport.io import files
    from normexport.precision import convert, kernels
    from tests.support.graphs import make_model

    model = make_model(
        [("Relu", ["x"], ["r"], {}), ("Clip", ["r", "lo", "hi"], ["y"], {"name": "clip"})],
        {"x": (TensorProto.FLOAT, [2, 8])},
        {"y": (TensorProto.FLOAT, [2, 8])},
        {"lo": np.array(0.25, np.float32), "hi": np.array(0.75, np.float32)},
        opset=opset,
        ir_version=7,
    )
    src, dst = tmp_path / "f32.onnx", tmp_path / "f16.onnx"
    files.save_model(model, src, external_data=False)
    monkeypatch.setattr(kernels.runtime, "make_session", lambda *args, **kwargs: None)
    found = convert.to_half(src, dst, provider="cuda", keep_io_types=False, external_data=False)
    assert found.float32_op_types == kept
    converted = ir.load(dst)
    assert cuda_kernels.without_kernel(converted) == []
    clip = next(n for n in converted.graph if n.op_type == "Clip")
    assert clip.inputs[0].dtype == (F if kept else H)
    assert kernels.lacking_on_cuda(dst) is None
