"""The oracle's float64 graph (:class:`Float64Graph`): an ONNX model widened to float64 in
place, made runnable on ONNX Runtime's CPU provider node by node. What is widened, the float64
forms of the ops ONNX Runtime has no float64 kernel for, the float32 islands, and what they do
to the oracle's error: docs/parity.md#the-oracles-float64-graph.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import re
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnx_ir import traversal

from fusion.base import Op
from fusion.registry import STASH_NORM_OPS
from normexport import runtime
from normexport.verdict import float64_forms

FLOAT, DOUBLE = ir.DataType.FLOAT, ir.DataType.DOUBLE


@dataclasses.dataclass
class Float32Nodes:
    """Nodes of one op type that the oracle runs in float32 (as written, between casts).

    Attributes:
        op_type, domain: the op.
        nodes: the nodes' names.
        why: why not in float64 (no float64 kernel, or the reason ONNX Runtime gave).
    """

    op_type: str
    domain: str
    nodes: list[str]
    why: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Float64Graph:
    """``model`` computed in float64 where it computes in float32, in place: its float32
    initializers, ``Constant`` / ``ConstantOfShape`` values, type attributes (``Cast(to=float)``
    and the like), norms' ``stash_type`` and the inputs and outputs of every graph become
    float64; an input the ONNX spec types float-only is cast back where no output of its node
    was float32 (an int8 ``Resize``'s scales; elsewhere the node is probed whole). Then
    every node whose float64 form ONNX Runtime's CPU provider cannot run (probed one node at a
    time, :func:`_kernel`) is computed another way in float64 where that is exact
    (:mod:`normexport.verdict.float64_forms`: ``Conv`` by taps, ...), else made a float32
    island (:meth:`island`). Float16 and bfloat16 values stay as they are.

    Attributes:
        model: the widened model.
        quantizes: the model quantizes values it computes (the self-check's rule).
        float32: the islands, per op type, for the report.
        forms: op type -> how many nodes were replaced by a float64 form.
    """

    def __init__(self, model: ir.Model):
        self.model = model
        common_passes.InlinePass()(model)  # ONNX Runtime inlines them too; islands need nodes
        model.graph.sort()
        _name_nodes(model)  # ONNX Runtime's errors name the node that failed
        # Each value's type before widening (None: unknown), and in the float64 graph.
        self.written_types = _types(model)
        self.types = {v: DOUBLE if t == FLOAT else t for v, t in self.written_types.items()}
        self.shapes = {v: v.shape for v in self.written_types}
        self.written_attributes: dict[ir.Node, dict[str, ir.Attr | None]] = {}
        self.float32: list[Float32Nodes] = []
        self.quantizes = any(_quantizes(n) for n in _nodes(model))
        _widen_graphs(model, self)
        self.forms = float64_forms.apply(self)
        lacking = [n for n in _nodes(model) if self.widened(n) and self.lacks(n)]
        for group in _grouped(self, lacking):
            self.island(group, "ONNX Runtime's CPU provider has no float64 kernel")

    def widened(self, node: ir.Node) -> bool:
        """Whether ``node`` reads a value that was float32 and is float64 now."""
        return any(v is not None and self.is_widened(v) for v in node.inputs)

    def lacks(self, node: ir.Node) -> bool:
        """Whether ONNX Runtime's CPU provider has no kernel for ``node`` as widened
        (:func:`_kernel`)."""
        return not _kernel(self, node)

    def is_widened(self, value: ir.Value) -> bool:
        return self.written_types.get(value) == FLOAT and self.types.get(value) == DOUBLE

    def island(self, nodes: list[ir.Node], why: str) -> None:
        """Run ``nodes`` (of one op type) as written in float32: their attributes as written,
        a Cast to float32 on each widened input, a Cast back to float64 on each output that
        was float32."""
        for node in nodes:
            for name, attr in self.written_attributes.pop(node, {}).items():
                if attr is None:
                    node.attributes.pop(name)
                else:
                    node.attributes[name] = attr
            for index, value in enumerate(node.inputs):
                if value is not None and self.is_widened(value):
                    cast = self.cast_input(node, index, FLOAT)
                    self.written_types[cast] = FLOAT
            for value in node.outputs:
                if self.written_types.get(value) == FLOAT:
                    self._cast_output(node, value)
        first = nodes[0]
        entry = Float32Nodes(first.op_type, first.domain, [n.name or "" for n in nodes], why)
        self.float32.append(entry)

    def cast_input(self, node: ir.Node, index: int, dtype: ir.DataType) -> ir.Value:
        """Put a ``Cast(to=dtype)`` in front of ``node``'s input ``index``; its output."""
        cast = ir.node("Cast", [node.inputs[index]], {"to": dtype})
        node.graph.insert_before(node, cast)
        node.replace_input_with(index, cast.outputs[0])
        self.types[cast.outputs[0]] = dtype
        return cast.outputs[0]

    def _cast_output(self, node: ir.Node, value: ir.Value) -> None:
        """``value`` (float32 now) cast to float64 for every reader, the graph output too."""
        wide, name, output = ir.Value(), value.name, value.is_graph_output()
        value.replace_all_uses_with(wide, replace_graph_outputs=True)
        if output:
            value.name, wide.name = f"{name}_float32", name
        cast = ir.node("Cast", [value], {"to": DOUBLE}, outputs=[wide])
        node.graph.insert_after(node, cast)
        self.types[value], self.types[wide] = FLOAT, DOUBLE
        self.written_types[wide] = FLOAT

    def like(self, node: ir.Node) -> list[ir.Node]:
        """The nodes whose float64 form is ``node``'s (same op, same input types)."""
        key = _signature(self, node)
        return [n for n in _nodes(self.model) if _signature(self, n) == key]

    def named(self, name: str) -> ir.Node | None:
        """The node of that name (in any graph), or None."""
        return next((n for n in _nodes(self.model) if n.name == name), None)

    def finish(self) -> None:
        """Drop the type and shape annotations of intermediate values (ONNX Runtime infers
        them again) and name what the forms and casts made."""
        for node in _nodes(self.model):
            for value in node.outputs:
                if not value.is_graph_output():
                    value.type, value.shape = None, None
        common_passes.NameFixPass()(self.model)
        _name_nodes(self.model)
        self.model.graph.sort()


def _quantizes(node: ir.Node) -> bool:
    """Whether ``node`` quantizes a value the graph computes (not a constant)."""
    x = node.inputs[0] if node.inputs else None
    return "Quantize" in node.op_type and x is not None and x.const_value is None


def _nodes(model: ir.Model) -> list[ir.Node]:
    return list(traversal.RecursiveGraphIterator(model.graph))


def _name_nodes(model: ir.Model) -> None:
    """Give every node a name no other node of the model has (subgraphs' too), keeping the
    names that already are."""
    nodes = _nodes(model)
    taken = collections.Counter(n.name for n in nodes if n.name)
    count = itertools.count()
    for node in nodes:
        if not node.name or taken[node.name] > 1:
            if node.name:
                taken[node.name] -= 1
            while (name := f"{node.op_type}_oracle_{next(count)}") in taken:
                pass
            node.name, taken[name] = name, 1


#: Integer attributes that name a data type (float32 ones become float64).
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "stash_type"})


def _widen_graphs(model: ir.Model, wide: Float64Graph) -> None:
    """Widen the initializers, node attributes and graph inputs and outputs of ``model`` (see
    :class:`Float64Graph`), and cast float-only inputs back."""
    narrow = []
    for graph in model.graphs():
        for value in graph.initializers.values():
            _widen_initializer(value)
        for value in (*graph.inputs, *graph.outputs):
            if value.dtype == FLOAT:
                value.dtype = DOUBLE
    for node in _nodes(model):
        narrow += [(node, i) for i in _float_only_inputs(node, model.opset_imports, wide)]
        written = _widen_node(node)
        if written:
            wide.written_attributes[node] = written
    for node, index in narrow:
        wide.cast_input(node, index, FLOAT)


def _widen_initializer(value: ir.Value) -> None:
    """Make a float32 initializer float64, lazily: the cast runs when the tensor is read (as
    the model is saved, one tensor at a time), so no float64 copy of the weights is ever
    held whole."""
    tensor = value.const_value
    if tensor is not None and tensor.dtype == FLOAT:
        value.const_value = ir.LazyTensor(
            lambda: ir.tensor(tensor.numpy().astype(np.float64)),
            DOUBLE,
            tensor.shape,
            name=value.name,
        )
        value.dtype = DOUBLE


def _widen_node(node: ir.Node) -> dict[str, ir.Attr | None]:
    """Widen ``node``'s float32 tensor and type attributes (a norm's stash type too, given or
    not); the attributes it changed, as written (None: not given)."""
    written: dict[str, ir.Attr | None] = {}
    if Op(node.op_type, node.domain) in STASH_NORM_OPS and "stash_type" not in node.attributes:
        node.attributes["stash_type"] = ir.AttrInt64("stash_type", DOUBLE)
        written["stash_type"] = None
    for name, attr in list(node.attributes.items()):
        if attr.type == ir.AttributeType.TENSOR and attr.value.dtype == FLOAT:
            wide = ir.tensor(attr.value.numpy().astype(np.float64))
            written[name], node.attributes[name] = attr, ir.AttrTensor(name, wide)
        elif name in _TYPE_ATTRIBUTES and attr.value == FLOAT:
            written.setdefault(name, attr)
            node.attributes[name] = ir.AttrInt64(name, DOUBLE)
    return written


def _float_only_inputs(node: ir.Node, opsets: Mapping[str, int], wide: Float64Graph) -> list[int]:
    """Indices of ``node``'s inputs that are widened and whose schema admits no float64 where
    it admits float32 (e.g. an int8 ``Resize``'s scales), where no output of ``node`` was
    float32 (else the node is probed, and made a form or an island, as a whole)."""
    if any(wide.written_types.get(v) == FLOAT for v in node.outputs):
        return []
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(node.domain, 1), node.domain)
    except onnx.defs.SchemaError:  # not an ONNX op: nothing known
        return []
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    found = []
    for index, value in enumerate(node.inputs):
        formal = schema.inputs[min(index, len(schema.inputs) - 1)]
        types = allowed.get(formal.type_str, {formal.type_str})
        widened = value is not None and wide.is_widened(value)
        if widened and "tensor(double)" not in types and "tensor(float)" in types:
            found.append(index)
    return found


def _types(model: ir.Model) -> dict[ir.Value, ir.DataType | None]:
    """Each value's element type (None where unknown): as annotated, else as ONNX shape
    inference finds, else as ONNX Runtime's own schema of the op says (its contrib ops)."""
    inference = common_passes.ShapeInferencePass(
        check_type=False, strict_mode=False, data_prop=False
    )
    inference(model)
    types: dict[ir.Value, ir.DataType | None] = {}
    for graph in model.graphs():
        for value in (*graph.inputs, *graph.initializers.values()):
            types[value] = value.dtype
    for node in _nodes(model):
        for index, value in enumerate(node.outputs):
            found = value.dtype or _schema_type(node, index, types, model.opset_imports)
            types[value] = found
    return types


@functools.cache
def _ort_schemas() -> dict[tuple[str, str], list]:
    """ONNX Runtime's op schemas (the ONNX ones and its contrib ops), by (domain, op), oldest
    first."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    found: dict[tuple[str, str], list] = {}
    for schema in ort_c.get_all_operator_schema():
        found.setdefault((schema.domain, schema.name), []).append(schema)
    return {k: sorted(v, key=lambda s: s.since_version) for k, v in found.items()}


def _schema_type(node: ir.Node, index: int, types: Mapping, opsets: Mapping[str, int]):
    """The type of ``node``'s output ``index`` by ONNX Runtime's schema of its op: a fixed
    type, or that of an input bound to the same type parameter (a ``Cast``'s: its ``to``);
    None where not known."""
    if node.op_type == "Cast" and "to" in node.attributes:
        return ir.DataType(node.attributes["to"].value)
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = opsets.get(node.domain, 1)
    schemas = [
        s for s in _ort_schemas().get((domain, node.op_type), []) if s.since_version <= version
    ]
    if not schemas or not schemas[-1].outputs:
        return None
    schema = schemas[-1]
    formal = schema.outputs[min(index, len(schema.outputs) - 1)].typeStr
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    for position, value in enumerate(node.inputs if schema.inputs else ()):
        bound = schema.inputs[min(position, len(schema.inputs) - 1)].typeStr == formal
        if bound and value is not None and types.get(value) is not None:
            return types[value]
    named = allowed.get(formal, [formal])
    return _type_named(named[0]) if len(named) == 1 else None


def _type_named(text: str) -> ir.DataType | None:
    """``tensor(float)`` -> FLOAT; None for what is not a tensor type."""
    found = re.fullmatch(r"tensor\((\w+)\)", text)
    try:
        return ir.DataType[found[1].upper()] if found else None
    except KeyError:
        return None


def _signature(wide: Float64Graph, node: ir.Node) -> tuple:
    """What picks ``node``'s kernel: its op and opset, its inputs' types now, its type
    attributes."""
    types = tuple(wide.types.get(v) if v is not None else None for v in node.inputs)
    named = tuple((k, a.value) for k, a in sorted(node.attributes.items()) if k in _TYPE_ATTRIBUTES)
    version = wide.model.opset_imports.get(node.domain, 1)
    return (node.domain, node.op_type, version, types, len(node.outputs), named)


def _grouped(wide: Float64Graph, nodes: Iterable[ir.Node]) -> list[list[ir.Node]]:
    """``nodes`` grouped by :func:`_signature`, in order of first appearance."""
    groups: dict[tuple, list[ir.Node]] = {}
    for node in nodes:
        groups.setdefault(_signature(wide, node), []).append(node)
    return list(groups.values())


#: Probe results: (signature, the model's opsets) -> whether ONNX Runtime's CPU provider runs
#: the node in float64 (or cannot tell).
_PROBED: dict[tuple, bool] = {}
#: Ops whose float64 kernel ONNX Runtime's CPU provider loads and then refuses to run ("LSTM
#: operator does not support double yet", 1.31): no float64 kernel, as a run would find.
REFUSED = frozenset({Op("LSTM", ""), Op("GRU", "")})


def _kernel(wide: Float64Graph, node: ir.Node) -> bool:
    """Whether ONNX Runtime's CPU provider has a kernel for ``node`` as widened, tried on a
    one-node model of it (cached by :func:`_signature`). False only where the float64 node
    fails to load and the node as written (float32) loads: a probe that fails both ways (an
    op whose session needs more than one node gives) says nothing, and True is answered (the
    whole graph's session names any node it cannot run). Control flow (graph attributes) and
    nodes of unknown input types are not probed; the ops of :data:`REFUSED` have none."""
    if Op(node.op_type, node.domain) in REFUSED:
        return False
    if any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for a in node.attributes.values()
    ):
        return True
    key = (_signature(wide, node), tuple(sorted(wide.model.opset_imports.items())))
    inputs = key[0][3]
    if any(t is None for t, v in zip(inputs, node.inputs, strict=True) if v is not None):
        return True
    if key not in _PROBED:
        written = {**node.attributes, **wide.written_attributes.get(node, {})}
        written = {k: a for k, a in written.items() if a is not None}
        narrow = [
            FLOAT if v is not None and wide.is_widened(v) else t
            for t, v in zip(inputs, node.inputs, strict=True)
        ]
        loads = functools.partial(
            _loads, node, opsets=wide.model.opset_imports, ir_version=wide.model.ir_version
        )
        _PROBED[key] = loads(inputs, node.attributes) or not loads(narrow, written)
    return _PROBED[key]


def _loads(node: ir.Node, types, attributes: Mapping, opsets: Mapping, ir_version: int) -> bool:
    """Whether ONNX Runtime's CPU provider opens a model of ``node`` alone, its inputs of
    ``types``."""
    inputs = [
        ir.Value(name=f"i{k}", type=ir.TensorType(t)) if t is not None else None
        for k, t in enumerate(types)
    ]
    outputs = [ir.Value(name=f"o{k}") for k in range(len(node.outputs))]
    copy = ir.Node(node.domain, node.op_type, inputs, list(attributes.values()), outputs=outputs)
    graph = ir.Graph(
        [v for v in inputs if v is not None], outputs, nodes=[copy], opset_imports=dict(opsets)
    )
    try:
        runtime.make_session(
            ir.to_proto(ir.Model(graph, ir_version=ir_version)).SerializeToString(),
            "cpu",
            optimization_level=runtime.AS_WRITTEN,
            quiet=True,
            threads=1,
            spinning=False,
        )
    except Exception:  # ORT's own error types: no kernel, or a type it refuses
        return False
    return True
