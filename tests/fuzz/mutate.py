"""Structure-aware mutations of an ONNX file, each seeded: what a damaged, hand-edited or hostile
file can hold (dims, types, op types, attributes, opset imports, dangling and duplicate names,
cycles, external-data locations and fields), and raw byte flips, truncation and junk.

:func:`mutate` returns the bytes of the mutated file and the name of the mutation; the file may
be legal or not: the CLI must answer either way (docs/errors.md)."""

from __future__ import annotations

import random
from collections.abc import Callable

import onnx
from onnx import TensorProto

Mutation = Callable[[onnx.ModelProto, random.Random], None]


def _dims(model: onnx.ModelProto, rng: random.Random) -> None:
    """A graph input's or output's dim set to 0, -1, a name, or a huge size."""
    values = [*model.graph.input, *model.graph.output]
    dims = [d for v in values for d in v.type.tensor_type.shape.dim]
    if dims:
        dim = rng.choice(dims)
        choice = rng.choice([0, -1, 2**40, "sym"])
        dim.Clear()
        if isinstance(choice, str):
            dim.dim_param = choice
        else:
            dim.dim_value = choice


def _types(model: onnx.ModelProto, rng: random.Random) -> None:
    """A graph input's element type changed (to another, or to an undefined one)."""
    if model.graph.input:
        value = rng.choice(list(model.graph.input))
        value.type.tensor_type.elem_type = rng.choice(
            [TensorProto.DOUBLE, TensorProto.INT8, TensorProto.STRING, TensorProto.BOOL, 0, 99]
        )


def _op_types(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node's op type replaced (by a real op of another arity, or by no op at all)."""
    if model.graph.node:
        node = rng.choice(list(model.graph.node))
        node.op_type = rng.choice(["Relu", "Conv", "MatMul", "NoSuchOp", "", "LayerNormalization"])


def _attributes(model: onnx.ModelProto, rng: random.Random) -> None:
    """An attribute's value perturbed (an int negated or made huge, a float made NaN)."""
    attrs = [a for n in model.graph.node for a in n.attribute]
    if attrs:
        attr = rng.choice(attrs)
        if attr.ints:
            attr.ints[rng.randrange(len(attr.ints))] = rng.choice([-1, 0, 2**31])
        elif attr.type == onnx.AttributeProto.INT:
            attr.i = rng.choice([-7, 0, 2**40])
        elif attr.type == onnx.AttributeProto.FLOAT:
            attr.f = rng.choice([float("nan"), -1.0, 1e30])
        else:
            attr.name = "no_such_attribute"


def _opsets(model: onnx.ModelProto, rng: random.Random) -> None:
    """The default domain's opset changed (to an old, a future or no version), or dropped."""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = rng.choice([1, 6, 99, 0])
            return


def _dangling(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node input renamed to a value nothing makes."""
    nodes = [n for n in model.graph.node if n.input]
    if nodes:
        node = rng.choice(nodes)
        node.input[rng.randrange(len(node.input))] = "dangling_value"


def _duplicate(model: onnx.ModelProto, rng: random.Random) -> None:
    """Two nodes made to write one value."""
    if len(model.graph.node) >= 2:
        a, b = rng.sample(list(model.graph.node), 2)
        if a.output and b.output:
            b.output[0] = a.output[0]


def _cycle(model: onnx.ModelProto, rng: random.Random) -> None:
    """A node made to read the output of a node after it (a cycle where that one reads it)."""
    nodes = list(model.graph.node)
    if len(nodes) >= 2 and nodes[0].input and nodes[-1].output:
        nodes[0].input[0] = nodes[-1].output[0]


def _external(model: onnx.ModelProto, rng: random.Random) -> None:
    """An initializer moved to external data with a location out of the folder, an absolute
    one, a missing file, or offsets and lengths that do not fit."""
    tensors = [t for t in model.graph.initializer if t.raw_data or t.float_data]
    if not tensors:
        return
    tensor = rng.choice(tensors)
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    location = rng.choice(["../outside.bin", "/etc/passwd", "missing.bin", "model.onnx"])
    entries = {"location": location}
    entries |= rng.choice([{}, {"offset": "-5"}, {"length": "999999999"}, {"offset": "x"}])
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)


STRUCTURED: dict[str, Mutation] = {
    "dims": _dims,
    "types": _types,
    "op_types": _op_types,
    "attributes": _attributes,
    "opsets": _opsets,
    "dangling": _dangling,
    "duplicate": _duplicate,
    "cycle": _cycle,
    "external": _external,
}


def _raw(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Byte flips, truncation or junk appended."""
    kind = rng.choice(["flip", "truncate", "junk"])
    if kind == "flip" and data:
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out), "flip"
    if kind == "truncate":
        return data[: rng.randrange(max(len(data), 1))], "truncate"
    return data + rng.randbytes(rng.randint(1, 64)), "junk"


def mutate(data: bytes, seed: int) -> tuple[bytes, str]:
    """The ONNX file ``data`` mutated once, by the mutation ``seed`` picks: a structured one
    (:data:`STRUCTURED`) on the parsed model, or a raw one on its bytes; returns the new bytes
    and the mutation's name."""
    rng = random.Random(seed)
    names = [*STRUCTURED, "raw"]
    name = names[seed % len(names)]
    if name == "raw":
        return _raw(data, rng)
    model = onnx.load_from_string(data)
    STRUCTURED[name](model, rng)
    return model.SerializeToString(), name
