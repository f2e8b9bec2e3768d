"""What every stage of a run reads: the options, the paths, the provider, the prepared model's
inputs and what the raw model held, fixed once the model is prepared (:class:`Job`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

import fusion
from normexport import precision
from normexport.arguments import Options
from normexport.errors import UsageError
from normexport.io import files
from normexport.io.inputs import Sizing, example_arrays, id_ranges, input_sets
from normexport.io.load import LoadedModel
from normexport.latency.measure import latency_threads
from normexport.pipeline.prepare import ExportInfo, Prepared, by_feed_name
from normexport.precision.calibration import load_calibration
from normexport.report.explain import already_fused
from normexport.runtime.fusion_policy import fusion_policy


@dataclasses.dataclass(frozen=True)
class Job:
    """One run's fixed facts, read by every stage (none of them changes it).

    Attributes:
        opts: what the user asked for.
        output: the optimized model's path.
        provider, provider_note: ``"cpu"`` or ``"cuda"``, and why where it is not the one asked
            for (:func:`normexport.runtime.resolve_provider`).
        loaded, example, export: as :func:`normexport.pipeline.prepare.prepare` gave them.
        feed_names: the raw graph's inputs (initializers aside), in order.
        sets: the parity input sets, name -> feeds (:func:`normexport.io.inputs.input_sets`;
            with the overflow probe for half precision; int8: in-distribution sets only).
        ops_before: the raw model's norm op counts (:func:`fusion.norm_ops`).
        already: the norms the raw model already had as one op
            (:func:`normexport.report.explain.already_fused`).
        computes_in: the precision of the raw model's weights (``fp32``, ``fp16``, ``bf16``:
            :func:`normexport.precision.computes_in`), whose rule judges a model that stays
            in it.
        external: the output is written with external data
            (:func:`normexport.io.files.wants_external_data`).
        threads: the intra-op threads the model is made for and timed with
            (:func:`run_threads`).
        policy: the fusion policy of the run (:func:`run_policy`): what the passes, the
            rollback's rebuilds and the autotuner's variants run with.
        sizing: the example's sizes try by try, where normexport made an ONNX file's example
            (:class:`normexport.io.inputs.Sizing`; :func:`larger`), else None.
        calibration: ``--precision int8``'s calibration samples, feeds by input name
            (``--calibration``'s, else the example and random input sets); empty otherwise.
    """

    opts: Options
    output: Path
    provider: str
    provider_note: str | None
    loaded: LoadedModel
    example: dict[str, np.ndarray]
    export: ExportInfo
    feed_names: list[str]
    sets: dict[str, dict[str, np.ndarray]]
    ops_before: dict[str, int]
    already: list
    computes_in: str
    external: bool
    threads: int
    policy: fusion.Policy
    sizing: Sizing | None = None
    calibration: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """The report's notes: the loading's, then the sizes normexport picked."""
        picked = self.sizing.note() if self.sizing is not None else None
        return [*self.loaded.notes, *([picked] if picked else [])]

    @property
    def output_rule(self) -> str:
        """The precision whose parity rule judges the output: ``--precision`` where it
        converts, else the raw model's own (:attr:`computes_in`)."""
        return self.opts.precision if self.opts.conversion else self.computes_in


def start(opts: Options, output: Path, provider: tuple[str, str | None], prepared: Prepared) -> Job:
    """The :class:`Job` of a prepared model: feed names, the input sets for parity, what the raw
    model holds (read before any pass changes it)."""
    loaded, example, raw, export, sizing = prepared
    feed_names = [v.name for v in raw.graph.inputs if not v.is_initializer()]
    calibration = []
    if opts.calibration is not None:
        calibration = load_calibration(
            opts.calibration, feed_names, by_feed_name(example, feed_names)
        )
    sets = _sets(opts, example, feed_names, raw, calibration)
    threads = run_threads(opts)
    return Job(
        opts=opts,
        output=output,
        provider=provider[0],
        provider_note=provider[1],
        loaded=loaded,
        example=example,
        export=export,
        feed_names=feed_names,
        sets=sets,
        ops_before=fusion.norm_ops(raw),
        already=already_fused(raw),
        computes_in=precision.computes_in(raw),
        external=files.wants_external_data(raw),
        threads=threads,
        policy=run_policy(opts, raw, provider[0], threads),
        sizing=sizing,
        calibration=calibration or _calibration(opts, sets),
    )


#: How many of ``--calibration``'s samples int8's parity runs on, besides the example.
CALIBRATION_SETS = 4


def _calibration(opts: Options, sets: dict) -> list[dict[str, np.ndarray]]:
    """int8's calibration without ``--calibration``: the example and random input sets (the
    in-distribution ones); none for other precisions."""
    if opts.conversion != "int8":
        return []
    return [feeds for name, feeds in sets.items() if name.startswith(("example", "random_"))]


#: Which input sets stay where fewer run (:func:`fewer_sets`), most telling first: the
#: example, one random set, the probes that find a lost epsilon, then the rest in order.
KEPT_FIRST = ("example", "random_0", "constant", "huge_1e3", "overflow_outliers", "zeros")


def fewer_sets(job: Job, count: int | None) -> Job:
    """``job`` with its first ``count`` input sets in :data:`KEPT_FIRST`'s order (the others
    after, in theirs), where the memory plan keeps fewer (``count`` not None)."""
    if count is None or count >= len(job.sets):
        return job
    names = [n for n in KEPT_FIRST if n in job.sets]
    names += [n for n in job.sets if n not in names]
    return dataclasses.replace(job, sets={n: job.sets[n] for n in names[:count]})


def _sets(
    opts: Options,
    example: dict[str, np.ndarray],
    feed_names: list[str],
    raw,
    calibration: list[dict[str, np.ndarray]] = (),
) -> dict:
    """The parity input sets of ``example`` (:func:`normexport.io.inputs.input_sets`), with the
    overflow probe for half precision; for int8 the in-distribution sets only (the probes lie
    outside any calibrated range, where int8 clips by design: docs/parity.md#int8): the
    example and the random sets, or with ``--calibration`` the example and the first
    :data:`CALIBRATION_SETS` calibration samples (``calibration_N``)."""
    sets = input_sets(by_feed_name(example, feed_names), id_ranges=id_ranges(raw))
    if opts.conversion == "int8":
        # the random sets are int8's calibration where the user gives none; where the user
        # does, the example and the user's samples are its distribution
        kept = ("example",) if calibration else ("example", "random_")
        sets = {n: f for n, f in sets.items() if n.startswith(kept)}
        sets |= {f"calibration_{i}": f for i, f in enumerate(calibration[:CALIBRATION_SETS])}
    elif opts.conversion == "half":
        sets |= precision.overflow_set(sets["example"])
    return sets


def larger(job: Job, raw) -> Job | None:
    """``job`` with the example inputs of its next, larger try of sizes (where the model
    refused those normexport picked: :class:`normexport.io.inputs.Sizing`), and the input sets
    made from them; None where there is no larger try. ``raw``: the onnx_ir model (its tables
    bound the ids drawn, :func:`normexport.io.inputs.id_ranges`)."""
    sizing = job.sizing.larger() if job.sizing is not None else None
    if sizing is None:
        return None
    example = example_arrays(sizing.specs, id_ranges(raw))
    given = job.calibration if job.opts.calibration is not None else []
    sets = _sets(job.opts, example, job.feed_names, raw, given)
    calibration = given or _calibration(job.opts, sets)
    return dataclasses.replace(
        job, example=example, sets=sets, sizing=sizing, calibration=calibration
    )


def run_threads(opts: Options) -> int:
    """The intra-op threads a run of ``opts`` makes the model for and times it with:
    ``--threads``, else (None) the cores this process may run on
    (:func:`normexport.latency.measure.latency_threads`). The one place the default is
    resolved; the run (:attr:`Job.threads`) and ``explain`` ask it once each."""
    return opts.threads or latency_threads()


def run_policy(opts: Options, raw, provider: str, threads: int) -> fusion.Policy:
    """The fusion policy of a run of ``opts`` on ``raw`` (an onnx_ir model) for ``provider``
    (``"cpu"`` or ``"cuda"``) and ``threads`` (:func:`run_threads`):
    :func:`normexport.runtime.fusion_policy.fusion_policy` given what the user chose (``--target``,
    ``--last-token-logits``). The run and ``explain`` both ask this: a user's choice reaches the
    policy through this one call.

    Raises:
        UsageError: ``--last-token-logits`` and the first output is not 3-D.
    """
    last_rows = (_last_token_output(opts, raw),) if opts.last_token_logits else ()
    return fusion_policy(opts.target, provider, threads, last_rows=last_rows)


def _last_token_output(opts: Options, raw) -> str:
    """The output ``--last-token-logits`` keeps at its last position: the first, by name.

    Raises:
        UsageError: the first output is not 3-D.
    """
    first = raw.graph.outputs[0]
    if first.shape is None or len(first.shape) != 3:
        shape = "unknown" if first.shape is None else f"({', '.join(map(str, first.shape))})"
        raise UsageError(
            f"{opts.model}: --last-token-logits keeps the first output's last position, and "
            f"that output ({first.name!r}, shape {shape}) is not (batch, sequence, vocabulary): "
            "drop the flag for this model"
        )
    return first.name
