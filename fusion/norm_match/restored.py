"""The Reshape / Expand nodes that put back the axes a ``keepdims=0`` statistic dropped, checked
to restore exactly its keepdims shape (:func:`check_restores`), with their targets read entry by
entry where they are computed at run time (:func:`shape_entries`). Why each accepted target is
the keepdims shape: docs/fusions/fuse_layernorm.md.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._ir import const_array
from fusion.base import CannotFuse, Code

#: One entry of a shape: a size, ``("x", i)`` (the size of axis ``i`` of the norm's input,
#: not known before run time), or None (not known at all).
Entry = int | tuple[str, int] | None

_INTEGERS = (ir.DataType.INT64, ir.DataType.INT32)


def _unknown(value: ir.Value) -> list[Entry] | None:
    """As many unknown entries as the 1-D ``value`` has, or None where its length is unknown."""
    shape = value.shape
    if shape is None or len(shape) != 1 or not isinstance(shape[0], int):
        return None
    return [None] * shape[0]


def _dims_of(source: ir.Value, x: ir.Value, start: int, end: int | None) -> list[Entry] | None:
    """The entries of ``Shape(source)[start:end]``: a static size, ``("x", i)`` where
    ``source`` is ``x``, else unknown; None where the rank of ``source`` is unknown."""
    if source.shape is None:
        return None
    dims = list(source.shape.dims)
    entries = [
        d if isinstance(d, int) else ("x", i) if source is x else None for i, d in enumerate(dims)
    ]
    return entries[start:end]


def _sliced(node: ir.Node, x: ir.Value) -> list[Entry] | None:
    """The entries of ``Slice(data, starts, ends[, axes, steps])`` of a 1-D ``data``, with
    constant ``starts`` and ``ends`` of one element, axis 0 and step 1; None otherwise."""
    inner = shape_entries(node.inputs[0], x)
    bounds = [const_array(v) if v is not None else v for v in node.inputs[1:]]
    bounds += [None] * (4 - len(bounds))  # starts, ends, axes, steps; the last two optional
    if inner is None or bounds[0] is None or bounds[1] is None:
        return None
    if any(b is not None and b.size != 1 for b in bounds):
        return None
    start, end, axis, step = (int(b.reshape(-1)[0]) if b is not None else None for b in bounds)
    if axis not in (None, 0, -1) or step not in (None, 1):
        return None
    return inner[start:end]


def shape_entries(value: ir.Value | None, x: ir.Value) -> list[Entry] | None:
    """The entries of the 1-D shape tensor ``value`` (a Reshape's or an Expand's target), read
    through constants, ``Shape``, ``Slice``, ``Gather``, ``Concat`` and integer ``Cast``
    nodes (:data:`Entry`); None where not even its length is known."""
    if value is None:
        return None
    array = const_array(value)
    if array is not None:
        return [int(v) for v in array.reshape(-1)] if array.dtype.kind in "iu" else None
    node = value.producer()
    found = None
    if node is None or node.domain != "":
        pass
    elif node.op_type == "Cast" and node.attributes.get_int("to") in _INTEGERS:
        found = shape_entries(node.inputs[0], x)
        narrow = node.attributes.get_int("to") == ir.DataType.INT32
        if found and narrow and any(isinstance(e, int) and abs(e) >= 2**31 for e in found):
            found = None  # a size that does not fit wraps around
    elif node.op_type == "Shape":
        start = node.attributes.get_int("start", 0)
        found = _dims_of(node.inputs[0], x, start, node.attributes.get_int("end", None))
    elif node.op_type == "Slice":
        found = _sliced(node, x)
    elif node.op_type == "Gather" and node.attributes.get_int("axis", 0) == 0:
        inner, index = shape_entries(node.inputs[0], x), const_array(node.inputs[1])
        indices = [int(i) for i in index.reshape(-1)] if index is not None else None
        if inner is not None and indices and all(-len(inner) <= i < len(inner) for i in indices):
            found = [inner[i] for i in indices]
    elif node.op_type == "Concat":
        parts = [shape_entries(v, x) for v in node.inputs]
        found = None if None in parts else [e for part in parts for e in part]
    return found if found is not None else _unknown(value)


def _known(entry: Entry) -> bool:
    """Whether ``entry`` is a size of at least 1 or an axis of the input."""
    return isinstance(entry, tuple) or (isinstance(entry, int) and entry >= 1)


def _reshaped(node: ir.Node, shape: tuple, target: list[Entry], keep: tuple, lead: int) -> tuple:
    """The shape ``Reshape(statistic of shape, target)`` has: ``keep`` where there is one
    leading axis and ``target`` is one entry, whatever it is, then ``k`` constant ones (the
    Reshape keeps the element count, the size of that axis, so it succeeds only with that
    entry the size: docs/fusions/fuse_layernorm.md); else ``target`` where every entry is known.

    Raises:
        CannotFuse: ``variance_reshaped``: the shape cannot be told.
    """
    k = len(keep) - lead
    rows = shape in (keep, keep[:lead])  # as many elements as the leading axis is long
    if lead == 1 and rows and len(target) == 1 + k and all(e == 1 for e in target[1:]):
        return keep
    if all(_known(e) for e in target):
        return tuple(target)
    raise CannotFuse(
        Code.VARIANCE_RESHAPED,
        f"the statistic goes through Reshape '{node.name}' to a target whose entries are not "
        "known: only one leading axis and the normalized axes' constant 1 prove its keepdims "
        "shape",
    )


def _expanded(node: ir.Node, shape: tuple, target: list[Entry]) -> tuple:
    """The shape ``Expand(statistic of shape, target)`` has (the broadcast of both).

    Raises:
        CannotFuse: ``variance_reshaped``: an entry broadcast against an axis is not known.
    """
    width = max(len(shape), len(target))
    left = (1,) * (width - len(shape)) + tuple(shape)
    right = (1,) * (width - len(target)) + tuple(target)
    out = []
    for a, b in zip(left, right, strict=True):
        if a == b or b == 1:
            out.append(a)
        elif a == 1 and _known(b):
            out.append(b)
        else:
            raise CannotFuse(
                Code.VARIANCE_RESHAPED,
                f"the statistic goes through Expand '{node.name}' to a target that may grow "
                "it: the broadcast of an axis against an entry that is not known",
            )
    return tuple(out)


def check_restores(restores: list[ir.Node], reduce: ir.Node, x: ir.Value, k: int) -> None:
    """The Reshape / Expand nodes ``restores`` after the reduction ``reduce`` (of ``x``'s last
    ``k`` axes) must leave its statistic in its keepdims shape: ``x``'s leading axes, then
    ``k`` ones. Each target is read by :func:`shape_entries`; a run-time target is accepted
    where its entries are ``x``'s own sizes, or by :func:`_reshaped`'s element count.

    Raises:
        CannotFuse: ``unknown_shape`` (the rank of ``x`` is not known) or ``variance_reshaped``
            (a target that cannot be read, or a result that is not, or cannot be told to be,
            the keepdims shape).
    """
    if not restores:
        return
    if x.shape is None:
        raise CannotFuse(
            Code.UNKNOWN_SHAPE,
            "the statistic is reshaped, and the input's rank is not known: cannot check that "
            "the reshape only restores the reduced axes",
        )
    lead = len(x.shape) - k
    rows = tuple(d if isinstance(d, int) else ("x", i) for i, d in enumerate(x.shape.dims))
    keep = rows[:lead] + (1,) * k
    shape = keep if reduce.attributes.get_int("keepdims", 1) else keep[:lead]
    for node in restores:
        target = shape_entries(node.inputs[1], x) if len(node.inputs) > 1 else None
        if target is None:
            raise CannotFuse(
                Code.VARIANCE_RESHAPED,
                f"the statistic goes through {node.op_type} '{node.name}' to a target of "
                "unknown length",
            )
        if node.op_type == "Reshape":
            shape = _reshaped(node, shape, target, keep, lead)
        else:
            shape = _expanded(node, shape, target)
    if shape != keep:
        show = [d if isinstance(d, int) else "?" for d in shape]
        want = [d if isinstance(d, int) else "?" for d in keep]
        raise CannotFuse(
            Code.VARIANCE_RESHAPED,
            f"the statistic is reshaped to {show}, not to its keepdims shape {want}",
        )
