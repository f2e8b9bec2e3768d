"""Which nodes of a model ONNX Runtime's CUDA execution provider has no kernel for, checked
without a GPU, against ONNX Runtime's own kernel table kept as :data:`TABLE`
(``cuda_kernels.json`` beside this module; ``tools/refresh_cuda_kernels.py`` rebuilds it with
:func:`parse`). :func:`without_kernel` lists a model's nodes without one, each a
:class:`Fallback`; :func:`lacks_type` asks of one whether the kernel lacks a type. The table's
source and the matching rule (schema version, type constraints, ops that need no kernel):
docs/cuda.md#the-table and docs/cuda.md#the-check.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import onnx
import onnx_ir as ir

#: The kernel table's file: ``{"source": {...}, "kernels": [{"domain", "op", "since", "until",
#: "types": {constraint: [type, ...]}}, ...]}``.
TABLE = Path(__file__).with_name("cuda_kernels.json")
#: Ops ONNX Runtime runs without a kernel.
_NO_KERNEL_NEEDED = frozenset({("ai.onnx", "Constant")})


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A node the CUDA provider has no kernel for (ONNX Runtime runs it on the CPU).

    Attributes:
        node: its name.
        op: ``domain.op_type`` (``ai.onnx`` for the default domain).
        version: the op's schema version at the model's opset.
        why: what is missing: the op, the version, or the type (naming the input and the
            types the kernels take).
    """

    node: str
    op: str
    version: int
    why: str


@functools.cache
def _table() -> dict:
    """:data:`TABLE`, read once."""
    return json.loads(TABLE.read_text())


@functools.cache
def kernels() -> dict[tuple[str, str], list[dict]]:
    """The CUDA kernels of :data:`TABLE` by (domain, op type)."""
    found: dict[tuple[str, str], list[dict]] = {}
    for kernel in _table()["kernels"]:
        found.setdefault((kernel["domain"], kernel["op"]), []).append(kernel)
    return found


def source() -> dict:
    """Where :data:`TABLE` comes from (repository, path, commit, ONNX Runtime version)."""
    return _table()["source"]


@functools.cache
def _schemas() -> dict[tuple[str, str], list]:
    """ONNX Runtime's op schemas (ONNX's and its contrib ops) by (domain, op type), by
    version."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    found: dict[tuple[str, str], list] = {}
    for schema in ort_state.get_all_operator_schema():
        found.setdefault((schema.domain or "ai.onnx", schema.name), []).append(schema)
    for versions in found.values():
        versions.sort(key=lambda s: s.since_version)
    return found


def without_kernel(model: ir.Model) -> list[Fallback]:
    """Every node of ``model`` (subgraphs included) the CUDA provider has no kernel for, in
    graph order (the rule: docs/cuda.md#the-check)."""
    found = []
    for node in model.graph.all_nodes():
        domain = node.domain or "ai.onnx"
        if (domain, node.op_type) in _NO_KERNEL_NEEDED:
            continue
        opset = model.opset_imports.get(node.domain or "", model.opset_imports.get(domain, 1))
        why, version = _why(node, domain, opset)
        if why is not None:
            found.append(Fallback(node.name, f"{domain}.{node.op_type}", version, why))
    return found


def _why(node: ir.Node, domain: str, opset: int) -> tuple[str | None, int]:
    """Why ``node`` has no CUDA kernel (None: it has one), and its schema version."""
    versions = [s for s in _schemas().get((domain, node.op_type), []) if s.since_version <= opset]
    schema = versions[-1] if versions else None
    version = schema.since_version if schema is not None else opset
    candidates = kernels().get((domain, node.op_type), [])
    if not candidates and _has_function(domain, node.op_type, version):
        return None, version  # ONNX Runtime inlines its function body (CastLike: a Cast)
    if not candidates:
        return f"no CUDA kernel for {domain}.{node.op_type}", version
    ranged = [k for k in candidates if k["since"] <= version <= (k["until"] or version)]
    if not ranged:
        spans = ", ".join(
            f"{k['since']}+" if k["until"] is None else f"{k['since']}-{k['until']}"
            for k in candidates
        )
        return f"no CUDA kernel for version {version} (only {spans})", version
    if schema is None:
        return None, version
    problems = [_type_problem(node, schema, k["types"]) for k in ranged]
    if all(problems):
        return problems[0], version
    return None, version


def lacks_type(fallback: Fallback, dtype: ir.DataType) -> bool:
    """Whether ``fallback`` is there because no CUDA kernel of its op and version takes
    ``dtype`` for one of its inputs or outputs (the op and the version have a kernel)."""
    return f" is {_type_name(dtype)}; the CUDA kernel takes " in fallback.why


def _has_function(domain: str, op: str, version: int) -> bool:
    """Whether ONNX defines the op by a function body (fixed, or built from the node)."""
    if domain != "ai.onnx":
        return False
    try:
        schema = onnx.defs.get_schema(op, version, "")
    except onnx.defs.SchemaError:
        return False
    return schema.has_function or schema.has_context_dependent_function


def _type_problem(node: ir.Node, schema, allowed: dict[str, list[str]]) -> str | None:
    """The first input or output of ``node`` whose type the kernel's constraints do not admit
    (``None``: all admitted, or not annotated)."""
    for values, formals, what in (
        (node.inputs, schema.inputs, "input"),
        (node.outputs, schema.outputs, "output"),
    ):
        for index, value in enumerate(values):
            if value is None or value.dtype is None or not formals:
                continue
            formal = formals[min(index, len(formals) - 1)]
            types = allowed.get(formal.typeStr)
            name = _type_name(value.dtype)
            if types is not None and name not in types:
                return (
                    f"{what} {index} ({value.name}) is {name}; the CUDA kernel takes "
                    f"{formal.typeStr} in {', '.join(types)}"
                )
    return None


def _type_name(dtype: ir.DataType) -> str:
    """The table's name of ``dtype`` (``float``, ``float16``, ``int64``...)."""
    return {ir.DataType.FLOAT: "float", ir.DataType.DOUBLE: "double"}.get(dtype, dtype.name.lower())


def parse(markdown: str) -> list[dict]:
    """The CUDAExecutionProvider section of ONNX Runtime's ``docs/OperatorKernels.md`` as
    kernel entries (``domain``, ``op``, ``since``, ``until`` inclusive or None, ``types``:
    constraint -> type names without ``tensor(...)``), in the file's order.

    Raises:
        ValueError: the section is missing, or a row does not parse (nothing is guessed).
    """
    start = markdown.find("## Operators implemented by CUDAExecutionProvider")
    if start < 0:
        raise ValueError("no CUDAExecutionProvider section")
    end = markdown.find('<a name="', start)
    section = markdown[start : end if end > 0 else None]
    found, domain, op = [], None, None
    for line in section.splitlines():
        heading = re.fullmatch(r"\|\*\*Operator Domain:\*\* \*([^*]+)\*\|\|\|\|", line)
        if heading:
            domain = heading.group(1)
            continue
        if not line.startswith("|") or line.startswith(("| Op Name", "|---", "| |")):
            continue
        cells = line[1:-1].split("|")
        if len(cells) != 4 or domain is None:
            raise ValueError(f"row does not parse: {line[:80]}")
        op = cells[0] or op
        since, until = _versions(cells[2])
        found.append(
            {"domain": domain, "op": op, "since": since, "until": until, "types": _types(cells[3])}
        )
    return found


def _versions(cell: str) -> tuple[int, int | None]:
    """``13+`` -> (13, None); ``13`` -> (13, 13); ``[7, 12]`` -> (7, 12)."""
    if match := re.fullmatch(r"(\d+)\+", cell):
        return int(match.group(1)), None
    if match := re.fullmatch(r"\d+", cell):
        return int(cell), int(cell)
    if match := re.fullmatch(r"\[(\d+), (\d+)\]", cell):
        return int(match.group(1)), int(match.group(2))
    raise ValueError(f"version does not parse: {cell!r}")


def _types(cell: str) -> dict[str, list[str]]:
    """``**T** = tensor(float), tensor(float16)<br/> **T1** = ...`` -> constraint -> types."""
    found = {}
    for part in cell.split("<br/> "):
        match = re.fullmatch(r"\*\*(\w+)\*\* = (.+)", part)
        if match is None:
            raise ValueError(f"types do not parse: {part!r}")
        names = [re.sub(r"tensor\((\w+)\)", r"\1", t) for t in match.group(2).split(", ")]
        found[match.group(1)] = names
    return found
