"""The kernel question for half precision: which op types ONNX Runtime has no kernel of the
target type for on the provider (:func:`missing_kernel`; :func:`to_block` names what to keep
float32 until the model loads), and whether a bfloat16 model is worth having
(:func:`must_run_in_half`; :func:`bf16_refusal` the refusal, a
:class:`normexport.errors.UsageError`). The rules: docs/precision.md#float16 and
docs/precision.md#bfloat16.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from fusion.base import Op
from fusion.registry import LINEAR_OPS, NORM_OPS
from normexport import runtime
from normexport.runtime import cuda_kernels

#: The half-precision types a conversion writes.
_HALF_TYPES = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)

#: ONNX Runtime's errors for an op type it cannot run in the given type: no kernel registered
#: (NOT_IMPLEMENTED), or a type the op's schema does not allow at the model's opset (bfloat16
#: came to most ops at opset 13).
_NO_KERNEL = (
    re.compile(r"Could not find an implementation for (\w+)\("),
    re.compile(r"Type 'tensor\((?:b?float16)\)' of \w+ parameter \(.*?\) of operator \((\w+)\)"),
)


def missing_kernel(path: Path, provider: str) -> str | None:
    """The op type ONNX Runtime reports no kernel for when loading ``path`` on ``provider``
    (NOT_IMPLEMENTED, or a type error: the op's schema does not allow the type at the model's
    opset), or on CUDA the first op type whose CUDA kernel lacks the half type
    (:func:`lacking_on_cuda`); None when the model loads and runs wholly on the provider.

    Raises:
        Exception: ONNX Runtime's own error, for any other failure to load.
    """
    try:
        runtime.make_session(path, provider, optimization_level=runtime.AS_WRITTEN, spinning=False)
    except runtime.ProviderUnavailable:
        raise
    except Exception as err:  # ORT's own error types
        found = next((m for p in _NO_KERNEL if (m := p.search(str(err)))), None)
        if found is None:
            raise
        return found.group(1)
    return lacking_on_cuda(path) if provider == "cuda" else None


def lacking_on_cuda(path: Path) -> str | None:
    """The op type of the first node of the model at ``path`` whose CUDA kernel takes no
    float16 or bfloat16 where the node has it, by ONNX Runtime's kernel table
    (:mod:`normexport.runtime.cuda_kernels`), or None.

    Where the CPU provider has a kernel of that type, ONNX Runtime loads such a model on CUDA
    without a word and runs the node on the CPU, copying its tensors across: ppocr-cls's
    ``Clip`` (opset 11, whose CUDA kernel is float32 only) made its float16 model slower than
    the float32 export (``benchmarks/results/parity_cuda.json``). Kept in float32, the node
    runs on CUDA.
    """
    model = ir.load(path)
    for fallback in cuda_kernels.without_kernel(model):
        if any(cuda_kernels.lacks_type(fallback, t) for t in _HALF_TYPES):
            return fallback.op.rsplit(".", 1)[-1]
    return None


def to_block(missing: str, model: onnx.ModelProto, blocked: Sequence[str]) -> list[str]:
    """The op types of ``model`` to keep float32 where ONNX Runtime reports no kernel for
    ``missing``: ``missing`` itself where the model has it, else the op types whose ONNX
    function body uses it (ONNX Runtime runs an op it has no kernel for, Relu or Softmax, by
    its function body, and reports the body's op, Max or ReduceMax); those not yet ``blocked``.

    Raises:
        RuntimeError: none is left to block (a bug: the report names an op already float32).
    """
    present = {n.op_type for n in model.graph.node}
    if missing in present:
        found = [missing]
    else:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        users = (n.op_type for n in model.graph.node if missing in _function_ops(n, opset))
        found = list(dict.fromkeys(users))
    found = [op for op in found if op not in blocked]
    if not found:
        raise RuntimeError(f"no {missing} kernel although every op using it stayed float32")
    return found


def _function_ops(node: onnx.NodeProto, opset: int) -> set[str]:
    """The op types of ``node``'s ONNX function body at ``opset`` (ONNX spec, "Functions";
    context-dependent bodies built for bfloat16 inputs); empty where it has none."""
    if node.domain not in ("", "ai.onnx") or not onnx.defs.has(node.op_type):
        return set()
    schema = onnx.defs.get_schema(node.op_type, opset)
    if schema.has_function:
        return {n.op_type for n in schema.function_body.node}
    if not schema.has_context_dependent_function:
        return set()
    kind = onnx.helper.make_tensor_type_proto(onnx.TensorProto.BFLOAT16, None)
    try:
        body = schema.get_context_dependent_function(
            node.SerializeToString(), [kind.SerializeToString()] * len(node.input)
        )
    except Exception:  # onnx's schema error types: no body for these inputs
        return set()
    return {n.op_type for n in onnx.FunctionProto.FromString(body).node}


def must_run_in_half(model: ir.Model) -> set[str]:
    """The op types a bfloat16 copy of ``model`` must run in bfloat16 to be worth having: its
    :data:`fusion.registry.LINEAR_OPS` (weights and most of the arithmetic), else its
    :data:`fusion.registry.NORM_OPS`, else all its op types."""
    nodes = list(model.graph.all_nodes())
    present = {n.op_type for n in nodes}
    norms = {n.op_type for n in nodes if Op(n.op_type, n.domain) in NORM_OPS}
    return (present & set(LINEAR_OPS)) or norms or present


def bf16_refusal(provider: str, lacking: Sequence[str], heavy: Iterable[str]) -> str:
    """The message refusing ``--precision bf16`` on ``provider``: ONNX Runtime reported no
    bfloat16 kernel for ``lacking`` (in the order it did), among them op types of ``heavy``
    (:func:`must_run_in_half`)."""
    advice = "use --precision fp16"
    if provider != "cuda":
        advice += ", or --provider cuda where ONNX Runtime has bfloat16 kernels"
    stuck = ", ".join(op for op in lacking if op in set(heavy))
    return (
        f"--precision bf16: ONNX Runtime's {runtime.PROVIDERS[provider][0]} has no bfloat16 "
        f"kernel for {', '.join(lacking)} (NOT_IMPLEMENTED when loading the converted model): "
        f"the model's {stuck} would stay float32 and nothing heavy would run in bfloat16; " + advice
    )
