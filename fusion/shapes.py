"""The shapes the passes read: :class:`FillShapes` gives the values that carry none the ones
inference finds, :class:`DropShapes` takes them off again after the passes."""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import KnownShapes, fresh, fully_known


class FillShapes(ir.passes.InPlacePass):
    """Give each node output, in the main graph and its subgraphs, that carries no shape (or no
    element type) the one ONNX shape inference finds (:class:`fusion._ir.KnownShapes`: onnx_ir's
    ``ShapeInferencePass`` on a clone, initializers over 1 KB left out of the protobuf, so
    external data and the 2 GiB limit do not matter), or where that one leaves dimensions
    unknown, ONNX Runtime's symbolic shape inference (:mod:`fusion._symbolic`: the head count of
    ``view(B, S, -1, H)``). The matchers need ranks, head and channel counts; the TorchScript
    exporter writes none for intermediate values.

    A dimension or type the model already carries is never replaced (the dynamo exporter's
    symbolic dimensions say more than inference's); only its unknown dimensions are filled
    (:func:`_filled`), and on a value that is no graph output the dimensions named ``unk__N``
    (tf2onnx's name for a size TensorFlow's shape functions lost: it relates the dimension to
    none other) where inference proves them a number or a symbol of the graph's inputs (the
    query, key and value of an attention then share the input's batch:
    docs/fusions/cleanup.md). Where inference fails or finds nothing the value stays as
    it is: the passes then refuse what needs a shape, as before. The shapes are scaffolding for
    the passes: :class:`DropShapes` (run after them) takes them off again, except where a node
    a pass made reads or writes the value, so that the other values and the clean-up after the
    passes are as they would be without them.

    Attributes:
        filled: ``(value, its shape, its type)`` before, for each value given something.
        nodes: the nodes of the main graph and its subgraphs when it ran.
    """

    def __init__(self):
        super().__init__()
        self.filled: list[tuple[ir.Value, ir.Shape | None, ir.TypeProtocol | None]] = []
        self.nodes: set[ir.Node] = set()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        shapes = KnownShapes(model)
        nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
        self.nodes = set(nodes)
        self.filled = []
        symbols = {d.value for v in model.graph.inputs for d in v.shape or () if _named(d)}
        for value in (v for node in nodes for v in node.outputs):
            own = value.shape
            renamed = None if value.is_graph_output() else symbols
            ask = not fully_known(own) or (renamed is not None and any(fresh(d) for d in own))
            shape = _filled(own, shapes.inferred(value), renamed) if ask else None
            dtype = shapes.dtype(value) if value.dtype is None else None
            if shape is not None or dtype is not None:
                self.filled.append((value, value.shape, value.type))
            if shape is not None:
                value.shape = shape.copy()
            if dtype is not None:
                value.dtype = dtype
        return ir.passes.PassResult(model, modified=bool(self.filled))


def _filled(
    own: ir.Shape | None, inferred: ir.Shape | None, symbols: set[str] | None = None
) -> ir.Shape | None:
    """The shape :class:`FillShapes` gives a value that carries ``own``: ``inferred`` where it
    carries none, ``own`` with its unknown dimensions (no number, no name) taken from
    ``inferred`` where the ranks agree (the dynamo exporter writes a Reshape to a target computed
    at run time with no dimension known), and with ``symbols`` (the names the graph's inputs
    carry) its :func:`fusion._ir.fresh` ones where ``inferred`` has a number or one of
    ``symbols`` there; None where that adds nothing."""
    if own is None or inferred is None:
        return inferred
    if len(own) != len(inferred):
        return None
    dims = [_dim(o, i, symbols) for o, i in zip(own, inferred, strict=True)]
    return ir.Shape(dims) if dims != list(own) else None


def _dim(own, inferred, symbols: set[str] | None):
    """One dimension of :func:`_filled`: ``inferred`` in place of an unknown ``own``, and (with
    ``symbols``) of a fresh one where ``inferred`` is a number or one of ``symbols``; else
    ``own``."""
    if isinstance(own, int):
        return own
    if own.value is None:
        return inferred
    proven = isinstance(inferred, int) or inferred.value in (symbols or ())
    return inferred if symbols is not None and fresh(own) and proven else own


def _named(dim) -> bool:
    """Whether ``dim`` is a named symbol (not a number, not unnamed)."""
    return not isinstance(dim, int) and dim.value is not None


class DropShapes(ir.passes.InPlacePass):
    """Take the shapes and types that ``fill`` (a :class:`FillShapes` that has run) put on off
    the values that no node made since reads or writes and that are no graph output (a rewrite
    that made one an output, e.g. a Conv that absorbed the BatchNorm after it, keeps its type).

    Args:
        fill: the FillShapes pass run before the fusion passes.
    """

    def __init__(self, fill: FillShapes):
        super().__init__()
        self.fill = fill

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for value, shape, type_ in self.fill.filled:
            nodes = [value.producer(), *(use.node for use in value.uses())]
            if value.is_graph_output():  # made one by a rewrite: an output needs its type
                continue
            if all(node in self.fill.nodes for node in nodes if node is not None):
                value.shape, value.type = shape, type_
        return ir.passes.PassResult(model, modified=False)
