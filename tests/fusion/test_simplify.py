"""fusion.simplify: the exporters' index arithmetic written with fewer nodes, the same numbers:
composed Unsqueeze axes against numpy, and torch's advanced indexing by aranges exported by
``torch.onnx.export`` (dynamo) and run on ONNX Runtime before and after."""

import collections
import itertools

import numpy as np
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto

import fusion
from fusion.graph import KnownShapes, symbolic_shapes
from fusion.simplify import composed_axes
from tests.support.graphs import cpu_session
from tests.support.norm_graphs import Graph


def _unsqueezed(shape: tuple, axes: list[int]) -> tuple:
    return np.expand_dims(np.zeros(shape), tuple(axes)).shape


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_composed_axes_are_the_two_unsqueezes_numpy_does(rank):
    shape = (2, 3, 5)[:rank]
    checked = 0
    for n1, n2 in itertools.product((1, 2), (1, 2)):
        middle, last = rank + n1, rank + n1 + n2
        for first in itertools.permutations(range(-middle, middle), n1):
            for second in itertools.permutations(range(-last, last), n2):
                axes = composed_axes(rank, list(first), list(second))
                if len({a % middle for a in first}) < n1 or len({a % last for a in second}) < n2:
                    assert axes is None
                    continue
                expected = _unsqueezed(_unsqueezed(shape, list(first)), list(second))
                assert _unsqueezed(shape, axes) == expected, (first, second, axes)
                checked += 1
    assert checked > 100


class Index(torch.nn.Module):
    """``mask[rows, keys]`` as transformers' ``sdpa_mask`` reads the padding mask: rows and keys
    are aranges over the past's batch and length + 1, placed by ``form``."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.eval()

    def forward(self, mask, past):
        batch, keys = past.shape[0], past.shape[2] + 1
        rows, cols = torch.arange(batch), torch.arange(keys)
        if self.form == "view":
            rows, cols = rows.view(-1, 1, 1, 1), cols.view(1, 1, 1, -1)
        elif self.form == "from_one":  # not the block at 0: stays a GatherND
            rows, cols = rows[:, None, None, None], (cols + 1)[None, None, None, :]
        elif self.form == "swapped":  # keys on the first axis: a transposed block, stays
            rows, cols = rows[None, None, None, :], cols[:, None, None, None]
        else:
            rows, cols = rows[:, None, None, None], cols[None, None, None, :]
        return mask.bool()[rows, cols].float()


def _export(form: str, path) -> None:
    mask, past = torch.ones(2, 6, dtype=torch.int64), torch.zeros(2, 3, 5, 4)
    batch, length, total = (torch.export.Dim(n) for n in ("batch", "length", "total"))
    shapes = {"mask": {0: batch, 1: total}, "past": {0: batch, 2: length}}
    torch.onnx.export(Index(form), (mask, past), path, dynamo=True, dynamic_shapes=shapes)


def _unsqueeze_of_unsqueeze(node: ir.Node) -> bool:
    inner = node.inputs[0].producer() if node.op_type == "Unsqueeze" else None
    return inner is not None and inner.op_type == "Unsqueeze"


@pytest.mark.parametrize(
    "form, fused", [("unsqueeze", True), ("view", True), ("from_one", False), ("swapped", False)]
)
def test_indexing_by_aranges_is_a_slice_and_computes_the_gather(form, fused, tmp_path):
    path = tmp_path / "index.onnx"
    _export(form, path)
    model = ir.load(path)
    before = collections.Counter(n.op_type for n in model.graph)
    assert any(_unsqueeze_of_unsqueeze(n) for n in model.graph) == (form != "view")
    fusion.cleanup(model)
    after = collections.Counter(n.op_type for n in model.graph)
    assert before["GatherND"] == 1
    assert not any(_unsqueeze_of_unsqueeze(n) for n in model.graph)  # merged into one
    assert after["GatherND"] == (0 if fused else 1), after
    if fused:
        assert sum(after.values()) < sum(before.values()) - 3, (before, after)
    optimized, original = cpu_session(model), cpu_session(ir.load(path))
    rng = np.random.default_rng(0)
    # keys = length + 1: equal to the mask's width, then a block narrower than the mask
    for batch, length, total in ((2, 5, 6), (3, 1, 2), (1, 7, 9), (4, 0, 3)):
        feeds = {
            "mask": rng.integers(0, 2, (batch, total)),
            "past": rng.standard_normal((batch, 3, length, 4)).astype(np.float32),
        }
        if form == "from_one" and length + 1 >= total:
            continue  # arange(1, keys + 1) is out of the mask's bounds there
        expected, got = original.run(None, feeds)[0], optimized.run(None, feeds)[0]
        assert got.shape == expected.shape and np.array_equal(got, expected), (batch, length)


def _torchscript(module: torch.nn.Module, example: tuple, axes: dict, path) -> ir.Model:
    """``module`` exported by torch.onnx's TorchScript exporter (``dynamic_axes`` named
    ``axes``, as Optimum runs it) to ``path``, loaded."""
    torch.onnx.export(
        module.eval(), example, str(path), dynamo=False, input_names=list(axes),
        dynamic_axes=axes,
    )  # fmt: skip
    return ir.load(path)


def _assert_computes_the_file(model: ir.Model, path, inputs: list[dict]) -> None:
    """``model`` gives the outputs of the file at ``path`` on ONNX Runtime, element for element
    (the same dtype and shape), for each of ``inputs``."""
    optimized, original = cpu_session(model), cpu_session(ir.load(path))
    for feeds in inputs:
        for got, want in zip(optimized.run(None, feeds), original.run(None, feeds), strict=True):
            assert got.shape == want.shape, feeds
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("form, fused", [("unsqueeze", True), ("from_one", False)])
def test_torchscript_indexing_by_whole_aranges_is_the_tensor_unsqueezed(form, fused, tmp_path):
    """The TorchScript exporter writes ``mask[rows, keys]`` as a Gather from the flattened mask
    (Optimum's exports); with the keys as many as the mask's columns (the axis names say so, as
    Optimum's ``past_sequence_length + sequence_length``) it is the mask with unit axes."""
    path = tmp_path / "index.onnx"
    mask = torch.ones(2, 6 + (form == "from_one"), dtype=torch.int64)
    axes = {"mask": {0: "batch", 1: "length + 1"}, "past": {0: "batch", 2: "length"}}
    model = _torchscript(Index(form), (mask, torch.zeros(2, 3, 5, 4)), axes, path)
    before = collections.Counter(n.op_type for n in model.graph)
    fusion.optimize(model)
    after = collections.Counter(n.op_type for n in model.graph)
    assert before["Flatten"] == 1 and after["Flatten"] == (0 if fused else 1), after
    rng = np.random.default_rng(0)
    inputs = [
        {
            "mask": rng.integers(0, 2, (batch, length + 1 + (form == "from_one"))),
            "past": rng.standard_normal((batch, 3, length, 4)).astype(np.float32),
        }
        for batch, length in ((2, 5), (3, 1), (1, 7), (4, 0))
    ]
    _assert_computes_the_file(model, path, inputs)


class Parts(torch.nn.Module):
    """Phi-3's packed projection read back by Slices: ``tiled`` cover the last axis (the last
    to its end, as ``x[..., 6:]`` is exported), else with a gap or an overlap."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.eval()

    def forward(self, x):
        if self.form == "tiled":
            parts = x[..., :4], x[..., 4:6], x[..., 6:]
        elif self.form == "gap":
            parts = x[..., :4], x[..., 5:]
        else:
            parts = x[..., :4], x[..., 3:]
        return tuple(torch.tanh(p) for p in parts)


@pytest.mark.parametrize("form, split", [("tiled", True), ("gap", False), ("overlap", False)])
def test_slices_that_tile_an_axis_are_one_split_after_the_passes(form, split, tmp_path):
    path = tmp_path / "parts.onnx"
    batch = torch.export.Dim("batch")
    x = torch.zeros(2, 3, 10)
    torch.onnx.export(Parts(form), (x,), path, dynamo=True, dynamic_shapes=({0: batch},))
    model = ir.load(path)
    fusion.cleanup(model)  # before the passes: their matchers read the Slices
    assert any(n.op_type == "Slice" for n in model.graph)
    fusion.cleanup(model, final=True)
    ops = collections.Counter(n.op_type for n in model.graph)
    assert (ops["Split"], ops["Slice"]) == ((1, 0) if split else (0, 2))
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 3, 10)).astype(np.float32)}
    original = cpu_session(ir.load(path)).run(None, feeds)
    for got, expected in zip(cpu_session(model).run(None, feeds), original, strict=True):
        assert np.array_equal(got, expected)


def _model(nodes: list, x_type: int, outputs: list, consts: dict, value_info=()) -> ir.Model:
    """An opset-18 model of ``nodes`` with one input ``x`` of ``x_type`` and shape (2, 3), the
    initializers ``consts`` (name: array)."""
    from onnx import helper, numpy_helper

    graph = helper.make_graph(
        nodes,
        "neutral",
        [helper.make_tensor_value_info("x", x_type, [2, 3])],
        outputs,
        [numpy_helper.from_array(a, n) for n, a in consts.items()],
        value_info=list(value_info),
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return ir.from_proto(proto)


def _logic_model() -> ir.Model:
    """``x & True``, ``x | False`` (both read ``x``), ``x & True`` with a constant of a higher
    rank (it broadcasts ``x``: kept), ``x & False`` (kept); each cast to float."""
    from onnx import TensorProto, helper

    consts = {
        "true": np.array(True),
        "false11": np.zeros((1, 1), bool),
        "true211": np.ones((2, 1, 1), bool),
        "false": np.array(False),
    }
    ops = [("And", "true"), ("Or", "false11"), ("And", "true211"), ("And", "false")]
    nodes, outputs = [], []
    for i, (op, const) in enumerate(ops):
        nodes.append(helper.make_node(op, ["x", const] if i % 2 else [const, "x"], [f"b{i}"]))
        nodes.append(helper.make_node("Cast", [f"b{i}"], [f"y{i}"], to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    return _model(nodes, TensorProto.BOOL, outputs, consts)


def _arithmetic_model() -> ir.Model:
    """``x * 1``, ``1 * x``, ``x / 1`` (each reads ``x``), ``1 / x`` and ``x * ones(2, 1, 1)``
    (kept), and ``ConstantOfShape([], True) & (x > 0)`` (reads ``x > 0``); each negated."""
    from onnx import TensorProto, helper

    consts = {"one": np.array(1, np.float32), "ones211": np.ones((2, 1, 1), np.float32)}
    consts["zero"] = np.array(0, np.float32)
    ops = [("Mul", "x", "one"), ("Mul", "one", "x"), ("Div", "x", "one")]
    ops += [("Div", "one", "x"), ("Mul", "x", "ones211")]
    nodes = [helper.make_node(op, [a, b], [f"t{i}"]) for i, (op, a, b) in enumerate(ops)]
    nodes += [helper.make_node("Neg", [f"t{i}"], [f"y{i}"]) for i in range(len(ops))]
    nodes += [
        helper.make_node(
            "Constant", [], ["empty"], value=helper.make_tensor("e", TensorProto.INT64, [0], [])
        ),
        helper.make_node(
            "ConstantOfShape", ["empty"], ["true"],
            value=helper.make_tensor("v", TensorProto.BOOL, [1], [True]),
        ),
        helper.make_node("Greater", ["x", "zero"], ["positive"]),
        helper.make_node("And", ["true", "positive"], ["t5"]),
        helper.make_node("Not", ["t5"], ["y5"]),
    ]  # fmt: skip
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(5)]
    outputs.append(helper.make_tensor_value_info("y5", TensorProto.BOOL, None))
    positive = helper.make_tensor_value_info("positive", TensorProto.BOOL, [2, 3])
    return _model(nodes, TensorProto.FLOAT, outputs, consts, [positive])


@pytest.mark.parametrize(
    "build, x, kept",
    [
        (_logic_model, np.random.default_rng(0).random((2, 3)) > 0.5, {"And": 2, "Or": 0}),
        (
            _arithmetic_model,
            np.array([[np.nan, np.inf, -0.0], [0.0, -3.5, 1e-40]], np.float32),
            {"Mul": 1, "Div": 1, "And": 0},
        ),
    ],
    ids=["logic", "arithmetic"],
)
def test_neutral_elements_read_the_other_operand(build, x, kept):
    """``And(x, True)``, ``Or(x, False)``, ``Mul(x, 1)``, ``Div(x, 1)`` read ``x``, bit for bit
    (NaN, infinities and the sign of zero kept); a constant that broadcasts ``x`` stays."""
    model = build()
    fusion.cleanup(model)
    counts = collections.Counter(n.op_type for n in model.graph)
    assert {op: counts[op] for op in kept} == kept, counts
    expected = cpu_session(build()).run(None, {"x": x})
    for got, want in zip(cpu_session(model).run(None, {"x": x}), expected, strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert (np.signbit(got) == np.signbit(want)).all()


class Sizes(torch.nn.Module):
    """Shape arithmetic as the TorchScript exporter writes it: a split into heads of ``-1``
    count, ``x[..., : x.shape[-1] // 2]`` of a known size, a slice of a mask to a length it
    already has, and a reversal (a Slice of step -1 of the same shape, which must stay)."""

    def forward(self, x, mask):
        b, s, _ = x.shape
        heads = x.view(b, s, -1, 8).transpose(1, 2)
        half = heads[..., : heads.shape[-1] // 2]
        keys = mask[:, :, : heads.shape[2]]
        return half * 2, keys.flip(-1) * 3


def _export_sizes(path) -> ir.Model:
    axes = {"x": {0: "batch", 1: "sequence"}, "mask": {0: "batch", 2: "sequence"}}
    return _torchscript(Sizes(), (torch.randn(2, 3, 32), torch.randn(2, 1, 3)), axes, path)


def test_known_shapes_give_the_count_of_a_minus_one_split(tmp_path):
    """ONNX's inference leaves the ``-1`` of ``view(b, s, -1, 8)`` unknown; ONNX Runtime's
    symbolic inference (fusion.graph.symbolic_shapes) computes it from the target's sizes."""
    model = _export_sizes(tmp_path / "sizes.onnx")
    reshape = next(n for n in model.graph if n.op_type == "Reshape")
    assert reshape.outputs[0].shape is None
    shape = KnownShapes(model)(reshape.outputs[0])
    assert [d if isinstance(d, int) else d.value for d in shape] == ["batch", "sequence", 4, 8]


def test_symbolic_shapes_of_a_model_in_external_data(tmp_path, monkeypatch):
    """Every tensor in external data and the process in another folder: the symbolic
    inference gets the small tensors (a Reshape's target) in its protobuf, not as a file name
    it would read from its working directory."""
    g = Graph(opset=18)
    y = g.node("Reshape", ["x", g.const("target", np.array([0, -1], np.int64))], "y")
    model = g.model({"x": (TensorProto.FLOAT, ("batch", 3, 4))}, {y: (TensorProto.FLOAT, None)})
    ir.save(model, tmp_path / "ext.onnx", external_data="ext.onnx.data", size_threshold_bytes=0)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    shape = symbolic_shapes(ir.load(tmp_path / "ext.onnx"))["y"]
    assert [d if isinstance(d, int) else d.value for d in shape] == ["batch", 12]


def test_known_sizes_fold_and_whole_slices_go_with_the_inferred_shapes(tmp_path):
    path = tmp_path / "sizes.onnx"
    model = _export_sizes(path)
    before = collections.Counter(n.op_type for n in model.graph)
    fusion.optimize(model)
    after = collections.Counter(n.op_type for n in model.graph)
    # x.shape[-1] // 2 is a constant (no Div); the mask's slice is gone, the reversal stays
    assert (before["Div"], after["Div"]) == (1, 0)
    assert (before["Slice"], after["Slice"]) == (3, 2)
    steps = [n.inputs[4].const_value for n in model.graph if n.op_type == "Slice"]
    assert sorted(int(s.numpy().reshape(-1)[0]) for s in steps) == [-1, 1]
    rng = np.random.default_rng(0)
    inputs = [
        {
            "x": rng.standard_normal((batch, length, 32)).astype(np.float32),
            "mask": rng.standard_normal((batch, 1, length)).astype(np.float32),
        }
        for batch, length in ((1, 1), (2, 3), (3, 5))
    ]
    _assert_computes_the_file(model, path, inputs)


class Broadcasts(torch.nn.Module):
    """Expands as transformers writes them: the rotary frequencies ``inv_freq[None, :, None]
    .expand(B, -1, 1)`` before their MatMul with the positions (which broadcasts them alike),
    a mask expanded to the shape it has; and one that widens a mask (which must stay)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(8))

    def forward(self, positions, mask):
        batch = positions.shape[0]
        frequencies = self.inv_freq[None, :, None].expand(batch, -1, 1)
        angles = frequencies @ positions[:, None, :].float()
        return angles, mask.expand(batch, -1, -1) * 2, mask.expand(batch, 4, -1) * 3


def test_expands_that_change_nothing_go(tmp_path):
    path = tmp_path / "broadcasts.onnx"
    axes = {"positions": {0: "batch", 1: "sequence"}, "mask": {0: "batch", 2: "sequence"}}
    example = (torch.arange(6).reshape(2, 3), torch.randn(2, 1, 3))
    model = _torchscript(Broadcasts(), example, axes, path)
    before = collections.Counter(n.op_type for n in model.graph)
    fusion.optimize(model)
    after = collections.Counter(n.op_type for n in model.graph)
    assert (before["Expand"], after["Expand"]) == (3, 1)
    assert sum(after.values()) < sum(before.values()) - 20  # their shape arithmetic went too
    rng = np.random.default_rng(0)
    inputs = [
        {
            "positions": rng.integers(0, 64, (batch, length)),
            "mask": rng.standard_normal((batch, 1, length)).astype(np.float32),
        }
        for batch, length in ((1, 1), (2, 3), (3, 5))
    ]
    _assert_computes_the_file(model, path, inputs)
