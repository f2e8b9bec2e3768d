"""A norm whose weight is folded into the inverse standard deviation, and whose mean is subtracted
after it, as TensorFlow writes it and tf2onnx exports it (``x * g + (beta - m * g)``, ``g`` the
inverse root times the weight). The form and why it is the norm: docs/fusions/fuse_layernorm.md.
:func:`folded_division` finds ``x * g``, :func:`subtracted_mean` the shift.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from fusion._ir import as_division, const_array, other_input, producer, scalar_const, sole_consumer
from fusion.norm_match.core import MeanSquare, match_mean_square, match_radicand
from fusion.norm_match.fused import weight_first
from fusion.norm_match.moments import match_moments, moments_radicand


@dataclasses.dataclass
class Folded:
    """``Mul(numerator, g)`` with ``g`` an inverse root times an optional constant weight.

    Attributes:
        numerator: what is multiplied.
        root: the root's value (a ``Sqrt``'s output), or, where ``rsqrt``, the radicand of
            ``Pow(root, -0.5)``.
        rsqrt: whether the inverse root is ``Pow(., -0.5)`` (no Sqrt node).
        nodes: the nodes between the product and ``root``: the inverse, the weight's Mul.
        weighted: the weight as :func:`~fusion.norm_match.fused.weight_first` gives one
            (``(inverse, mul, weight, array)``: ``g = inverse * weight``), or None.
        scaled: ``g``, the inverse times the weight: what a subtracted mean is multiplied by.
    """

    numerator: ir.Value
    root: ir.Value
    rsqrt: bool
    nodes: list[ir.Node]
    weighted: tuple | None
    scaled: ir.Value


def _inverse_root(value: ir.Value) -> tuple[ir.Value, bool, ir.Node] | None:
    """``(root, rsqrt, node)`` when ``value`` is ``Reciprocal(root)``, ``Div(1, root)`` or
    ``Pow(root, -0.5)`` (``rsqrt``: ``root`` is the radicand)."""
    node = value.producer() if value is not None else None
    if node is None or node.domain != "":
        return None
    if node.op_type == "Reciprocal":
        return node.inputs[0], False, node
    if node.op_type == "Div" and scalar_const(node.inputs[0]) == 1.0:
        return node.inputs[1], False, node
    if node.op_type == "Pow" and scalar_const(node.inputs[1]) == -0.5:
        return node.inputs[0], True, node
    return None


def folded_division(node: ir.Node) -> Folded | None:
    """The product of a norm whose inverse root carries its weight or is an ``rsqrt``
    (docs/fusions/fuse_layernorm.md); None for anything else, including the plain
    ``Mul(n, Reciprocal(d))``, which :func:`fusion._ir.as_division` reads."""
    if node.op_type != "Mul" or node.domain != "" or len(node.inputs) != 2:
        return None
    for numerator, scaled in (node.inputs, node.inputs[::-1]):
        if numerator is None or scaled is None or const_array(numerator) is not None:
            continue
        weighted = weight_first(scaled)
        inverse = _inverse_root(weighted[0] if weighted is not None else scaled)
        if inverse is None or (weighted is None and not inverse[1]):
            continue
        root, rsqrt, inverse_node = inverse
        nodes = [inverse_node, *([weighted[1]] if weighted is not None else [])]
        return Folded(numerator, root, rsqrt, nodes, weighted, scaled)
    return None


def divided(node: ir.Node) -> Folded | None:
    """What ``node`` divides by a root, however written: :func:`fusion._ir.as_division`'s
    division (no weight; ``scaled`` the inverse where ``node`` is a product, else None), or
    :func:`folded_division`'s product."""
    division = as_division(node)
    if division is None:
        return folded_division(node)
    numerator, root, inverse = division
    scaled = other_input(node, numerator) if node.op_type == "Mul" else None
    return Folded(numerator, root, False, inverse, None, scaled)


def variance(root: ir.Value, rsqrt: bool, moments: bool = True) -> MeanSquare | None:
    """The mean square under ``root`` (a ``Sqrt``'s output, or where ``rsqrt`` the radicand
    itself): :func:`~fusion.norm_match.core.match_mean_square`, or where ``moments`` the
    variance from the moments (:mod:`fusion.norm_match.moments`: LayerNorm's only)."""
    if rsqrt:
        found = match_radicand(root)
        return found if found is not None or not moments else moments_radicand(root)
    found = match_mean_square(root)
    return found if found is not None or not moments else match_moments(root)


def _negated_product(value: ir.Value, mean: ir.Value, scaled: ir.Value) -> list[ir.Node] | None:
    """The nodes of ``value = -(mean * scaled)``: ``Mul(Neg(mean), scaled)`` or
    ``Neg(Mul(mean, scaled))`` (either Mul order); None otherwise."""
    mul = producer(value, "Mul")
    if mul is not None and scaled in mul.inputs:
        neg = producer(other_input(mul, scaled), "Neg")
        if neg is not None and neg.inputs[0] is mean:
            return [neg, mul]
    neg = producer(value, "Neg")
    mul = producer(neg.inputs[0], "Mul") if neg is not None else None
    if mul is not None and scaled in mul.inputs and other_input(mul, scaled) is mean:
        return [mul, neg]
    return None


def subtracted_mean(
    output: ir.Value, mean: ir.Value, scaled: ir.Value
) -> tuple[list[ir.Node], ir.Value | None, ir.Value] | None:
    """``(nodes, beta, out)`` when the only reader of ``output`` (``x * g``) adds ``beta - mean
    * g`` to it: ``Add(output, Add(-(mean * g), beta))``, ``Add(output, Sub(beta, mean * g))``
    or, without beta, ``Add(output, -(mean * g))`` (any operand order of each Add); ``beta``
    the constant (None without one), ``out`` the value the sum is. None otherwise."""
    add = sole_consumer(output)
    if add is None or add.op_type != "Add" or add.domain != "":
        return None
    shift = other_input(add, output)
    negated = _negated_product(shift, mean, scaled)
    if negated is not None:
        return [*negated, add], None, add.outputs[0]
    inner = shift.producer() if shift is not None else None
    if inner is None or inner.domain != "" or len(inner.inputs) != 2:
        return None
    if inner.op_type == "Add":
        for product, beta in (inner.inputs, inner.inputs[::-1]):
            negated = _negated_product(product, mean, scaled)
            if negated is not None and const_array(beta) is not None:
                return [*negated, inner, add], beta, add.outputs[0]
    if inner.op_type == "Sub" and const_array(inner.inputs[0]) is not None:
        mul = producer(inner.inputs[1], "Mul")
        if mul is not None and scaled in mul.inputs and other_input(mul, scaled) is mean:
            return [mul, inner, add], inner.inputs[0], add.outputs[0]
    return None
