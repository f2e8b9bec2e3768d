"""Float64 forms of the ops ONNX Runtime's CPU provider has no float64 kernel for, built from
ops it has one for (:func:`apply`, on a :class:`normexport.verdict.float64.Float64Graph`): a
``Conv`` as strided slices of its padded input, one per kernel tap, each times that tap's
weights; the pools and ``InstanceNormalization`` likewise or as reductions; ``Erf`` (and GELU)
by its Taylor series about the nearest of 48 points; nearest ``Resize`` on the two float32
halves of its input.
Which ops, and how exact: docs/parity.md#the-oracles-float64-graph.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir import traversal

FLOAT, DOUBLE = ir.DataType.FLOAT, ir.DataType.DOUBLE
#: Slice's "to the end".
_END = np.iinfo(np.int64).max
#: The contraction width a Conv's taps are concatenated up to (one MatMul per group of taps,
#: e.g. all 7 taps of a 2-channel stem, where one per tap would multiply by 2-row matrices).
TAP_WIDTH = 256


def apply(wide) -> dict[str, int]:
    """Replace each node of ``wide``'s model that reads a widened value and has no float64
    kernel (``wide.lacks``) by its float64 form, where it has one that applies; returns how
    many of each op type were replaced."""
    made: Counter = Counter()
    for node in list(traversal.RecursiveGraphIterator(wide.model.graph)):
        form, opset = FORMS.get((node.domain or "", node.op_type), (None, 0))
        x = node.inputs[0] if node.inputs else None
        if form is None or wide.model.opset_imports.get("", 1) < opset:
            continue
        if x is None or not wide.is_widened(x) or not wide.lacks(node):
            continue
        build = Builder(wide, node)
        outputs = form(node, build)
        if outputs is not None:
            build.splice(outputs)
            made[node.op_type] += 1
    return dict(made)


class Builder:
    """The nodes and constants of one node's float64 form, spliced in its place."""

    def __init__(self, wide, node: ir.Node):
        self.wide, self.node, self.graph = wide, node, node.graph
        self.opset = wide.model.opset_imports.get("", 1)
        self.nodes: list[ir.Node] = []

    def op(self, op_type: str, *inputs: ir.Value | None, **attributes) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes)
        self.nodes.append(node)
        return node.outputs[0]

    def const(self, array) -> ir.Value:
        """A small constant (int64 for integers, float64 otherwise)."""
        array = np.asarray(array)
        array = array.astype(np.int64 if array.dtype.kind in "iu" else np.float64)
        return self._initializer(ir.tensor(array))

    def lazy(self, make: Callable[[], np.ndarray], shape: Sequence[int]) -> ir.Value:
        """A float64 constant computed as the model is saved (weights: none held whole)."""
        tensor = ir.LazyTensor(lambda: ir.tensor(make()), DOUBLE, ir.Shape(shape))
        return self._initializer(tensor)

    def _initializer(self, tensor) -> ir.Value:
        name = f"oracle64_{next(_counter)}"
        value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape)
        value.const_value = tensor
        self.graph.register_initializer(value)
        return value

    def pad(self, x: ir.Value, pads: Sequence[int]) -> ir.Value:
        """``x`` (``[N, C, *spatial]``) padded with zeros on its spatial axes by ``pads``
        (ONNX order: every begin, then every end)."""
        if not any(pads):
            return x
        half = len(pads) // 2
        full = [0, 0, *pads[:half], 0, 0, *pads[half:]]
        if self.opset < 11:  # Pad-2: the pads an attribute
            return self.op("Pad", x, pads=full, mode="constant", value=0.0)
        return self.op("Pad", x, self.const(full), self.const(np.array(0.0)))

    def slice(self, x: ir.Value, starts, ends, axes, steps=None) -> ir.Value:
        """``Slice`` in the form of the model's opset (before 10: attributes, and no steps:
        a caller with steps checks :meth:`strided` first)."""
        if self.opset < 10:
            return self.op("Slice", x, starts=list(starts), ends=list(ends), axes=list(axes))
        given = [starts, ends, axes] + ([steps] if steps is not None else [])
        return self.op("Slice", x, *(self.const(a) for a in given))

    def tap(self, x: ir.Value, tap: Sequence[int], window: dict) -> ir.Value:
        """The elements of the padded ``x`` that kernel position ``tap`` reads for every
        output position: a strided slice of its spatial axes, its end counted from the end of
        each axis (so that it holds for any input size; the dilation is only where it
        starts)."""
        kernel, dilations, strides = window["kernel"], window["dilations"], window["strides"]
        starts = [t * d for t, d in zip(tap, dilations, strict=True)]
        ends = [-(k - 1 - t) * d or _END for t, k, d in zip(tap, kernel, dilations, strict=True)]
        if not any(starts) and all(e == _END for e in ends) and all(s == 1 for s in strides):
            return x
        axes = list(range(2, len(kernel) + 2))
        if all(s == 1 for s in strides) or self.strided():
            steps = strides if any(s != 1 for s in strides) else None
            return self.slice(x, starts, ends, axes, steps)
        for axis, start, size, k, d, s in zip(
            axes, starts, window["sizes"], kernel, dilations, strides, strict=True
        ):
            count = (size - (k - 1) * d - 1) // s + 1
            x = self.op("Gather", x, self.const(start + s * np.arange(count)), axis=axis)
        return x

    def strided(self) -> bool:
        """Whether Slice takes steps at the model's opset (before 10, a strided tap gathers
        its positions, which needs the input's spatial size: ``window["sizes"]``)."""
        return self.opset >= 10

    def total(self, terms: Sequence[ir.Value]) -> ir.Value:
        """The sum of ``terms``, one Add at a time (one Sum would hold every term at once)."""
        found = terms[0]
        for term in terms[1:]:
            found = self.op("Add", found, term)
        return found

    def splice(self, outputs: Sequence[ir.Value]) -> None:
        """Put the built nodes in the node's place, its outputs now ``outputs``; the
        constants only it read go (its weights, now in the form's)."""
        node, graph = self.node, self.graph
        graph.insert_before(node, self.nodes)
        for old, new in zip(node.outputs, outputs, strict=True):
            self.wide.types[new] = DOUBLE
            self.wide.written_types[new] = self.wide.written_types.get(old)
            self.wide.shapes[new] = self.wide.shapes.get(old)
            output, name = old.is_graph_output(), old.name
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            if output:  # the graph output keeps its name
                old.name, new.name = None, name
        inputs = list(node.inputs)
        graph.remove(node, safe=True)
        for value in inputs:
            unused = value is not None and not value.uses() and not value.is_graph_input()
            if unused and graph.initializers.get(value.name) is value:
                graph.initializers.pop(value.name)


_counter = itertools.count()


def _ints(node: ir.Node, name: str, default: Sequence[int]) -> list[int]:
    attr = node.attributes.get(name)
    return list(attr.value) if attr is not None else list(default)


def _scalar(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return attr.value if attr is not None else default


def _constant(value: ir.Value | None):
    """The tensor behind a constant ``value`` (not read yet), or None."""
    if value is None or value.is_graph_input():
        return None
    return ir.convenience.get_const_tensor(value)


def _pads(node: ir.Node, window: dict, sizes: list[int] | None) -> list[int] | None:
    """The node's pads (every begin, then every end) for its ``auto_pad``; None where SAME
    padding needs an input size that is not known (``sizes``)."""
    kernel = window["kernel"]
    auto = _text(_scalar(node, "auto_pad", "NOTSET"))
    if auto in ("NOTSET", ""):
        return _ints(node, "pads", [0] * 2 * len(kernel))
    if auto == "VALID":
        return [0] * 2 * len(kernel)
    if sizes is None:
        return None
    begins, ends = [], []
    for size, k, d, s in zip(sizes, kernel, window["dilations"], window["strides"], strict=True):
        total = max(0, (math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size)
        small, large = total // 2, total - total // 2
        begins.append(large if auto == "SAME_LOWER" else small)
        ends.append(small if auto == "SAME_LOWER" else large)
    return begins + ends


def _window(node: ir.Node, kernel: Sequence[int], build: Builder) -> dict | None:
    """The node's kernel, strides, dilations, pads (every begin, then every end, for its
    ``auto_pad``) and the padded input's spatial sizes where known (None each); None where
    its taps cannot be taken: SAME padding, or strides before opset 10 (:meth:`Builder.tap`),
    of an input whose size is not known."""
    n, x = len(kernel), node.inputs[0]
    window = {
        "kernel": list(kernel),
        "strides": _ints(node, "strides", [1] * n),
        "dilations": _ints(node, "dilations", [1] * n),
    }
    shape = build.wide.shapes.get(x)
    sizes = list(shape)[2:] if shape is not None else []
    known = len(sizes) == n and all(isinstance(s, int) for s in sizes)
    window["pads"] = _pads(node, window, sizes if known else None)
    if window["pads"] is None:
        return None
    padded = zip(sizes, window["pads"][:n], window["pads"][n:], strict=True) if known else ()
    window["sizes"] = [size + b + e for size, b, e in padded] or None
    if any(s != 1 for s in window["strides"]) and not build.strided() and not known:
        return None
    return window


def _conv(node: ir.Node, build: Builder) -> list[ir.Value] | None:
    """``Conv`` in float64 (a 1-D one of many taps: :func:`_framed`): the input padded, one
    strided slice per kernel tap (:meth:`Builder.tap`), its spatial axes flattened, contracted
    with that tap's weights by MatMul (``[Cout, C]``, or per group ``[G, Cout / G, C / G]``;
    taps concatenated on the channel axis up to :data:`TAP_WIDTH` channels per MatMul) or,
    depthwise, multiplied by them, summed one Add at a time, the bias added, the spatial axes
    back. Every product and sum in float64: no kernel expanded by its dilation, no input copied
    per tap beyond its slice. None (no form) where the weights are not constant, or the taps
    cannot be taken (:func:`_window`)."""
    x, w = node.inputs[0], node.inputs[1]
    weight = _constant(w)
    if weight is None:
        return None
    cout, cg, *kernel = (int(d) for d in weight.shape)
    groups = _scalar(node, "group", 1)
    window = _window(node, kernel, build)
    if window is None:
        return None
    padded = build.pad(x, window["pads"])
    wide = lambda: np.asarray(weight.numpy(), np.float64)  # noqa: E731 (read as saved)
    framed = len(kernel) == 1 and groups == 1 and kernel[0] > TAP_WIDTH and build.opset >= 11
    if framed:
        y = _framed(build, padded, wide, window, (cout, cg))
    else:
        taps = list(itertools.product(*(range(k) for k in kernel)))
        sliced = [build.tap(padded, tap, window) for tap in taps]
        if groups > 1 and cg == 1:
            terms = _depthwise(build, sliced, taps, wide, cout, groups)
        else:
            terms = _contracted(build, sliced, taps, wide, (cout, cg, groups))
        y = build.op("Reshape", build.total(terms), build.const([0, cout, -1]))
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        y = build.op("Add", y, build.op("Reshape", node.inputs[2], build.const([-1, 1])))
    return [y if framed else _unflattened(build, y, sliced[0], cout)]


def _framed(build: Builder, padded: ir.Value, wide, window: dict, sizes) -> ir.Value:
    """A 1-D Conv of more taps than :data:`TAP_WIDTH` (an STFT window of 400 to 8,000
    samples) as one MatMul over its frames, ``[N, Cout, L_out]``: the padded input
    (``[N, C, L]``) gathered at each output position's taps, ``[N, C, L_out, K]`` (the
    positions ``Range(0, L - (K - 1) * d, s)``, computed from the input's length: any size),
    moved to ``[N, L_out, C * K]`` and contracted with the weights ``[C * K, Cout]``. The
    tap-by-tap form would be K slices: 8,000 nodes that ONNX Runtime took two minutes to load.
    Needs Range (opset 11)."""
    cout, channels = sizes
    (k,), (d,), (s,) = window["kernel"], window["dilations"], window["strides"]
    length = build.op("Gather", build.op("Shape", padded), build.const(np.array(2)), axis=0)
    limit = build.op("Sub", length, build.const(np.array((k - 1) * d)))
    positions = build.op("Range", build.const(np.array(0)), limit, build.const(np.array(s)))
    column = build.op("Reshape", positions, build.const([-1, 1]))
    taps = build.op("Add", column, build.const((d * np.arange(k)).reshape(1, k)))
    frames = build.op("Gather", padded, taps, axis=2)
    rows = build.op("Transpose", frames, perm=[0, 2, 1, 3])
    flat = build.op("Reshape", rows, build.const([0, 0, channels * k]))
    make = lambda: wide().reshape(cout, channels * k).T.copy()  # noqa: E731
    y = build.op("MatMul", flat, build.lazy(make, [channels * k, cout]))
    return build.op("Transpose", y, perm=[0, 2, 1])


def _unflattened(build: Builder, y: ir.Value, like: ir.Value, channels: int) -> ir.Value:
    """``y`` (``[N, channels, L]``) with the spatial axes of ``like`` (``[N, C, *spatial]``)."""
    spatial = build.slice(build.op("Shape", like), [2], [_END], [0])
    target = build.op("Concat", build.const([0, channels]), spatial, axis=0)
    return build.op("Reshape", y, target)


def _contracted(build: Builder, sliced, taps, wide, sizes) -> list[ir.Value]:
    """Each group of taps (up to :data:`TAP_WIDTH` input channels in all) concatenated on the
    channel axis, flattened, and contracted with those taps' weights stacked alike: MatMul
    with ``[Cout, taps * C]`` (one group), or ``[G, Cout / G, taps * C / G]`` on the taps
    split per group (``[N, G, taps * C / G, L]``)."""
    cout, cg, groups = sizes
    per = max(1, math.ceil(TAP_WIDTH / cg))
    split = [0, groups, cg, -1] if groups > 1 else [0, cg, -1]
    terms = []
    for start in range(0, len(taps), per):
        part = taps[start : start + per]
        values = [build.op("Reshape", v, build.const(split)) for v in sliced[start : start + per]]
        a = values[0] if len(values) == 1 else build.op("Concat", *values, axis=-2)

        def make(part=part):
            weights = wide()
            stacked = np.concatenate([weights[:, :, *t] for t in part], axis=1)
            return stacked.reshape(groups, cout // groups, -1) if groups > 1 else stacked

        shape = [cout, len(part) * cg] if groups == 1 else [groups, cout // groups, len(part) * cg]
        terms.append(build.op("MatMul", build.lazy(make, shape), a))
    return terms


def _depthwise(build: Builder, sliced, taps, wide, cout: int, groups: int) -> list[ir.Value]:
    """Each tap (flattened: ``[N, C, 1, L]``) times its per-channel weights
    (``[C, multiplier, 1]``)."""
    multiplier = cout // groups
    terms = []
    for tap, value in zip(taps, sliced, strict=True):
        flat = build.op("Reshape", value, build.const([0, groups, 1, -1]))
        make = lambda tap=tap: wide()[:, 0, *tap].reshape(groups, multiplier, 1)  # noqa: E731
        terms.append(build.op("Mul", flat, build.lazy(make, [groups, multiplier, 1])))
    return terms


def _average_pool(node: ir.Node, build: Builder) -> list[ir.Value] | None:
    """``AveragePool`` in float64: the sum of its taps (as :func:`_conv`'s) over the count of
    elements each window holds (the kernel's size, or with ``count_include_pad`` 0 the taps of
    a padded mask of ones). None with ``ceil_mode``, or where the taps cannot be taken
    (:func:`_window`)."""
    kernel = _ints(node, "kernel_shape", [])
    if _scalar(node, "ceil_mode", 0) or not kernel:
        return None
    x, window = node.inputs[0], _window(node, kernel, build)
    if window is None:
        return None
    pads = window["pads"]
    taps = list(itertools.product(*(range(k) for k in kernel)))
    padded = build.pad(x, pads)
    total = build.total([build.tap(padded, tap, window) for tap in taps])
    if _scalar(node, "count_include_pad", 0) or not any(pads):
        return [build.op("Div", total, build.const(float(len(taps))))]
    spatial = build.slice(build.op("Shape", x), [2], [_END], [0])
    ones_shape = build.op("Concat", build.const([1, 1]), spatial, axis=0)
    ones = build.op("ConstantOfShape", ones_shape, value=ir.tensor(np.ones(1, np.float64)))
    mask = build.pad(ones, pads)
    counts = build.total([build.tap(mask, tap, window) for tap in taps])
    return [build.op("Div", total, counts)]


def _reduce(op_type: str) -> Callable:
    """``GlobalAveragePool`` / ``GlobalMaxPool`` as ``op_type`` (ReduceMean / ReduceMax) over
    the spatial axes; None where the input's rank is not known."""

    def form(node: ir.Node, build: Builder) -> list[ir.Value] | None:
        shape = build.wide.shapes.get(node.inputs[0])
        if shape is None:
            return None
        axes = list(range(2, len(shape)))
        if build.opset >= 18:
            return [build.op(op_type, node.inputs[0], build.const(axes), keepdims=1)]
        return [build.op(op_type, node.inputs[0], axes=axes, keepdims=1)]

    return form


def _instance_norm(node: ir.Node, build: Builder) -> list[ir.Value] | None:
    """``InstanceNormalization`` as its definition: per sample and channel, the mean and the
    variance over the spatial axes (``ReduceMean``), ``(x - mean) / sqrt(var + epsilon) * scale
    + B``; None where the input's rank is not known."""
    x, scale, bias = node.inputs[:3]
    shape = build.wide.shapes.get(x)
    if shape is None:
        return None
    rank = len(shape)
    axes = list(range(2, rank))
    mean = _mean(build, x, axes)
    centred = build.op("Sub", x, mean)
    var = _mean(build, build.op("Mul", centred, centred), axes)
    epsilon = build.const(np.float64(np.float32(_scalar(node, "epsilon", 1e-5))))
    y = build.op("Div", centred, build.op("Sqrt", build.op("Add", var, epsilon)))
    per_channel = build.const([-1] + [1] * (rank - 2))
    y = build.op("Mul", y, build.op("Reshape", scale, per_channel))
    return [build.op("Add", y, build.op("Reshape", bias, per_channel))]


def _mean(build: Builder, x: ir.Value, axes: list[int]) -> ir.Value:
    if build.opset >= 18:
        return build.op("ReduceMean", x, build.const(axes), keepdims=1)
    return build.op("ReduceMean", x, axes=axes, keepdims=1)


def _attribute_float(node: ir.Node, name: str, default: float) -> float:
    """A float attribute as the model holds it (float32), in float64."""
    return float(np.float32(_scalar(node, name, default)))


def _leaky_relu(node: ir.Node, build: Builder) -> list[ir.Value]:
    x = node.inputs[0]
    alpha = build.const(_attribute_float(node, "alpha", 0.01))
    negative = build.op("Less", x, build.const(0.0))
    return [build.op("Where", negative, build.op("Mul", x, alpha), x)]


def _hard_sigmoid(build: Builder, x: ir.Value, alpha: float, beta: float) -> ir.Value:
    line = build.op("Add", build.op("Mul", x, build.const(alpha)), build.const(beta))
    return build.op("Max", build.op("Min", line, build.const(1.0)), build.const(0.0))


def _hard_sigmoid_form(node: ir.Node, build: Builder) -> list[ir.Value]:
    alpha, beta = _attribute_float(node, "alpha", 0.2), _attribute_float(node, "beta", 0.5)
    return [_hard_sigmoid(build, node.inputs[0], alpha, beta)]


def _hard_swish(node: ir.Node, build: Builder) -> list[ir.Value]:
    x = node.inputs[0]
    return [build.op("Mul", x, _hard_sigmoid(build, x, 1 / 6, 0.5))]


def _clip(node: ir.Node, build: Builder) -> list[ir.Value]:
    """``Clip`` before opset 12 (no float64 kernel): ``Min(Max(x, min), max)``."""
    y = node.inputs[0]
    bounds = list(node.inputs[1:3])
    for index, name in enumerate(("min", "max")):
        given = bounds[index] if index < len(bounds) else None
        if given is None and name in node.attributes:
            given = build.const(_attribute_float(node, name, 0.0))
        if given is not None:
            y = build.op("Max" if name == "min" else "Min", y, given)
    return [y]


def _nearest(node: ir.Node, build: Builder) -> list[ir.Value] | None:
    """Nearest ``Resize`` / ``Upsample`` (no float64 kernel) as written, in float32, on the
    two float32 halves of its input, ``hi = float32(x)`` and ``lo = float32(x - hi)``, summed in
    float64: the op only copies elements, so the sum is ``x``'s elements to 2**-48 relative.
    None for another mode, or where points outside the input take ``extrapolation_value``."""
    mode = _scalar(node, "mode", "nearest")
    transform = _scalar(node, "coordinate_transformation_mode", "half_pixel")
    if _text(mode) != "nearest" or _text(transform) == "tf_crop_and_resize":
        return None
    x, rest = node.inputs[0], list(node.inputs[1:])
    for index, value in enumerate(rest):
        if value is not None and build.wide.types.get(value) == DOUBLE:
            rest[index] = build.op("Cast", value, to=FLOAT)
    hi = build.op("Cast", x, to=FLOAT)
    lo = build.op("Cast", build.op("Sub", x, build.op("Cast", hi, to=DOUBLE)), to=FLOAT)
    halves = []
    for half in (hi, lo):
        copy = ir.Node(node.domain, node.op_type, [half, *rest], list(node.attributes.values()))
        build.nodes.append(copy)
        halves.append(build.op("Cast", copy.outputs[0], to=DOUBLE))
    return [build.op("Add", *halves)]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: Erf's Taylor series: about 0 on [0, 1/8) and about the centre of each other interval of
#: width 1/8 up to 6 (:data:`ERF_PIECES` in all; from 6 on erf is 1 to float64), to degree
#: :data:`ERF_DEGREE`: the next term is below 3e-16 (|x - centre| <= 1/8 about 0, where the
#: odd terms alone are left and the series is relative to erf itself; 1/16 elsewhere).
ERF_PIECES, ERF_DEGREE = 48, 12


def erf_centres() -> np.ndarray:
    return np.array([0.0] + [(k + 0.5) / 8 for k in range(1, ERF_PIECES)])


def erf_coefficients() -> np.ndarray:
    """``[ERF_DEGREE + 1, ERF_PIECES]``: row j, the j-th Taylor coefficient of erf about each
    centre c (:func:`erf_centres`): ``erf(c)`` (``math.erf``), then from erf' = 2/sqrt(pi) g,
    g = exp(-x**2), whose coefficients follow ``(j + 1) g[j+1] = -2 (c g[j] + g[j-1])``
    (from g' = -2 x g)."""
    rows = np.zeros((ERF_DEGREE + 1, ERF_PIECES))
    for k, c in enumerate(erf_centres()):
        g = [math.exp(-c * c), -2 * c * math.exp(-c * c)]
        while len(g) < ERF_DEGREE:
            j = len(g) - 1
            g.append(-2 * (c * g[j] + g[j - 1]) / (j + 1))
        rows[0, k] = math.erf(c)
        for j in range(1, ERF_DEGREE + 1):
            rows[j, k] = 2 / math.sqrt(math.pi) * g[j - 1] / j
    return rows


def _erf(node: ir.Node, build: Builder) -> list[ir.Value]:
    return [_erf_of(build, node.inputs[0])]


def _erf_of(build: Builder, x: ir.Value) -> ir.Value:
    """``Erf(x)`` in float64 (:func:`erf_coefficients`): each element's interval by
    ``Floor``, its centre and coefficients by ``Gather``, Horner's rule in ``|x| - centre``;
    the sign put back; 1 from 6 on; NaN kept."""
    size = build.op("Abs", x)
    inside = build.op("Less", size, build.const(6.0))
    a = build.op("Where", inside, size, build.const(0.0))  # NaN and |x| >= 6: a safe 0
    scaled = build.op("Floor", build.op("Mul", a, build.const(8.0)))
    piece = build.op("Cast", scaled, to=ir.DataType.INT64)
    h = build.op("Sub", a, build.op("Gather", build.const(erf_centres()), piece))
    rows = erf_coefficients()
    found = build.op("Gather", build.const(rows[-1]), piece)
    for row in rows[-2::-1]:
        term = build.op("Gather", build.const(row), piece)
        found = build.op("Add", build.op("Mul", found, h), term)
    found = build.op("Where", inside, found, build.const(1.0))
    negative = build.op("Less", x, build.const(0.0))
    found = build.op("Where", negative, build.op("Neg", found), found)
    return build.op("Where", build.op("Equal", x, x), found, x)


def _gelu(node: ir.Node, build: Builder) -> list[ir.Value] | None:
    """GELU (ONNX ``Gelu``, ONNX Runtime's ``Gelu`` and ``BiasGelu``, which adds its second
    input first) as its definition, ``x / 2 * (1 + erf(x / sqrt(2)))`` (:func:`_erf_of`).
    None for ``approximate="tanh"`` (ONNX Runtime runs that one's function body in float64)."""
    if _text(_scalar(node, "approximate", "none")) != "none":
        return None
    x = node.inputs[0]
    if node.op_type == "BiasGelu":
        x = build.op("Add", x, node.inputs[1])
    half = build.op("Mul", x, build.const(0.5))
    curve = _erf_of(build, build.op("Mul", x, build.const(math.sqrt(0.5))))
    return [build.op("Mul", half, build.op("Add", curve, build.const(1.0)))]


#: (domain, op) -> its float64 form, and the lowest ai.onnx opset at which every op the form
#: uses has a float64 kernel in ONNX Runtime's CPU provider and broadcasts as numpy does (7;
#: ConstantOfShape: 9; Equal on float64: 11; Where: 9; Min and Max: 8).
FORMS: dict[tuple[str, str], tuple[Callable, int]] = {
    ("", "Conv"): (_conv, 7),
    ("", "AveragePool"): (_average_pool, 9),
    ("", "GlobalAveragePool"): (_reduce("ReduceMean"), 1),
    ("", "GlobalMaxPool"): (_reduce("ReduceMax"), 1),
    ("", "InstanceNormalization"): (_instance_norm, 7),
    ("", "LeakyRelu"): (_leaky_relu, 9),
    ("", "HardSigmoid"): (_hard_sigmoid_form, 8),
    ("", "HardSwish"): (_hard_swish, 8),
    ("", "Clip"): (_clip, 8),
    ("", "Resize"): (_nearest, 10),
    ("", "Upsample"): (_nearest, 7),
    ("", "Erf"): (_erf, 11),
    ("", "Gelu"): (_gelu, 11),
    ("com.microsoft", "Gelu"): (_gelu, 11),
    ("com.microsoft", "BiasGelu"): (_gelu, 11),
}
