"""What every fusion pass shares: the kinds of rewrite, typed outcomes, and the pass base class.

A pass is an :class:`onnx_ir.passes.InPlacePass`. It declares what it needs instead of testing
it inside its matcher: the targets it runs for (:attr:`FusionPass.targets`), the option that
turns it on (:attr:`FusionPass.option`), and the default-domain opset its ops need per target
(:attr:`FusionPass.needs_opset`). Each call collects its own :class:`FusionReport`
(:attr:`FusionPass.outcomes`, also on the returned :class:`FusionResult`): a rewrite is a
:class:`Fused`, a candidate left alone a :class:`Refused` with a stable :class:`Code`.

To add a fusion: one pass module that subclasses :class:`NodeFusionPass` (or
:class:`FusionPass`) and declares its :class:`Kind`, one test module, and one line in
:data:`fusion.registry.PASSES`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, NamedTuple

import onnx_ir as ir

from fusion._ir import label, opset_version

#: What optimize() may emit: ``"ort"`` allows ONNX Runtime's contrib and default-domain ops,
#: ``"onnx"`` only standard ONNX ops of the model's opset.
TARGETS = ("ort", "onnx")

MS_DOMAIN = "com.microsoft"


class Op(NamedTuple):
    """An operator as a graph names it: ``op_type`` in ``domain`` (``""`` is ai.onnx)."""

    op_type: str
    domain: str = ""


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of rewrite, as the report counts it.

    Attributes:
        name: the count key in the report, e.g. ``"layernorm_fused"``.
        family: what its refusals, the gallery and ``explain`` call the subgraph, e.g.
            ``"layernorm"``.
        ops: the ops of this family a graph can hold: what a rewrite of this kind leaves in the
            graph, and for BatchNorm the op that the fold removes.
        norm: whether the family is a normalization (counted by :func:`fusion.norm_ops`);
            attention, GELU and scalar affine folds are not.
    """

    name: str
    family: str
    ops: tuple[Op, ...] = ()
    norm: bool = True


class Code(enum.StrEnum):
    """Stable codes for why a candidate was left alone (the report's ``refused[].code``).

    Tests and tools match these; the detail sentence beside them is for people and may change.
    """

    # Shared by the norm and BatchNorm passes.
    OPSET_TOO_LOW = "opset_too_low"
    SHARED_OUTPUT = "shared_output"
    TRAINING_MODE = "training_mode"
    NOT_CONSTANT = "not_constant"
    UNKNOWN_SHAPE = "unknown_shape"
    UNSUPPORTED_DTYPE = "unsupported_dtype"

    # LayerNorm / RMSNorm.
    #: ``v / (sqrt(ms) + eps)``: eps added outside the square root, a different function.
    EPS_OUTSIDE_SQRT = "eps_outside_sqrt"
    #: A weight or bias that varies along an axis that is not normalized (kept as its own op).
    AXIS_NOT_NORMALIZED = "axis_not_normalized"
    #: ``F.normalize(x) * sqrt(d)``: the L2 norm clamped at eps, not eps added to the mean square.
    F_NORMALIZE = "f_normalize"
    #: The division's numerator is not the tensor whose (centered) mean square is taken.
    WRONG_NUMERATOR = "wrong_numerator"
    #: A mean over axes that are not the trailing axes of the input.
    AXES_NOT_TRAILING = "axes_not_trailing"
    #: A ReduceMean with keepdims=0 whose result is not put back into its keepdims shape.
    KEEPDIMS_ZERO = "keepdims_zero"
    #: The mean and the variance reduce over different axes.
    DIFFERENT_AXES = "different_axes"
    #: eps is a constant of more than one element: it cannot become the epsilon attribute.
    EPS_NOT_SCALAR = "eps_not_scalar"
    #: The mean square is scaled by a factor that is zero, negative or not finite.
    FACTOR_NOT_POSITIVE = "factor_not_positive"
    #: The variance is reshaped to a shape other than its keepdims shape, or to one not known.
    VARIANCE_RESHAPED = "variance_reshaped"
    #: ``x - sum(x) / c`` with ``c`` not the number of elements summed (or a scaled mean):
    #: not x minus its mean.
    WRONG_MEAN_DIVISOR = "wrong_mean_divisor"

    # BatchNorm and affine folding.
    #: No Conv / ConvTranspose / Gemm / MatMul before it (or after it) to fold into.
    NO_LINEAR_LAYER = "no_linear_layer"
    #: The layer before it folds nothing, for no reason found on the way (a fallback).
    CHAIN_NOT_FOLDED = "chain_not_folded"
    #: The layer's weight has a shape it cannot have (not 2-D for Gemm / MatMul, < 3-D for Conv).
    WEIGHT_SHAPE = "weight_shape"
    #: The layer's bias does not fit its output channels.
    BIAS_SHAPE = "bias_shape"
    #: The BatchNorm parameters are not four vectors of one (C,) shape.
    PARAMETER_SHAPE = "parameter_shape"
    #: BatchNorm ``spatial=0`` (opset < 9): statistics per element, not per channel.
    SPATIAL_ZERO = "spatial_zero"
    #: ``input_var + epsilon`` is not positive for some channel.
    NONPOSITIVE_VARIANCE = "nonpositive_variance"
    #: The channel counts of the map and of the layer (or of the BatchNorm input) differ.
    CHANNEL_MISMATCH = "channel_mismatch"
    #: The map's channels land on another axis of the layer than its channel axis.
    WRONG_CHANNEL_AXIS = "wrong_channel_axis"
    #: A reshape regroups the channels across dimensions of unknown size.
    CHANNELS_REGROUPED = "channels_regrouped"
    #: A constant that varies along an axis other than the channels (or over a pool window).
    NOT_PER_CHANNEL = "not_per_channel"
    #: Shapes that do not fit: a constant that does not broadcast against the shape around a
    #: reshape (BatchNorm), Add operands that are not a pair the Skip op accepts.
    SHAPE_MISMATCH = "shape_mismatch"
    #: A Transpose ``perm`` that does not fit the rank of its input.
    PERM_MISMATCH = "perm_mismatch"
    #: A MaxPool on the way has its Indices output in use.
    MAXPOOL_INDICES_USED = "maxpool_indices_used"
    #: A MaxPool (GlobalMaxPool, ReduceMax) on the way, and a scale that is not positive: the
    #: max would become a min.
    MAXPOOL_NEGATIVE_SCALE = "maxpool_negative_scale"
    #: A mean or max (GlobalAveragePool, ReduceMean, ...) over an axis along which the map
    #: varies, such as the channels: the pooled map is no affine map of the pooled tensor.
    POOLS_OVER_CHANNELS = "pools_over_channels"
    #: A BatchNorm on a value of rank < 2.
    NO_CHANNEL_AXIS = "no_channel_axis"
    #: A constant with more axes than the value it applies to (broadcasting grows the output).
    BROADCAST_CHANGES_SHAPE = "broadcast_changes_shape"
    #: An op with a constant operand that is not an affine map of the tensor (constant / x).
    NOT_AFFINE = "not_affine"
    #: A division by a constant with a zero element.
    ZERO_DIVISOR = "zero_divisor"
    #: The Conv after a BatchNorm pads its input (a padded zero is not ``s * 0 + t``).
    PADDED_CONV = "padded_conv"
    #: The Gemm after a BatchNorm has ``transA=1``.
    GEMM_TRANS_A = "gemm_trans_a"

    # Re-parameterized blocks (fusion.merge_branches).
    #: A branch of the sum reads the block's input through an op that is no Conv, identity or
    #: BatchNorm (a ReLU in a branch).
    BRANCH_NOT_CONV = "branch_not_conv"
    #: The Conv branches have different strides, or an identity sits beside a strided Conv.
    STRIDE_MISMATCH = "stride_mismatch"
    #: The Conv branches differ in group or channels, or an identity beside Convs that change
    #: the channel count.
    GROUP_MISMATCH = "group_mismatch"
    #: The branches read different windows of the input (pads and kernels that do not line up,
    #: or auto_pad SAME).
    PADS_NOT_ALIGNED = "pads_not_aligned"
    #: The merged Conv would do more multiply-adds than the convolutions it replaces.
    MORE_WORK = "more_work"

    # InstanceNorm / GroupNorm / channels-first LayerNorm.
    #: The fused op has no ONNX Runtime kernel on the provider measured (ORT expands it into
    #: its function body, measured slower than the form the graph has): that form is kept.
    NO_ORT_KERNEL = "no_ort_kernel"
    #: The exact rewrite was measured slower than the form the graph has on the provider
    #: (``benchmarks/forms.py --set conv``): that form is kept.
    SLOWER_MEASURED = "slower_measured"

    # Skip (residual Add + norm).
    #: A Cast between the residual Add and the norm (the Skip op would add in another type).
    CAST_BETWEEN = "cast_between"
    #: The model imports com.microsoft at a version other than the Skip ops' 1.
    MS_OPSET_VERSION = "ms_opset_version"
    #: The norm's mean / inverse-std outputs are read (the Skip kernels do not compute them).
    STATS_OUTPUTS_USED = "stats_outputs_used"
    #: The norm normalizes more than the last axis.
    NOT_LAST_AXIS = "not_last_axis"
    #: The Add operands are neither 2-D nor 3-D.
    UNSUPPORTED_RANK = "unsupported_rank"
    #: A float16 norm with stash_type=0 (statistics in float16; the Skip op uses float32).
    STASH_TYPE_ZERO = "stash_type_zero"
    #: epsilon < 0, which the Skip kernels reject.
    NEGATIVE_EPSILON = "negative_epsilon"
    #: The norm's scale or bias has a type other than the data's.
    PARAM_DTYPE = "param_dtype"
    #: The norm's scale or bias is not a 1-D vector as long as the last axis.
    PARAM_SHAPE = "param_shape"

    # Rewrites undone after the passes (normexport.verdict.rollback), any family.
    #: The ONNX checker rejects the model with this rewrite.
    REJECTED_BY_CHECKER = "rejected_by_checker"
    #: ONNX Runtime cannot load or run the model with this rewrite on the provider.
    REJECTED_BY_RUNTIME = "rejected_by_runtime"
    #: With this rewrite the model fails the parity rule where the raw model does not.
    CHANGED_THE_FUNCTION = "changed_the_function"


class CannotFuse(Exception):
    """Raised by a matcher for a candidate that cannot be rewritten exactly.

    Args:
        code: the stable reason code.
        detail: one sentence for the report that says why, naming nodes where it helps.
    """

    def __init__(self, code: Code, detail: str):
        super().__init__(code, detail)
        self.code = Code(code)
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class Fused:
    """One rewrite that a pass made.

    Attributes:
        kind: a :attr:`Kind.name`, e.g. ``"layernorm_fused"``.
        node: name of the anchor node (the BatchNormalization or linear layer, or the node that
            produced the normalized output) in the graph before the rewrite; for attention and
            GELU, the Softmax, or the Erf or Tanh, that the fused node replaced. A pass given
            it in ``exclude`` leaves this rewrite out.
        became: what it was rewritten into, e.g. ``"LayerNormalization"`` or
            ``"folded into Conv 'conv1'"``.
        count: how many norms the rewrite removed (a chain of two BatchNorms folded at once
            counts 2).
    """

    kind: str
    node: str
    became: str
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Refused:
    """One candidate subgraph that a pass matched but left alone.

    Attributes:
        kind: the :attr:`Kind.family` of the candidate, e.g. ``"batchnorm"``.
        node: name of the anchor node, as it appears in the ONNX graph.
        code: the stable reason (a :class:`Code` value).
        detail: one sentence that says why the rewrite would not be exact.
    """

    kind: str
    node: str
    code: str
    detail: str


@dataclasses.dataclass
class FusionReport:
    """What passes did: rewrites and refusals in graph order, notes, counts per kind.

    A refusal of the same (kind, node) is kept once, so a pass run twice does not repeat it.
    """

    fused: list[Fused] = dataclasses.field(default_factory=list)
    refused: list[Refused] = dataclasses.field(default_factory=list)
    #: Changes to the model that are no fusion but that a user should know of (one sentence
    #: each), e.g. an IR version raised to make an old file valid.
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def counts(self) -> Counter:
        """Rewrites per :attr:`Kind.name`."""
        counts = Counter()
        for f in self.fused:
            counts[f.kind] += f.count
        return counts

    def record(self, kind: str, node: str, became: str, count: int = 1) -> None:
        """Record a rewrite of ``kind`` anchored at ``node`` into ``became``."""
        self.fused.append(Fused(kind, node, became, count))

    def refuse(self, kind: str, node: str, code: Code, detail: str) -> None:
        """Record that the candidate anchored at ``node`` was left alone, and why."""
        if any(r.kind == kind and r.node == node for r in self.refused):
            return
        self.refused.append(Refused(kind, node, str(Code(code)), detail))

    def note(self, text: str) -> None:
        """Record a change to the model that is not a fusion (kept once)."""
        if text not in self.notes:
            self.notes.append(text)

    def extend(self, other: FusionReport) -> None:
        """Append ``other``'s rewrites, refusals and notes (refusals and notes kept once)."""
        self.fused.extend(other.fused)
        for r in other.refused:
            self.refuse(r.kind, r.node, Code(r.code), r.detail)
        for text in other.notes:
            self.note(text)

    def codes(self, kind: str | None = None) -> list[str]:
        """The refusal codes, in graph order, of one family or of all."""
        return [r.code for r in self.refused if kind is None or r.kind == kind]

    def to_dict(self, kinds: tuple[str, ...] = ()) -> dict[str, Any]:
        """JSON-ready form: ``{kind: count, ..., "fused": [...], "refused": [...],
        "notes": [...]}``, with a count (zero or not) for every name in ``kinds``."""
        counts = self.counts
        out: dict[str, Any] = {kind: counts.get(kind, 0) for kind in kinds}
        out["fused"] = [dataclasses.asdict(f) for f in self.fused]
        out["refused"] = [dataclasses.asdict(r) for r in self.refused]
        out["notes"] = list(self.notes)
        return out


@dataclasses.dataclass
class FusionResult(ir.passes.PassResult):
    """A :class:`~onnx_ir.passes.PassResult` that also carries the pass's outcomes."""

    outcomes: FusionReport = dataclasses.field(default_factory=FusionReport)


class FusionPass(ir.passes.InPlacePass):
    """Base class of the fusion passes: declarations, the opset gate, and the outcomes.

    Subclasses set :attr:`kinds` and implement :meth:`apply`; they record into
    :attr:`outcomes` with :meth:`fused` and :meth:`refused`.

    Args:
        target: one of :data:`TARGETS`.
        exclude: anchors (:attr:`Fused.node`) of rewrites to leave out: a candidate anchored
            there is neither rewritten nor refused (whoever excludes it says why; the rollback
            of :mod:`normexport.verdict.rollback` does). Anchors are node names of the graph the
            pass runs on, so a run on the same model with the same passes before it finds them
            again.

    Raises:
        ValueError: ``target`` is not one of :data:`TARGETS`, or not one of :attr:`targets`.
    """

    #: The kinds of rewrite this pass makes; the first is the one its refusals belong to.
    kinds: ClassVar[tuple[Kind, ...]]
    #: The targets the pass may run for.
    targets: ClassVar[tuple[str, ...]] = TARGETS
    #: The ``optimize()`` keyword that turns the pass on, or None if it always runs.
    option: ClassVar[str | None] = None
    #: The targets for which the option defaults to on (an option the caller leaves as None).
    on_by_default: ClassVar[tuple[str, ...]] = ()
    #: Per target, the ai.onnx opset that the ops it emits need (absent: any opset).
    needs_opset: ClassVar[Mapping[str, int]] = {}

    def __init__(self, target: str = "ort", exclude: Collection[str] = ()):
        super().__init__()
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}: choose one of {TARGETS}")
        if target not in self.targets:
            raise ValueError(f"{type(self).__name__} emits ONNX Runtime ops: it needs target='ort'")
        self.target = target
        self.excluded = frozenset(exclude)
        self.outcomes = FusionReport()

    @classmethod
    def enabled(cls, target: str, options: Mapping[str, bool | None]) -> bool:
        """Whether ``optimize(target=target, **options)`` runs this pass."""
        if cls.option is None:
            return target in cls.targets
        wanted = options.get(cls.option)
        return bool(wanted) or (wanted is None and target in cls.on_by_default)

    @property
    def family(self) -> str:
        """The family this pass's refusals are recorded under."""
        return self.kinds[0].family

    def opset_gate(self, model: ir.Model) -> CannotFuse | None:
        """Why this pass's ops cannot be emitted into ``model`` (its opset is too low for
        :attr:`needs_opset`), or None when they can."""
        needed = self.needs_opset.get(self.target, 0)
        opset = opset_version(model)
        if opset >= needed:
            return None
        op = self.kinds[0].ops[0].op_type
        return CannotFuse(
            Code.OPSET_TOO_LOW,
            f"opset {opset} has no {op} (needs {needed}): export with --opset {needed} or "
            "target ONNX Runtime",
        )

    def fused(self, node: ir.Node | str, became: str, *, kind: str | None = None, count: int = 1):
        """Record a rewrite anchored at ``node`` (of :attr:`kinds`\\ [0] unless ``kind``)."""
        name = node if isinstance(node, str) else label(node)
        self.outcomes.record(kind or self.kinds[0].name, name, became, count)

    def refused(self, node: ir.Node | str, refusal: CannotFuse) -> None:
        """Record that the candidate anchored at ``node`` was left alone, and why."""
        name = node if isinstance(node, str) else label(node)
        self.outcomes.refuse(self.family, name, refusal.code, refusal.detail)

    def call(self, model: ir.Model) -> FusionResult:
        """Run :meth:`apply` with fresh :attr:`outcomes`; the result carries them."""
        self.outcomes = FusionReport()
        modified = self.apply(model)
        return FusionResult(model, modified, self.outcomes)

    def apply(self, model: ir.Model) -> bool:
        """Rewrite ``model`` in place and record outcomes; return whether it changed."""
        raise NotImplementedError


class NodeFusionPass(FusionPass):
    """A pass that visits each node of the main graph once: :meth:`match` finds a candidate
    anchored at the node, :meth:`rewrite` replaces it.

    The opset gate applies here: when :meth:`opset_gate` says the ops cannot be emitted, every
    match is recorded as an ``opset_too_low`` refusal and nothing is rewritten. A node among
    :attr:`excluded` is not visited.
    """

    def apply(self, model: ir.Model) -> bool:
        graph = model.graph
        gate = self.opset_gate(model)
        modified = False
        for node in list(graph):
            if node.graph is not graph or label(node) in self.excluded:  # removed, or left out
                continue
            try:
                match = self.match(model, node)
                if match is not None and gate is not None:
                    raise gate
            except CannotFuse as refusal:
                self.refused(node, refusal)
                continue
            if match is not None:
                self.fused(node, self.rewrite(model, match))
                modified = True
        return modified

    def match(self, model: ir.Model, node: ir.Node) -> Any | None:
        """The candidate anchored at ``node``, or None if there is none.

        Raises:
            CannotFuse: there is one, but it cannot be rewritten exactly.
        """
        raise NotImplementedError

    def rewrite(self, model: ir.Model, match: Any) -> str:
        """Replace the matched nodes; return what they became (for :attr:`Fused.became`)."""
        raise NotImplementedError
