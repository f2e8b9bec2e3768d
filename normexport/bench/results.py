"""What ``normexport bench`` measured, typed: :class:`BenchResult` and its parts, whose
``to_dict()`` is the JSON that ``--json`` writes (as :class:`normexport.report.Report` is the main
job's)."""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import onnx
import onnxruntime
import torch

from normexport import runtime
from normexport.bench.bench_options import BenchOptions
from normexport.bench.variants import Variant
from normexport.latency.measure import Ratio, Timing
from normexport.report import Versions


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the numbers were measured on.

    Attributes:
        cpu: the CPU's model name.
        cpu_cores_visible: the cores this process may run on.
        platform: the operating system, as :func:`platform.platform` says it.
        provider: the ONNX Runtime execution provider's name, e.g. ``"CPUExecutionProvider"``.
        versions: of onnxruntime, torch and onnx.
        gpu: the GPU's name on CUDA (``"unknown"`` where torch sees none), else None.
    """

    cpu: str
    cpu_cores_visible: int
    platform: str
    provider: str
    versions: Versions
    gpu: str | None = None

    @classmethod
    def probe(cls, provider: str) -> Machine:
        """This machine, for a run on ``provider`` (``"cpu"`` or ``"cuda"``)."""
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
        except (OSError, StopIteration):
            pass
        gpu = None
        if provider == "cuda":
            gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown"
        return cls(
            cpu=cpu,
            cpu_cores_visible=len(os.sched_getaffinity(0)),
            platform=platform.platform(),
            provider=runtime.PROVIDERS[provider][0],
            versions=Versions(torch.__version__, onnx.__version__, onnxruntime.__version__),
            gpu=gpu,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form; ``gpu`` only on CUDA (a CPU run never names a GPU)."""
        out = dataclasses.asdict(self)
        if self.gpu is None:
            del out["gpu"]
        return out


@dataclasses.dataclass(frozen=True)
class VsBest:
    """normexport's model against the fastest other optimizer's variant at one point.

    Attributes:
        best_other: that variant's name.
        ratio: normexport's time over its, per-round paired (< 1: normexport is faster).
    """

    best_other: str
    ratio: Ratio

    @property
    def within_spread(self) -> bool:
        """Whether normexport is as fast as the best other: the ratio's interval reaches 1 or
        below."""
        return self.ratio.ci_low <= 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``best_other``, ``ratio``, ``within_spread``."""
        return {
            "best_other": self.best_other,
            "ratio": self.ratio.to_dict(),
            "within_spread": self.within_spread,
        }


@dataclasses.dataclass
class Point:
    """Every variant timed at one input size.

    Attributes:
        batch, seq: the point as asked (None: the example's own size).
        inputs: input name -> its shape as run.
        timings: variant -> its timing (ms), for those that ran.
        errors: variant -> why it did not build, run, or match the reference's output structure.
        ratio_to_normexport, ratio_to_eager: variant -> its time over normexport's / PyTorch
            eager's, per-round paired (empty where that one did not run).
        reference: the variant the outputs are compared with: PyTorch eager, else the raw
            export (``ort_raw``), else None.
        max_abs_diff: variant -> max |output - reference's output| (None where the outputs
            differ in structure); empty without a reference.
        normexport_vs_best: see :class:`VsBest`; None where normexport's model or every other
            optimizer's variant did not run.
    """

    batch: int | None
    seq: int | None
    inputs: dict[str, list[int]]
    timings: dict[str, Timing]
    errors: dict[str, str]
    ratio_to_normexport: dict[str, Ratio]
    ratio_to_eager: dict[str, Ratio]
    reference: str | None
    max_abs_diff: dict[str, float | None]
    normexport_vs_best: VsBest | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``latency_ms`` holds the timings)."""
        vs = self.normexport_vs_best
        return {
            "inputs": self.inputs,
            "latency_ms": {k: t.to_dict() for k, t in self.timings.items()},
            "errors": self.errors,
            "ratio_to_normexport": {k: r.to_dict() for k, r in self.ratio_to_normexport.items()},
            "ratio_to_eager": {k: r.to_dict() for k, r in self.ratio_to_eager.items()},
            "reference": self.reference,
            "max_abs_diff": self.max_abs_diff,
            "normexport_vs_best": vs.to_dict() if vs else None,
            "batch": self.batch,
            "seq": self.seq,
        }


@dataclasses.dataclass(frozen=True)
class Floor:
    """The first fused norm of normexport's model alone against one Relu over its input tensor
    (:func:`normexport.bench.floor.norm_floor`).

    Attributes:
        node, op: the norm node's name and op type.
        shape: its input tensor's shape.
        provider: the ONNX Runtime execution provider's name.
        norm, elementwise: the norm's and the Relu's timing (ms).
        norm_over_floor: the norm's time over the Relu's, per-round paired: how far the norm
            is from the memory-bound limit.
    """

    node: str
    op: str
    shape: list[int]
    provider: str
    norm: Timing
    elementwise: Timing
    norm_over_floor: Ratio

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``norm_ms``, ``elementwise_ms`` hold the timings)."""
        return {
            "node": self.node,
            "op": self.op,
            "shape": self.shape,
            "provider": self.provider,
            "norm_ms": self.norm.to_dict(),
            "elementwise_ms": self.elementwise.to_dict(),
            "norm_over_floor": self.norm_over_floor.to_dict(),
        }


@dataclasses.dataclass(frozen=True)
class BenchVariant:
    """One timed model: how it was built, and the norm ops ONNX Runtime really ran.

    Attributes:
        variant: its build (file, session settings, node and norm op counts, error).
        ran_norm_ops: the norm op counts of the graph ORT runs after its session optimizations
            (ORT_ENABLE_ALL turns Add + LayerNormalization into SkipLayerNormalization on its
            own, for one); None where it was not built or does not load.
    """

    variant: Variant
    ran_norm_ops: dict[str, int] | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form: :meth:`normexport.bench.variants.Variant.to_dict` and
        ``ort_ran_norm_ops``."""
        return self.variant.to_dict() | {"ort_ran_norm_ops": self.ran_norm_ops}


@dataclasses.dataclass
class BenchResult:
    """What :func:`normexport.bench.measure.bench_model` measured (and ``normexport bench``
    writes as JSON).

    Attributes:
        machine: what it ran on.
        variants: name -> each timed model, in build order.
        points: each input size, in timing order.
        floor: the norm against the elementwise floor, or None (not asked for, no fused norm,
            normexport's model ran at no point, or it failed: ``floor_error``).
        floor_error: why the floor could not be measured (one line), or None.
        options: how it was timed.
        eager: whether PyTorch eager ran beside.
        model: the model file (the command's; None from the library unless the caller names
            it).
        provider_note: why the provider is not the one asked for (the command's), or None.
        sweep_note: why the sweep is narrower than asked for (the command's): the axes the
            model fixes, timed at its own size only (:mod:`normexport.bench.fixed`), or None.
    """

    machine: Machine
    variants: dict[str, BenchVariant]
    points: list[Point]
    floor: Floor | None
    floor_error: str | None
    options: BenchOptions
    eager: bool
    model: str | None = None
    provider_note: str | None = None
    sweep_note: str | None = None

    @property
    def provider(self) -> str:
        """The ONNX Runtime execution provider's name, e.g. ``"CPUExecutionProvider"``."""
        return self.machine.provider

    def to_dict(self) -> dict[str, Any]:
        """The JSON: ``model``, ``provider_note``, ``sweep_note``, ``machine``, ``provider``,
        ``variants``, ``points``, ``floor`` (``{"error": ...}`` where it failed) and
        ``settings``."""
        floor = self.floor.to_dict() if self.floor else None
        return {
            "model": self.model,
            "provider_note": self.provider_note,
            "sweep_note": self.sweep_note,
            "machine": self.machine.to_dict(),
            "provider": self.provider,
            "variants": {k: v.to_dict() for k, v in self.variants.items()},
            "points": [p.to_dict() for p in self.points],
            "floor": {"error": self.floor_error} if self.floor_error else floor,
            "settings": self.options.settings(eager=self.eager),
        }
