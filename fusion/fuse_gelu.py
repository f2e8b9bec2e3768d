"""Fuse a GELU, however an exporter wrote it, into one op: com.microsoft ``Gelu`` /
``FastGelu`` / ``BiasGelu`` for ``target="ort"``, ONNX's ``Gelu`` for ``target="onnx"``
(:class:`FuseGelu`).

The formulas, the spellings matched, the refusals and the measurements behind the choice of op:
see docs/fusions/fuse_gelu.md.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import numpy as np
import onnx_ir as ir

from fusion._ir import (
    const_array,
    escaping_value,
    label,
    other_input,
    producer,
    remove_nodes,
    replace_output,
)
from fusion.base import MS_DOMAIN, CannotFuse, Code, Kind, NodeFusionPass, Op


class GeluCode(enum.StrEnum):
    """Why FuseGelu left a candidate alone, besides the codes every pass shares
    (:class:`fusion.base.Code`)."""

    #: A constant of a GELU-shaped subgraph is not the formula's (``x / 2`` inside the erf,
    #: ``0.0447`` for the cubic coefficient): a different function.
    GELU_CONSTANT = "gelu_constant"


#: The GELU ops of one input a bias before them joins (``target="ort"``).
_ONE_INPUT = (Op("Gelu"), Op("Gelu", MS_DOMAIN), Op("FastGelu", MS_DOMAIN))

#: The formula's constants (Hendrycks & Gimpel 2016, section 2).
SQRT_2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


@dataclasses.dataclass
class GeluMatch:
    """A matched GELU: ``x``, whether it is the tanh form, its nodes, the value it computes,
    and, for ``target="ort"``, the 1-D ``bias`` added to ``x`` just before (``x = v + bias``:
    the fused op then takes ``v`` and ``bias``; None where there is none)."""

    x: ir.Value
    tanh: bool
    nodes: list[ir.Node]
    output: ir.Value
    bias: ir.Value | None = None


def _biased(x: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, ir.Value, ir.Node] | None:
    """``(v, bias, add)`` where ``x = Add(v, bias)`` (either order) with ``bias`` of rank 1
    (docs/fusions/fuse_gelu.md), read by ``nodes`` only; None otherwise."""
    add = producer(x, "Add")
    if add is None or x.is_graph_output() or any(u.node not in nodes for u in x.uses()):
        return None
    for v, bias in (add.inputs, add.inputs[::-1]):
        rank = len(v.shape) if v is not None and v.shape is not None else 0
        if bias is not None and bias.shape is not None and len(bias.shape) == 1 and rank >= 1:
            return v, bias, add
    return None


def _scalar(value: ir.Value | None) -> float | None:
    """The number of a one-element float constant, or None."""
    array = const_array(value)
    if array is None or array.size != 1 or array.dtype.kind != "f":
        return None
    return float(array.reshape(-1)[0])


def _is(value: ir.Value | None, expected: float) -> bool | None:
    """Whether the constant ``value`` is ``expected`` within two roundings of its own type;
    None where it is no one-element float constant."""
    found = _scalar(value)
    if found is None:
        return None
    eps = float(np.finfo(const_array(value).dtype).eps)
    return abs(found - expected) <= 2 * eps * abs(expected)


def _split(node: ir.Node | None, op_type: str) -> tuple[ir.Value, ir.Value] | None:
    """``(operand, constant)`` of a standard ``op_type`` node with one constant input (for a
    Div only the divisor counts)."""
    if node is None or node.op_type != op_type or node.domain != "" or len(node.inputs) != 2:
        return None
    pairs = [node.inputs] if op_type in ("Div", "Sub", "Pow") else [node.inputs, node.inputs[::-1]]
    for operand, constant in pairs:
        if _scalar(constant) is not None and const_array(operand) is None:
            return operand, constant
    return None


#: A constant of the subgraph and what the formula says it is: ``(value, expected, what)``,
#: checked once the whole subgraph has matched.
Check = tuple[ir.Value, float, str]


def _check(checks: list[Check]) -> None:
    """Raise ``gelu_constant`` unless each constant is what the formula says."""
    for value, expected, what in checks:
        if not _is(value, expected):
            raise CannotFuse(
                GeluCode.GELU_CONSTANT,
                f"{what} is {_scalar(value):.8g}, not {expected:.8g}: a different function "
                "from GELU",
            )


def _check_ranks(checks: list[Check], x: ir.Value) -> None:
    """Raise unless every constant broadcasts within ``x``'s shape: one of more axes than ``x``
    (tf2onnx writes the 1 as ``[1, 1, 1]``) gives the subgraph's output more axes than the fused
    op's, which has ``x``'s shape.

    Raises:
        CannotFuse: ``gelu_constant`` (a constant of more axes than ``x``), ``unknown_shape``
            (a constant of one axis or more, and the rank of ``x`` not known).
    """
    rank = len(x.shape) if x.shape is not None else None
    for value, _, what in checks:
        ndim = const_array(value).ndim
        if rank is None and ndim > 0:
            raise CannotFuse(
                Code.UNKNOWN_SHAPE,
                f"{what} has {ndim} axes and the rank of x is not known: cannot tell that the "
                "output keeps x's shape",
            )
        if rank is not None and ndim > rank:
            raise CannotFuse(
                GeluCode.GELU_CONSTANT,
                f"{what} has {ndim} axes, x {rank}: the subgraph's output has more axes than x, "
                "the fused op's does not",
            )


def _reader(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one standard ``op_type`` node that reads ``value`` (other readers may exist: the
    match then stops at :func:`fusion._ir.escaping_value`), or None."""
    found = [u.node for u in value.uses() if u.node.op_type == op_type and u.node.domain == ""]
    return found[0] if len(set(found)) == 1 else None


def _erf_argument(value: ir.Value, checks: list[Check]) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(x, nodes)`` for ``x / sqrt(2)`` written as a Div or a Mul."""
    node = value.producer()
    for op_type, expected in (("Div", SQRT_2), ("Mul", 1 / SQRT_2)):
        found = _split(node, op_type)
        if found is not None:
            checks.append((found[1], expected, f"the {op_type}'s constant before Erf"))
            return found[0], [node]
    return None


def _power_of(value: ir.Value, x: ir.Value) -> int | None:
    """``n`` where ``value`` is ``Pow(x, n)`` with ``n`` 2 or 3, else None."""
    found = _split(value.producer(), "Pow")
    n = _scalar(found[1]) if found is not None and found[0] is x else None
    return int(n) if n in (2.0, 3.0) else None


def _cubic_term(term: ir.Value, x: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(c, nodes)`` where ``term`` is the product of three ``x`` and one one-element constant
    ``c``, in any association and operand order: ``Mul(c, Pow(x, 3))``, ``Mul(c, Mul(Mul(x,
    x), x))`` (PyTorch), ``Mul(x, Mul(x, Mul(c, x)))`` (jax2tf), the square as ``Pow(x, 2)``
    too; ``nodes`` the Muls and Pows. None where a factor is anything else, or the count of
    ``x`` is not three (docs/fusions/fuse_gelu.md)."""
    constants: list[ir.Value] = []
    nodes: list[ir.Node] = []
    count, pending = 0, [term]
    while pending and len(nodes) <= 3:
        value = pending.pop()
        if value is x:
            count += 1
        elif (n := _power_of(value, x)) is not None:
            count += n
            nodes.append(value.producer())
        elif _scalar(value) is not None:
            constants.append(value)
        elif (mul := producer(value, "Mul")) is not None and len(mul.inputs) == 2:
            pending.extend(mul.inputs)
            nodes.append(mul)
        else:
            return None
    if pending or count != 3 or len(constants) != 1:
        return None
    return constants[0], nodes[::-1]


def _tanh_argument(value: ir.Value, checks: list[Check]) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(x, nodes)`` for ``sqrt(2/pi) * (x + 0.044715 * x^3)``, the cubic term as
    :func:`_cubic_term` reads it."""
    outer = _split(value.producer(), "Mul")
    add = producer(outer[0], "Add") if outer is not None else None
    if add is None:
        return None
    for x, term in (add.inputs, add.inputs[::-1]):
        cubic = _cubic_term(term, x) if x is not None and term is not None else None
        if cubic is not None:
            checks.append((outer[1], SQRT_2_OVER_PI, "the factor of the tanh's argument"))
            checks.append((cubic[0], CUBIC, "the cubic term's coefficient"))
            return x, [*cubic[1], add, value.producer()]
    return None


def _halved_product(
    t: ir.Value, x: ir.Value, checks: list[Check]
) -> tuple[list[ir.Node], ir.Value] | None:
    """``(nodes, output)`` for ``t``'s product with ``x`` and one half, in any association."""
    first = _reader(t, "Mul")
    if first is None:
        return None
    other = other_input(first, t)
    if (half := _split(first, "Mul")) is not None and half[0] is t:  # x * (0.5 * t)
        last = _reader(first.outputs[0], "Mul")
        if last is not None and other_input(last, first.outputs[0]) is x:
            checks.append((half[1], 0.5, "the GELU's one half"))
            return [first, last], last.outputs[0]
        return None
    if other is x:  # (x * t) * 0.5, or (x * t) / 2
        for op_type, expected in (("Mul", 0.5), ("Div", 2.0)):
            last = _reader(first.outputs[0], op_type)
            found = _split(last, op_type)
            if found is not None and found[0] is first.outputs[0]:
                checks.append((found[1], expected, "the GELU's one half"))
                return [first, last], last.outputs[0]
        return None
    for op_type, expected in (("Mul", 0.5), ("Div", 2.0)):  # (0.5 * x) * t
        found = _split(other.producer() if other is not None else None, op_type)
        if found is not None and found[0] is x:
            checks.append((found[1], expected, "the GELU's one half"))
            return [other.producer(), first], first.outputs[0]
    return None


class FuseGelu(NodeFusionPass):
    """Replace each GELU subgraph in the main graph by one op (see docs/fusions/fuse_gelu.md):
    ``"gelu_fused"`` in the report; a look-alike with another constant is refused
    (``gelu_constant``)."""

    kinds = (
        Kind(
            "gelu_fused",
            "gelu",
            (
                Op("Gelu", MS_DOMAIN),
                Op("FastGelu", MS_DOMAIN),
                Op("BiasGelu", MS_DOMAIN),
                Op("Gelu"),
            ),
            norm=False,
            meaning=(
                "GELU made com.microsoft `Gelu` / `FastGelu` / `BiasGelu` (`--target ort`) or "
                "ONNX's `Gelu` (`--target onnx`, opset 20)"
            ),
        ),
    )
    summary = "GELU however written into one Gelu / FastGelu / BiasGelu op"
    codes = GeluCode
    needs_opset = {"onnx": 20}

    def match(self, model: ir.Model, node: ir.Node) -> GeluMatch | None:
        """The GELU whose Erf or Tanh is ``node``, with the bias added before it for
        ``target="ort"``; or, for ``target="ort"``, a GELU op (ONNX's, or a contrib op without
        its bias) whose input adds a 1-D bias: None where there is neither.

        Raises:
            CannotFuse: ``gelu_constant``, ``shared_output``, ``unknown_shape``.
        """
        if self.target == "ort" and Op(node.op_type, node.domain) in _ONE_INPUT:
            return self._biased_op(node)
        if node.domain != "" or node.op_type not in ("Erf", "Tanh") or not node.inputs:
            return None
        tanh, checks = node.op_type == "Tanh", []
        found = (_tanh_argument if tanh else _erf_argument)(node.inputs[0], checks)
        t = _reader(node.outputs[0], "Add")
        one = _split(t, "Add")
        if found is None or one is None or one[0] is not node.outputs[0]:
            return None
        x, before = found
        tail = _halved_product(t.outputs[0], x, checks)
        if tail is None:
            return None
        checks.append((one[1], 1.0, f"the constant added to the {node.op_type}"))
        _check(checks)
        _check_ranks(checks, x)
        nodes = [*before, node, t, *tail[0]]
        leak = escaping_value(nodes, tail[1])
        if leak is not None:
            raise CannotFuse(
                Code.SHARED_OUTPUT, f"{leak.name} is also read outside the GELU subgraph"
            )
        match = GeluMatch(x, tanh, nodes, tail[1])
        if self.target == "ort" and (found := _biased(x, nodes)) is not None:
            match.x, match.bias = found[0], found[1]
            match.nodes.insert(0, found[2])
        return match

    def _biased_op(self, node: ir.Node) -> GeluMatch | None:
        """A GELU op whose input is ``v + bias``, ``bias`` 1-D: as a match of op and Add."""
        tanh = node.op_type == "FastGelu" or node.attributes.get_string("approximate") == "tanh"
        found = _biased(node.inputs[0], [node]) if len(node.inputs) == 1 else None
        if found is None:
            return None
        v, bias, add = found
        return GeluMatch(v, tanh, [add, node], node.outputs[0], bias)

    def rewrite(self, model: ir.Model, match: GeluMatch) -> str:
        """Insert the fused op, move the readers over, drop the old nodes; return its op."""
        hint = label(match.nodes[-1])
        if self.target == "ort":
            op_type = "FastGelu" if match.tanh else "BiasGelu" if match.bias else "Gelu"
            inputs = [match.x, *([match.bias] if match.bias is not None else [])]
            fused = ir.node(op_type, inputs, domain=MS_DOMAIN, name=f"{hint}_{op_type}")
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            became = f"com.microsoft.{op_type}"
        else:
            approximate = "tanh" if match.tanh else "none"
            fused = ir.node("Gelu", [match.x], {"approximate": approximate}, name=f"{hint}_Gelu")
            became = f"Gelu (approximate={approximate})"
        fused.outputs[0].type = match.x.type
        fused.outputs[0].shape = match.x.shape.copy() if match.x.shape is not None else None
        model.graph.insert_before(match.nodes[-1], fused)
        replace_output(model.graph, match.output, fused.outputs[0])
        remove_nodes(model.graph, match.nodes)
        return became
