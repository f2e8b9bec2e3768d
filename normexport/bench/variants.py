"""The models that a latency comparison puts side by side.

Two things live here, both graph building (sessions are made by :mod:`normexport.runtime`):

1. :func:`build_variants`: one exported model as each optimizer leaves it (:data:`VARIANTS`,
   and on request :data:`OPTIONAL_VARIANTS`: onnxslim, onnxsim); a variant that fails to build
   (or whose optional package is missing) is kept with its error, so one broken optimizer never
   stops the comparison. normexport's own variant fuses under the fusion policy it is given.
2. :func:`op_model` and :func:`isolate_node`: one-op models for the forms microbenchmark and for
   the elementwise floor (one read, one write of the tensor: the memory-bound limit); the ops
   are defined where :mod:`normexport.tuning.forms` says.

The exact forms of a fused norm, which the autotuner times, are in :mod:`normexport.tuning.forms`.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

import fusion
from fusion.base import MS_DOMAIN
from fusion.graph import opset_version
from fusion.registry import FUSION_KINDS
from normexport import runtime
from normexport.io.files import save_model
from normexport.io.quiet import quiet, swallow_prints
from normexport.latency.measure import latency_threads
from normexport.runtime.fusion_policy import fusion_policy

#: Variant name -> what it is. Every variant but ``ort_offline`` runs in an ORT_ENABLE_ALL
#: session, what a user deploying that file gets.
VARIANTS = {
    "ort_raw": "the raw export as is; ORT applies its session optimizations (ORT_ENABLE_ALL)",
    "ort_offline": "the raw export after ORT_ENABLE_ALL, written out with "
    "optimized_model_filepath and loaded with optimizations off (ORT's offline mode)",
    "onnxscript_ort": "onnxscript.rewriter.ort_fusions.optimize_for_ort, then ORT_ENABLE_ALL",
    "ort_transformers": "onnxruntime.transformers.optimizer.optimize_model (model_type bert, "
    "Python fusions only, opt_level 0), then ORT_ENABLE_ALL",
    "normexport": "normexport's fusion.optimize (Skip ops as the CLI: CUDA, KV cache on CPU), then "
    "ORT_ENABLE_ALL",
}

#: Other optimizers' variants, from the optional ``bench`` extra (``pip install -e '.[bench]'``):
#: built only when named in ``only`` (as ``benchmarks/compare_fusers.py`` does), so that a
#: default comparison needs none of them. Both fold BatchNorm and fuse some norms.
OPTIONAL_VARIANTS = {
    "onnxslim": "onnxslim.slim(model) with its defaults, then ORT_ENABLE_ALL",
    "onnxsim": "onnxsim.simplify(model) with its defaults (its own check off: check_n=0), "
    "then ORT_ENABLE_ALL",
}

#: The variant the others are compared with.
REFERENCE_VARIANT = "normexport"


@dataclasses.dataclass
class Variant:
    """One variant of a model.

    Attributes:
        name: a key of :data:`VARIANTS`.
        model: the variant's .onnx file (external data beside it), or None when building
            failed.
        optimization_level: the ORT session optimization level to run it under.
        error: why it could not be built (``"ExcType: message"``), or None.
        build_s: seconds the optimizer took.
        nodes: node count of the main graph.
        norm_ops: normalization op counts (see :func:`fusion.norm_ops`).
        details: what the optimizer said it did (fusion counts), when it says.
        description: what it is (default: from :data:`VARIANTS`).
        provider: the execution provider it runs on when not the comparison's own (``"cpu"``
            for the CPU baseline of a CUDA run), else None.
    """

    name: str
    model: Path | None
    optimization_level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    error: str | None = None
    build_s: float = 0.0
    nodes: int = 0
    norm_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    details: dict = dataclasses.field(default_factory=dict)
    description: str = ""
    provider: str | None = None

    def __post_init__(self):
        self.description = self.description or (VARIANTS | OPTIONAL_VARIANTS).get(self.name, "")

    @classmethod
    def extra(cls, name: str, model: Path, description: str) -> Variant:
        """A model file of the caller's own to time beside the built variants
        (ORT_ENABLE_ALL)."""
        loaded = ir.load(model)
        return cls(
            name,
            model,
            nodes=len(loaded.graph),
            norm_ops=fusion.norm_ops(loaded),
            description=description,
        )

    def to_dict(self) -> dict:
        """JSON-ready summary (without the model)."""
        return {
            "description": self.description,
            "session_optimization": self.optimization_level.name,
            "built": self.model is not None,
            "error": self.error,
            "build_s": self.build_s,
            "nodes": self.nodes,
            "norm_ops": self.norm_ops,
            "details": self.details,
            "provider": self.provider,
        }


def _ort_offline(raw: Path, out: Path, provider: str, policy: fusion.Policy) -> dict:
    runtime.make_session(raw, provider, optimized_model_path=str(out))
    return {}


def _onnxscript_ort(raw: Path, out: Path, provider: str, policy: fusion.Policy) -> dict:
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model, counts = optimize_for_ort(ir.load(raw))
    save_model(model, out, external_data=True)
    return {k: v for k, v in counts.items() if v}


def _ort_transformers(raw: Path, out: Path, provider: str, policy: fusion.Policy) -> dict:
    # onnxruntime.transformers puts its own folder on sys.path, whose `models` package would
    # then shadow a user's `models` (e.g. for --model-class): put sys.path back afterwards.
    saved = sys.path[:]
    try:
        from onnxruntime.transformers.optimizer import optimize_model

        optimized = optimize_model(
            str(raw), model_type="bert", opt_level=0, use_gpu=provider == "cuda"
        )
    finally:
        sys.path[:] = saved
    optimized.save_model_to_file(str(out), use_external_data_format=True)
    counts = optimized.get_fused_operator_statistics()
    return {k: v for k, v in counts.items() if v}


def _optional(module: str):
    """Import ``module``, an optimizer of the ``bench`` extra, or raise an ImportError that
    says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{module} is not installed (pip install -e '.[bench]'): {err}") from err


def _save_proto(model: onnx.ModelProto, out: Path) -> None:
    save_model(ir.from_proto(model), out, external_data=True)


def _onnxslim(raw: Path, out: Path, provider: str, policy: fusion.Policy) -> dict:
    slim = _optional("onnxslim").slim
    _save_proto(slim(onnx.load(raw)), out)  # onnx.load reads the external data beside raw
    return {}


def _onnxsim(raw: Path, out: Path, provider: str, policy: fusion.Policy) -> dict:
    simplify = _optional("onnxsim").simplify
    model, _ = simplify(onnx.load(raw))  # the flag is its own check's, off by default
    _save_proto(model, out)
    # onnxsim records what it did in the model's metadata ("onnxsim.removed_nodes.count", ...).
    said = {p.key: p.value for p in model.metadata_props}
    counts = {k: int(said.get(f"onnxsim.{k}.count", 0)) for k in ("removed_nodes", "changed_nodes")}
    return {k: n for k, n in counts.items() if n}


def _normexport(raw: Path, out: Path, provider: str, policy: fusion.Policy) -> dict:
    model = ir.load(raw)
    report = fusion.optimize(model, policy)
    save_model(model, out, external_data=True)
    fusion.check(out)
    return {
        kind: n for kind, n in report.to_dict(FUSION_KINDS).items() if kind in FUSION_KINDS and n
    }


#: Variant name -> builder ``(raw .onnx, output .onnx, provider, fusion policy) -> details``;
#: the raw export is its own variant, not a copy.
_BUILDERS: dict[str, Callable[[Path, Path, str, fusion.Policy], dict]] = {
    "ort_offline": _ort_offline,
    "onnxscript_ort": _onnxscript_ort,
    "ort_transformers": _ort_transformers,
    "normexport": _normexport,
    "onnxslim": _onnxslim,
    "onnxsim": _onnxsim,
}


def build_variants(
    raw: ir.Model | Path,
    provider: str,
    folder: Path,
    *,
    policy: fusion.Policy | None = None,
    only: list[str] | None = None,
) -> dict[str, Variant]:
    """Build every variant of :data:`VARIANTS` (or those in ``only``, which may also name
    :data:`OPTIONAL_VARIANTS`) from the raw export.

    Args:
        raw: the model before any optimizer, as an .onnx file or in memory (then written to
            ``folder`` first); not changed.
        provider: ``"cpu"`` or ``"cuda"``: ORT's session optimizations, and the transformer
            optimizer's ``use_gpu``, depend on it.
        folder: where the variants' files are written (``NAME.onnx`` and its external data);
            it must outlive the variants' use.
        policy: normexport's variant's fusion policy; None: a run's for target ``"ort"`` on
            this machine's cores (:func:`normexport.runtime.fusion_policy.fusion_policy`).
        only: variant names to build, in that order (default: all).

    Returns:
        name -> :class:`Variant`; a failed build has ``model=None`` and ``error`` set.

    Raises:
        ValueError: a name in ``only`` is not a variant.
    """
    if isinstance(raw, ir.Model):
        path = Path(folder) / "raw.onnx"
        save_model(raw, path, external_data=True)
        raw = path
    policy = policy or fusion_policy("ort", provider, latency_threads())
    out = {}
    for name in only or list(VARIANTS):
        if name not in VARIANTS and name not in OPTIONAL_VARIANTS:
            known = list(VARIANTS) + list(OPTIONAL_VARIANTS)
            raise ValueError(f"unknown variant {name!r}: choose from {known}")
        path = Path(raw) if name == "ort_raw" else Path(folder) / f"{name}.onnx"
        out[name] = _build(name, Path(raw), path, provider, policy)
    return out


def _build(name: str, raw: Path, path: Path, provider: str, policy: fusion.Policy) -> Variant:
    """Variant ``name`` of the raw export at ``raw``, written to ``path`` by its builder (none
    for ``ort_raw``, which is ``raw`` itself); a failed build gives ``model=None`` and the
    error."""
    start = time.perf_counter()
    try:
        builder = _BUILDERS.get(name)
        # their logs, and their prints: ONNX Runtime's transformer optimizer and onnxslim
        # print() with no switch to stop them
        with (
            quiet("onnxscript", "onnxruntime", "fusion", "onnxslim", "onnxsim"),
            swallow_prints("stdout", "stderr"),
        ):
            details = builder(raw, path, provider, policy) if builder else {}
    except Exception as err:  # a broken optimizer is a result, not a crash
        return Variant(name, None, error=f"{type(err).__name__}: {err}".strip())
    loaded = ir.load(path)
    return Variant(
        name,
        path,
        optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if name == "ort_offline"
        else ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        build_s=time.perf_counter() - start,
        nodes=len(loaded.graph),
        norm_ops=fusion.norm_ops(loaded),
        details=details,
    )


# --- one-op models -------------------------------------------------------------------------

#: Microbenchmark forms: name -> (nodes as (op, domain, input names, attributes), opset).
#: Inputs ``x`` and ``skip`` are activations; ``gamma``, ``beta`` are parameters of the last
#: axis. ``Relu`` is the elementwise floor (one read, one write); ``Add`` reads two.
OP_FORMS: dict[str, tuple[list[tuple[str, str, list[str], dict]], int]] = {
    "Relu": ([("Relu", "", ["x"], {})], 17),
    "Add": ([("Add", "", ["x", "skip"], {})], 17),
    "LayerNormalization": ([("LayerNormalization", "", ["x", "gamma", "beta"], {})], 17),
    "RMSNormalization": ([("RMSNormalization", "", ["x", "gamma"], {})], 23),
    "SimplifiedLayerNormalization": (
        [("SimplifiedLayerNormalization", "", ["x", "gamma"], {})],
        17,
    ),
    "SkipLayerNormalization": (
        [("SkipLayerNormalization", MS_DOMAIN, ["x", "skip", "gamma", "beta"], {})],
        17,
    ),
    "Add+LayerNormalization": (
        [("Add", "", ["x", "skip"], {}), ("LayerNormalization", "", ["@", "gamma", "beta"], {})],
        17,
    ),
    "SkipSimplifiedLayerNormalization": (
        [("SkipSimplifiedLayerNormalization", MS_DOMAIN, ["x", "skip", "gamma"], {})],
        17,
    ),
    "Add+SimplifiedLayerNormalization": (
        [("Add", "", ["x", "skip"], {}), ("SimplifiedLayerNormalization", "", ["@", "gamma"], {})],
        17,
    ),
    "Add+RMSNormalization": (
        [("Add", "", ["x", "skip"], {}), ("RMSNormalization", "", ["@", "gamma"], {})],
        23,
    ),
}


def _float_input(name: str, shape: tuple[int, ...], dtype=ir.DataType.FLOAT) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))


def _const(name: str, array: np.ndarray) -> ir.Value:
    return ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        const_value=ir.tensor(array, name=name),
    )


def _model(
    graph_inputs: list[ir.Value], nodes: list[ir.Node], params: list[ir.Value], opset: int
) -> bytes:
    """Serialized model of ``nodes`` whose last node's first output is the graph output."""
    output = nodes[-1].outputs[0]
    output.name = "y"
    imports = {"": opset}
    if any(n.domain == MS_DOMAIN for n in nodes):
        imports[MS_DOMAIN] = 1
    graph = ir.Graph(
        graph_inputs, [output], nodes=nodes, initializers=params, opset_imports=imports
    )
    return ir.to_proto(ir.Model(graph, ir_version=10 if opset < 23 else 11)).SerializeToString()


def op_model(form: str, shape: tuple[int, ...], *, eps: float = 1e-5, seed: int = 0) -> bytes:
    """A model that computes one :data:`OP_FORMS` form over float32 ``x`` of ``shape``
    (norms over the last axis, with random ``gamma`` / ``beta``); inputs ``x`` (and ``skip``)."""
    ops, opset = OP_FORMS[form]
    rng = np.random.default_rng(seed)
    hidden = shape[-1]
    wanted = {name for _, _, names, _ in ops for name in names}
    inputs = [_float_input(n, shape) for n in ("x", "skip") if n in wanted]
    params = [
        _const(k, a.astype(np.float32))
        for k, a in (
            ("gamma", 1 + 0.5 * rng.standard_normal(hidden)),
            ("beta", 0.1 * rng.standard_normal(hidden)),
        )
        if k in wanted
    ]
    values = {v.name: v for v in (*inputs, *params)}
    nodes: list[ir.Node] = []
    for op, domain, names, attrs in ops:
        args = [nodes[-1].outputs[0] if n == "@" else values[n] for n in names]
        if op not in ("Relu", "Add"):
            # The Skip* contrib ops always normalize the last axis and take no axis attribute.
            attrs = ({} if domain == MS_DOMAIN else {"axis": -1}) | {"epsilon": eps} | attrs
        nodes.append(ir.node(op, args, attrs, domain=domain))
    return _model(inputs, nodes, params, opset)


def op_inputs(form: str, shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 feeds for :func:`op_model` ``(form, shape)``."""
    rng = np.random.default_rng(seed)
    names = {n for _, _, ns, _ in OP_FORMS[form][0] for n in ns} & {"x", "skip"}
    return {n: rng.standard_normal(shape).astype(np.float32) for n in sorted(names, reverse=True)}


def isolate_node(model: ir.Model, node: ir.Node, shapes: dict[str, tuple[int, ...]]) -> bytes:
    """A model holding only ``node`` (first output), its constant inputs copied, its other
    inputs made float graph inputs of the given concrete ``shapes`` (by value name)."""
    graph_inputs, params, args = [], [], []
    for i, value in enumerate(node.inputs):
        if value is None:
            args.append(None)
            continue
        name = value.name or f"input_{i}"
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is not None and not value.is_graph_input():
            params.append(_const(name, tensor.numpy()))
            args.append(params[-1])
        else:
            graph_inputs.append(
                _float_input(name, shapes[value.name], value.dtype or ir.DataType.FLOAT)
            )
            args.append(graph_inputs[-1])
    copy = ir.node(
        node.op_type, args, dict(node.attributes), domain=node.domain, name=node.name or "norm"
    )
    return _model(graph_inputs, [copy], params, opset_version(model))
