"""fusion.cleanup before the passes: what torch's exporter writes with ``optimize=False`` and its
own optimizer would have folded (a ``CastLike`` of a constant weight to a value that carries no
type, ``Constant`` nodes, ``x + 0``) is folded, and so is a pass's Concat of large constants,
the numbers unchanged, on ONNX Runtime."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
from onnx import TensorProto

import fusion
from fusion.cleanup import cleanup_with_types
from tests.support.graphs import make_model, ops, run

F = TensorProto.FLOAT


def _untyped(model: ir.Model) -> ir.Model:
    """``model`` with the type and shape taken off every node output but the graph's outputs:
    what the dynamo exporter leaves on the values inside torchlib's functions (GroupNorm's)."""
    for node in model.graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.type, value.shape = None, None
    return model


def _affine(rng: np.random.Generator) -> ir.Model:
    """torchlib's GroupNorm affine as the dynamo exporter writes it with ``optimize=False``:
    ``h * CastLike(w, h) + CastLike(b, h)`` of an untyped ``h``, then ``+ 0`` and ``- 0`` (a
    Python ``0.0 + skip``) with their zeros in ``Constant`` nodes."""
    zero = {"value": ir.serde.serialize_tensor(ir.tensor(np.array(0, np.float32)))}
    nodes = [
        ("Relu", ["x"], ["h"], {}),
        ("CastLike", ["w", "h"], ["wc"], {}),
        ("Mul", ["h", "wc"], ["m"], {}),
        ("CastLike", ["b", "m"], ["bc"], {}),
        ("Add", ["m", "bc"], ["a"], {}),
        ("Constant", [], ["zero"], zero),
        ("Add", ["zero", "a"], ["s"], {}),
        ("Constant", [], ["zero2"], zero),
        ("Sub", ["s", "zero2"], ["d"], {}),
        ("Tanh", ["d"], ["y"], {}),
    ]
    inits = {"w": rng.standard_normal((4, 1)).astype(np.float32)}
    inits["b"] = rng.standard_normal((4, 1)).astype(np.float32)
    return _untyped(make_model(nodes, {"x": (F, [1, 4, 6])}, {"y": (F, [1, 4, 6])}, inits))


def test_castlike_constants_and_identity_arithmetic_fold_before_the_passes(rng):
    """The CastLikes go (the folder reads the types FillShapes gave), the Constants become
    initializers, ``0 + a`` and ``s - 0`` read their other operand; the output is the same bit
    for bit (no ``-0`` reaches the Add: ``h * w + b`` of random ``w``, ``b``)."""
    model = _affine(rng)
    feeds = {"x": rng.standard_normal((1, 4, 6)).astype(np.float32)}
    want = run(_affine(np.random.default_rng(0)), feeds)
    fusion.optimize(model)
    assert ops(model) == ["Relu", "Mul", "Add", "Tanh"], ops(model)
    got = run(model, feeds)
    np.testing.assert_array_equal(got[0], want[0])


def test_adding_or_subtracting_zero_reads_the_other_operand_where_no_bit_changes(rng):
    """``x - 0`` and ``x + -0`` read ``x``, bit for bit; ``x + 0`` (``+0`` where ``x`` is ``-0``)
    only where ``x`` is never ``-0``: a Conv's output with a bias that has no ``-0``. ``x + 0``
    of the input, and ``0 - x``, stay. ``1 / y`` shows the sign of each zero."""
    nodes = [
        ("Sub", ["x", "zero"], ["a"], {}),
        ("Add", ["minus_zero", "x"], ["b"], {}),
        ("Add", ["x", "zero"], ["c"], {}),
        ("Sub", ["zero", "x"], ["d"], {}),
        ("Conv", ["x", "w", "bias"], ["conv"], {}),
        ("Add", ["zero", "conv"], ["e"], {}),
    ]
    nodes += [("Reciprocal", [t], [f"y{t}"], {}) for t in "abcde"]
    outputs = {f"y{t}": (F, [1, 2, 3]) for t in "abcd"} | {"ye": (F, [1, 2, 3])}
    consts = {"zero": np.array(0, np.float32), "minus_zero": np.array(-0.0, np.float32)}
    consts["w"] = rng.standard_normal((2, 2, 1)).astype(np.float32)
    consts["bias"] = np.array([0.0, rng.standard_normal()], np.float32)  # +0: never -0
    model = make_model(nodes, {"x": (F, [1, 2, 3])}, outputs, consts)
    x = np.array([[[np.nan, np.inf, -0.0], [0.0, -3.5, 1e-40]]], np.float32)
    want = run(model, {"x": x})
    fusion.cleanup(model)
    assert collections.Counter(ops(model))["Add"] == 1  # x + 0 of the input
    assert collections.Counter(ops(model))["Sub"] == 1  # 0 - x
    (conv,) = [n for n in model.graph if n.op_type == "Conv"]
    assert [u.node.op_type for u in conv.outputs[0].uses()] == ["Reciprocal"]
    got = run(model, {"x": x})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
        assert (np.signbit(g) == np.signbit(w)).all()


def test_a_concat_of_large_constants_only_it_reads_is_folded(rng):
    """A Concat of constants over the folder's size limit (8192 elements) that only it reads
    (FuseAttention's packed weights) is one initializer; one whose input another node reads
    too stays (folding it would store that input twice)."""
    nodes = [
        ("Concat", ["w0", "w1", "w2"], ["packed"], {"axis": 1}),
        ("MatMul", ["x", "packed"], ["y"], {}),
        ("Concat", ["v0", "v1"], ["shared"], {"axis": 1}),
        ("MatMul", ["x", "shared"], ["s"], {}),
        ("MatMul", ["x", "v1"], ["t"], {}),
    ]
    consts = {f"w{i}": rng.standard_normal((96, 96)).astype(np.float32) for i in range(3)}
    consts |= {f"v{i}": rng.standard_normal((96, 96)).astype(np.float32) for i in range(2)}
    outputs = {"y": (F, [2, 288]), "s": (F, [2, 192]), "t": (F, [2, 96])}
    model = make_model(nodes, {"x": (F, [2, 96])}, outputs, consts)
    feeds = {"x": rng.standard_normal((2, 96)).astype(np.float32)}
    want = run(model, feeds)
    fusion.cleanup(model)
    assert ops(model) == ["MatMul", "Concat", "MatMul", "MatMul"], ops(model)
    for got, w in zip(run(model, feeds), want, strict=True):
        np.testing.assert_array_equal(got, w)


def test_a_pad_of_zeros_is_folded_into_the_conv_that_reads_it(rng):
    """A constant-mode Pad of zeros on the spatial axes before a Conv (CREPE's ``F.pad``) is the
    Conv's ``pads`` (added to its own); a reflect Pad, a Pad of ones and a Pad of the channels
    stay. The same numbers on ONNX Runtime."""
    pads = np.array([0, 0, 1, 2, 0, 0, 3, 0], np.int64)
    nodes = [
        ("Pad", ["x", "pads"], ["zeros"], {}),
        ("Conv", ["zeros", "w", "b"], ["a"], {"pads": [1, 0, 1, 0]}),
        ("Pad", ["x", "pads"], ["reflected"], {"mode": "reflect"}),
        ("Conv", ["reflected", "w", "b"], ["c"], {}),
        ("Pad", ["x", "pads", "one"], ["ones"], {}),
        ("Conv", ["ones", "w", "b"], ["d"], {}),
        ("Pad", ["x", "channel_pads"], ["channels"], {}),
        ("Conv", ["channels", "w5"], ["e"], {}),
    ]
    consts = {"pads": pads, "one": np.array(1, np.float32)}
    consts["channel_pads"] = np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int64)
    consts["w"] = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    consts["w5"] = rng.standard_normal((3, 5, 3, 3)).astype(np.float32)
    consts["b"] = rng.standard_normal(3).astype(np.float32)
    outputs = {"a": (F, [1, 3, 8, 7]), "c": (F, [1, 3, 6, 7]), "d": (F, [1, 3, 6, 7])}
    outputs["e"] = (F, [1, 3, 3, 3])
    model = make_model(nodes, {"x": (F, [1, 4, 5, 5])}, outputs, consts)
    feeds = {"x": rng.standard_normal((1, 4, 5, 5)).astype(np.float32)}
    want = run(model, feeds)
    fusion.cleanup(model)
    assert collections.Counter(ops(model)) == {"Conv": 4, "Pad": 3}, ops(model)
    (conv,) = [n for n in model.graph if n.outputs[0].name == "a"]
    assert conv.inputs[0].name == "x" and tuple(conv.attributes.get_ints("pads")) == (2, 2, 4, 0)
    for got, w in zip(run(model, feeds), want, strict=True):
        np.testing.assert_array_equal(got, w)


def test_the_clean_up_of_an_export_is_the_one_before_the_passes(rng):
    """:func:`fusion.cleanup.cleanup_with_types` (a caller's export) folds what the passes'
    clean-up folds, so the passes leave a model they do not rewrite as it is; the types it
    inferred to do so are taken off again."""
    model = _affine(rng)
    cleanup_with_types(model)
    assert ops(model) == ["Relu", "Mul", "Add", "Tanh"], ops(model)
    assert [n.outputs[0].type for n in model.graph][:-1] == [None] * 3
    fusion.optimize(model)
    assert ops(model) == ["Relu", "Mul", "Add", "Tanh"], ops(model)
