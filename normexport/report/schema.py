"""The typed report: :class:`Report` and its parts, whose ``to_dict`` is the JSON.

The JSON schema, key by key with types and units, is in ``docs/report.md``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fusion
from fusion import FUSION_KINDS
from normexport.latency.measure import BUSY_SPREAD, Timing
from normexport.progress import Stage
from normexport.report.explain import AlreadyFused
from normexport.runtime.cuda_kernels import Fallback
from normexport.runtime.plan import MemoryPlan
from normexport.verdict.checker_levels import Checker
from normexport.verdict.result import ParityResult

if TYPE_CHECKING:
    from normexport.latency.verdict import Speed
    from normexport.precision import PrecisionReport
    from normexport.precision.int8 import Int8Report
    from normexport.tuning.autotune import AutotuneResult
    from normexport.verdict.rollback import Outcome


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """One example input the model was exported and checked with.

    Attributes:
        shape: its shape (elements per axis).
        dtype: its numpy dtype name, e.g. ``"float32"``, ``"int64"``.
    """

    shape: list[int]
    dtype: str


@dataclasses.dataclass
class Fusions:
    """What normexport's passes did (from :class:`fusion.FusionReport`).

    Attributes:
        counts: rewrites per kind, a count (zero or not) for every :data:`fusion.FUSION_KINDS`
            key.
        fused: each rewrite and what it became, in graph order.
        refused: each candidate left alone, with its stable ``code`` and a ``detail`` sentence.
        notes: changes to the model that are no fusion (e.g. an IR version raised).
        already_fused: the norms the model held as one op before the passes.
    """

    counts: dict[str, int]
    fused: list[fusion.Fused]
    refused: list[fusion.Refused]
    notes: list[str]
    already_fused: list[AlreadyFused] = dataclasses.field(default_factory=list)

    @classmethod
    def from_fusion_report(
        cls, report: fusion.FusionReport, already_fused: list[AlreadyFused] = ()
    ) -> Fusions:
        """The report's outcomes, with a count for every :data:`fusion.FUSION_KINDS` key."""
        counts = report.counts
        return cls(
            {kind: counts.get(kind, 0) for kind in FUSION_KINDS},
            list(report.fused),
            list(report.refused),
            list(report.notes),
            list(already_fused),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the counts as top-level keys, then ``fused``, ``refused``, ``notes``,
        ``already_fused``."""
        return {
            **self.counts,
            "fused": [dataclasses.asdict(f) for f in self.fused],
            "refused": [dataclasses.asdict(r) for r in self.refused],
            "notes": list(self.notes),
            "already_fused": [dataclasses.asdict(a) for a in self.already_fused],
        }


@dataclasses.dataclass(frozen=True)
class NormOps:
    """Normalization op counts (:func:`fusion.norm_ops`), op type -> nodes, zeros left out.

    Attributes:
        before: in the model before normexport's passes (the raw export or the input file).
        after: in the written model.
    """

    before: dict[str, int]
    after: dict[str, int]


@dataclasses.dataclass
class Latency:
    """Latency of each variant, timed interleaved in one process, and the conditions.

    Attributes:
        timings: variant (``pytorch_eager``, ``ort_raw``, ``ort_optimized``) -> its timing, ms.
        pytorch_threads, onnxruntime_threads: intra-op threads each was given (the same).
        apart: why the ONNX Runtime variants were timed one at a time, not interleaved (their
            sessions would not fit in memory together), or None.
        sessions: ONNX Runtime sessions of each model, opened in ABBA order and timed in turn
            (:func:`normexport.latency.measure.counterbalanced`).
    """

    timings: dict[str, Timing]
    pytorch_threads: int
    onnxruntime_threads: int
    apart: str | None = None
    sessions: int = 1

    @property
    def busy(self) -> list[str]:
        """The variants whose p90 was over :data:`BUSY_SPREAD` times their median."""
        return [k for k, t in self.timings.items() if t.p90_ms > BUSY_SPREAD * t.median_ms]

    def conditions(self) -> dict[str, Any]:
        """The JSON ``latency_conditions``."""
        return {
            "pytorch_threads": self.pytorch_threads,
            "onnxruntime_threads": self.onnxruntime_threads,
            "busy": self.busy,
            "apart": self.apart,
            "sessions_per_model": self.sessions,
        }


@dataclasses.dataclass(frozen=True)
class Versions:
    """Versions of the libraries that exported, checked and timed the model."""

    torch: str
    onnx: str
    onnxruntime: str


@dataclasses.dataclass(frozen=True)
class Cost:
    """What the run took: wall time and peak resident memory, per stage and in all.

    Attributes:
        stages: each stage in the order it ran (:class:`normexport.progress.Stage`).
        weight_bytes: bytes of the input model's initializers (of the raw export for a
            PyTorch model): the yardstick of the memory figures.
        process_s: seconds from the process's start to the end of the run (the interpreter's
            start and the imports counted: :func:`normexport.progress.process_age_s`), or None
            where the system does not say.
    """

    stages: list[Stage]
    weight_bytes: int
    process_s: float | None = None

    @property
    def peak_rss_bytes(self) -> int | None:
        """The run's peak resident set (bytes), or None where the system does not say."""
        peaks = [s.peak_rss_bytes for s in self.stages if s.peak_rss_bytes is not None]
        return max(peaks, default=None)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``docs/report.md``, ``cost``)."""
        peak = self.peak_rss_bytes
        return {
            "wall_s": sum(s.wall_s for s in self.stages),
            "process_s": self.process_s,
            "peak_rss_bytes": peak,
            "weight_bytes": self.weight_bytes,
            "peak_over_weights": peak / self.weight_bytes if peak and self.weight_bytes else None,
            "stages": [dataclasses.asdict(s) for s in self.stages],
        }


@dataclasses.dataclass
class Report:
    """What the main job did (:func:`normexport.pipeline.run`, :func:`normexport.optimize`).

    Attributes:
        model: the model file as given (or ``<nn.Module Name>`` for an in-memory module).
        kind: how it loaded: ``onnx``, ``exported_program``, ``torchscript``,
            ``pickled_module``, ``state_dict`` or ``nn_module``.
        exporter: ``dynamo``, ``torchscript``, or ``none`` for ONNX input.
        exporter_fallback: why the dynamo exporter failed and the TorchScript one was used
            (one line), or None.
        exporter_warnings: the TorchScript tracer's warnings, ``file:line: message``, each
            once (a trace that may not generalize: a branch on a tensor's value was fixed).
        opset: the written model's ai.onnx opset.
        target: ``ort`` or ``onnx``.
        output: the written model.
        files_written: the model, then its own external data file where it has one.
        inputs: example input name -> shape and dtype.
        fusions, norm_ops, checker: see the classes.
        onnxruntime_ops: the ops of the written model that only ONNX Runtime runs
            (:func:`fusion.onnxruntime_ops`: com.microsoft contrib ops, and ONNX Runtime's
            default-domain ops where ONNX has none at the model's opset), op -> nodes; empty
            where the model is standard ONNX of its opset.
        parity: the verdict and errors (:class:`normexport.verdict.result.ParityResult`).
        provider: the ONNX Runtime execution provider the sessions really used.
        provider_note: why it is not the one asked for, or None.
        notes: what to know about how the model was loaded (e.g. put in eval mode).
        latency: the timings, or None without benchmarking.
        autotune: what ``--autotune`` measured and kept, or None.
        versions: library versions.
        precision: what ``--precision fp16|bf16`` did
            (:class:`normexport.precision.PrecisionReport`) or ``int8|int8-dynamic``
            (:class:`normexport.precision.int8.Int8Report`), or None for a float32 model.
        rollback: the rewrites undone because ONNX Runtime or the checker rejected them or
            they changed the function (:class:`normexport.verdict.rollback.Outcome`), or None where
            the optimized model passed its check as the passes made it.
        speed: the latency verdict: the published model against the raw one, the rewrites
            undone as slower here, or why the speed was not checked
            (:class:`normexport.latency.verdict.Speed`); None only in a report made by hand.
        cost: the run's wall time and peak memory per stage (:class:`Cost`), or None.
        memory: the memory plan made before the first session
            (:class:`normexport.runtime.plan.MemoryPlan`), or None.
        cuda_fallbacks: on the CUDA provider, the nodes of the output it has no kernel for
            (ONNX Runtime runs them on the CPU: :func:`normexport.runtime.cuda_kernels.
            without_kernel`); None on the CPU provider.
    """

    model: str
    kind: str
    exporter: str
    exporter_fallback: str | None
    exporter_warnings: list[str]
    opset: int
    target: str
    output: Path
    files_written: list[Path]
    inputs: dict[str, InputInfo]
    fusions: Fusions
    norm_ops: NormOps
    onnxruntime_ops: dict[str, int]
    checker: Checker
    parity: ParityResult
    provider: str
    provider_note: str | None
    notes: list[str]
    latency: Latency | None
    autotune: AutotuneResult | None
    versions: Versions
    precision: PrecisionReport | Int8Report | None = None
    rollback: Outcome | None = None
    speed: Speed | None = None
    cost: Cost | None = None
    memory: MemoryPlan | None = None
    cuda_fallbacks: list[Fallback] | None = None

    @property
    def passed(self) -> bool:
        """Whether parity passed (exit code 0; else 1): the optimizer's rule and the export
        check everywhere, and with ``--strict`` no noise-ratio warning."""
        return self.parity.passed

    @property
    def external_data(self) -> bool:
        """Whether the output has its own external data file."""
        return len(self.files_written) > 1

    def to_dict(self) -> dict[str, Any]:
        """The JSON report (schema: ``docs/report.md``)."""
        latency = self.latency
        return {
            "model": self.model,
            "kind": self.kind,
            "exporter": self.exporter,
            "exporter_fallback": self.exporter_fallback,
            "exporter_warnings": list(self.exporter_warnings),
            "opset": self.opset,
            "target": self.target,
            "output": str(self.output),
            "files_written": [str(p) for p in self.files_written],
            "external_data": self.external_data,
            "inputs": {k: dataclasses.asdict(v) for k, v in self.inputs.items()},
            "fusions": self.fusions.to_dict(),
            "norm_ops": dataclasses.asdict(self.norm_ops),
            "onnxruntime_ops": dict(self.onnxruntime_ops),
            "checker": dataclasses.asdict(self.checker),
            "parity": self.parity.to_dict(),
            "provider": self.provider,
            "provider_note": self.provider_note,
            "notes": list(self.notes),
            "latency_ms": {k: t.to_dict() for k, t in latency.timings.items()} if latency else None,
            "latency_conditions": latency.conditions() if latency else None,
            "autotune": self.autotune.to_dict() if self.autotune else None,
            "versions": dataclasses.asdict(self.versions),
            "precision": self.precision.to_dict() if self.precision else None,
            "rollback": self.rollback.to_dict() if self.rollback else None,
            "speed": self.speed.to_dict() if self.speed else None,
            "cost": self.cost.to_dict() if self.cost else None,
            "memory": self.memory.to_dict() if self.memory else None,
            "cuda_fallbacks": (
                None
                if self.cuda_fallbacks is None
                else [dataclasses.asdict(f) for f in self.cuda_fallbacks]
            ),
        }
