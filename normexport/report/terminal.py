"""The report on the terminal: tables and lines printed with rich (:func:`render`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from normexport.report.schema import Checker, Cost, Fusions, NormOps, Report
from normexport.report.timed import render_latency, render_speed
from normexport.verdict.result import Deployed, OutputError, ParityResult
from normexport.verdict.tolerance import INT8_MAX_REL_L2, INT8_MIN_TOP1, NOISE_WARN_FACTOR

if TYPE_CHECKING:
    from normexport.precision import PrecisionReport
    from normexport.precision.int8 import Int8Report
    from normexport.tuning.autotune import AutotuneResult
    from normexport.verdict.rollback import Outcome


def _render_checker(checker: Checker, console: Console) -> None:
    """One line when the input already fails the ONNX checker (old exporters' files)."""
    if checker.input == "full":
        return
    which = "full check" if checker.input == "basic" else "check"
    line = f"[yellow]the input fails the ONNX checker's {which}[/] ({checker.input_problem})"
    if checker.input == "basic":
        line += "; the output was checked as far as the input passes (no shape inference)"
    elif checker.output == "full":
        line += "; the output passes it"
    else:
        line += f"; so does the output ({checker.output_problem})"
    console.print(line + "; ONNX Runtime loads and runs both")


def _err(value) -> str:
    return "-" if value is None else f"{value:.3g}"


#: Above this many outputs the terminal shows each output's worst input set only.
ROWS_PER_SET_UP_TO = 4


def _parity_rows(parity: ParityResult) -> list[tuple[str, OutputError]]:
    """(input set, errors) per table row: every set of every output where there are few
    outputs, else each output's worst set."""
    worst = parity.worst()
    if parity.probes and len(worst) <= ROWS_PER_SET_UP_TO:
        sets = parity.probes.items()
        return [(p, e) for name in worst for p, es in sets for e in es if e.output == name]
    return [(_worst_set(parity, e), e) for e in worst.values()]


def _parity_table(parity: ParityResult) -> Table:
    """Errors against the oracle, per output and input set, with the verdict."""
    oracle = parity.oracle or parity.reference
    raw = "input file" if parity.reference == "onnx" else "raw export"
    half = parity.max_rel_l2 is not None
    rule = f"atol {parity.atol:g}, rtol {parity.rtol:g}"
    if half and parity.max_rel_l2 == INT8_MAX_REL_L2:
        rule = (
            f"int8: rel L2 <= {parity.max_rel_l2:g} + {raw}'s, or max abs err <= atol "
            f"{parity.atol:g}; class scores: top-1 kept on >= {INT8_MIN_TOP1:.0%} of samples"
        )
    elif half:
        rule = (
            f"rel L2 <= {parity.max_rel_l2:g} + {raw}'s + {_err(parity.noise_factor)} x input "
            f"rounding's, or max abs err <= atol {parity.atol:g}"
        )
    elif parity.noise_factor is not None:
        rule += f", noise factor {parity.noise_factor:g} x {raw}"
    kind = "rel L2 error" if half else "max abs error"
    table = Table(
        title=f"Parity: {kind} vs {oracle} ({rule}; inputs: {', '.join(parity.probes)})",
        title_justify="left",
    )
    third = "input rounding" if half else "pytorch f32"
    ratio = () if half else (f"÷ {raw}",)
    cols = ("output", "input set", "optimized", raw, third, "max |oracle|", *ratio, "")
    for col in cols:
        table.add_column(col, justify="left" if col in ("output", "input set") else "right")
    for probe, e in _parity_rows(parity):
        verdict = "[green]pass[/]" if e.passed else "[red]FAIL[/]"
        if e.warned:
            verdict = "[yellow]warn[/]" if not parity.strict else "[red]FAIL (strict)[/]"
        if e.export_passed is False:
            verdict = "[red]FAIL: export[/]" if e.passed else verdict + " [red]+ export[/]"
        if e.weak:
            verdict += " [yellow](weak)[/]"
        errors = (
            (e.rel_l2_err, e.raw_rel_l2_err, e.rounding_rel_l2_err)
            if half
            else (e.max_abs_err, e.raw_max_abs_err, e.pytorch_max_abs_err)
        )
        ratios = () if half else (_ratio(e.noise_ratio),)
        table.add_row(e.output, probe, *map(_err, (*errors, e.max_abs_ref)), *ratios, verdict)
    return table


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}x"


def _render_parity(parity: ParityResult, console: Console) -> None:
    """The parity table, the oracle's notes, the weak checks and the first failures."""
    console.print(_parity_table(parity))
    for note in parity.notes:
        console.print(f"[yellow]note[/]: {note}")
    if parity.blocks:
        console.print(f"[yellow]note[/]: {_blocks(parity)}")
    weak: dict[str, list[str]] = {}
    for probe, output in parity.weak_checks():
        weak.setdefault(output, []).append(probe)
    for name, probes in weak.items():
        every = len(probes) == len(parity.probes)
        where = (
            "[bold]every input set[/]: parity says little about it" if every else ", ".join(probes)
        )
        why = "reference is constant (within atol)"
        if parity.max_rel_l2 is not None:
            why += ", or the half-precision allowance reaches 1,"

        console.print(f"[yellow]weak check[/]: the {why} for output {name!r} on " + where)
    if parity.deployed is not None:
        console.print(_deployed(parity.deployed))
    for probe, f in parity.failures()[:10]:
        console.print(
            f"[red]diverges[/]: output {f.output!r} on input set {probe!r}: max abs err "
            f"{f.max_abs_err:.3g} (raw export {_err(f.raw_max_abs_err)}), rel L2 "
            f"{f.rel_l2_err:.3g}, {f.nonfinite_mismatch} NaN/Inf where the reference is finite"
        )
    for probe, w in parity.warnings()[:10]:
        what = "[red]fails (--strict)[/]" if parity.strict else "[yellow]warning[/]"
        console.print(
            f"{what}: output {w.output!r} on input set {probe!r} is within the tolerance but "
            f"{w.noise_ratio:.3g}x as far from the oracle as the raw model (max abs err "
            f"{w.max_abs_err:.3g} against {_err(w.raw_max_abs_err)}); an exact rewrite stays "
            f"within {NOISE_WARN_FACTOR:g}x (float32 rounding), so a rewrite may have changed "
            "the function a little" + ("" if parity.strict else "; --strict makes this a failure")
        )


def _deployed(deployed: Deployed) -> str:
    """One line: the output judged as deployed, and what was repaired for ONNX Runtime (in the
    raw model, before the passes, or in the output)."""
    repairs = ", ".join(f"{n} node(s) for {issue}" for issue, n in deployed.repairs.items())
    if deployed.repaired == "raw":
        color = "yellow" if deployed.passed else "red"
        return (
            f"[{color}]as deployed[/]: the raw model: {deployed.found}; repaired before the "
            f"passes into an exact form (rewritten: {repairs}), from which every model of the "
            f"run starts; the output: {deployed.message}"
        )
    if deployed.found is not None:
        return (
            f"[yellow]as deployed[/]: {deployed.found}; published in an exact form it runs "
            f"correctly (rewritten: {repairs}): {deployed.message}"
        )
    if deployed.passed:
        return f"as deployed: {deployed.message}"
    tried = f" (the exact forms for ONNX Runtime's known bugs tried: {repairs})" if repairs else ""
    return f"[red]as deployed[/]: {deployed.message}{tried}"


def _cuda_note(fallbacks: list) -> str:
    """One line: every node has a CUDA kernel, or which ones ONNX Runtime runs on the CPU."""
    if not fallbacks:
        return "every node has a CUDA kernel (ONNX Runtime's kernel table)"
    shown = "; ".join(f"{f.node} ({f.op}): {f.why}" for f in fallbacks[:5])
    more = f"; and {len(fallbacks) - 5} more" if len(fallbacks) > 5 else ""
    return (
        f"[yellow]note[/]: {len(fallbacks)} node(s) have no CUDA kernel, and ONNX Runtime runs "
        f"them on the CPU, copying their tensors across: {shown}{more}"
    )


def _blocks(parity: ParityResult) -> str:
    """One line: parity ran block by block, and its worst block."""
    line = f"parity ran block by block ({len(parity.blocks)} blocks)"
    worst = parity.worst_block()
    if worst is None:
        return line
    e, block = worst.worst_local(), worst.block
    raw = "" if e.raw_rel_l2_err is None else f" (the input file's {e.raw_rel_l2_err:.3g})"
    return (
        f"{line}; the worst, block {block['index'] + 1} ({block['nodes']} nodes, "
        f"{block['weight_bytes'] / 2**30:.2f} GiB of weights, {worst.seconds:.1f} s): rel L2 "
        f"{e.rel_l2_err:.3g}{raw} on {e.output!r} fed the oracle's inputs"
    )


def _render_export(report: Report, console: Console) -> None:
    """Where the raw export differs from PyTorch: the input sets, the errors, the exporter and
    why it was used, and the tracer's warnings."""
    failures = report.parity.export_failures()
    if not failures:
        return
    sets: dict[str, list[str]] = {}
    for probe, f in failures:
        sets.setdefault(f.output, []).append(probe)
    probe, f = failures[0]
    console.print(
        f"[red]the export differs from the model[/]: the ONNX graph the {report.exporter} "
        "exporter made does not compute what the PyTorch model computes, before any rewrite of "
        "normexport's ("
        + "; ".join(f"output {o!r} on {', '.join(p)}" for o, p in sets.items())
        + f"; on {probe}, from the oracle ({report.parity.oracle}): the raw export "
        f"{_err(f.raw_max_abs_err)}, PyTorch float32 {_err(f.pytorch_max_abs_err)}, max "
        f"|oracle| {f.max_abs_ref:.3g})"
    )
    if report.exporter_fallback:
        console.print("  the TorchScript exporter was used: the dynamo exporter failed (above)")
    for warning in report.exporter_warnings:
        console.print(f"  tracer warning: {warning}")
    console.print(
        "  a trace follows one path through forward(): Python control flow on a tensor's "
        "values (if, while, int(), .item()) is fixed at the example inputs; rewrite it with "
        "torch.where / torch.cond, or export with --exporter dynamo and fix what it reports"
    )


def _worst_set(parity: ParityResult, worst: OutputError) -> str:
    for probe, errors in parity.probes.items():
        if any(e is worst for e in errors):
            return probe
    return "(worst)"


def _render_header(report: Report, console: Console) -> None:
    """The model, how it was exported, where it went, and the notes about it."""
    made = "as given" if report.exporter == "none" else f"exporter {report.exporter}"
    console.print(
        f"[bold]{report.model}[/] ({report.kind.replace('_', ' ')}, {made}, target "
        f"{report.target}) -> [bold]{report.output}[/] (opset {report.opset})"
    )
    if report.exporter_fallback:
        console.print(
            f"[yellow]exporter[/]: the dynamo exporter failed ({report.exporter_fallback}); "
            "the TorchScript exporter was used"
        )
    if report.external_data:
        console.print(f"external data: {report.files_written[1]} (the output's own)")
    if report.onnxruntime_ops:
        ops = ", ".join(f"{op} x{n}" for op, n in report.onnxruntime_ops.items())
        console.print(
            f"[yellow]needs ONNX Runtime[/]: the model holds ops that only ONNX Runtime runs "
            f"at opset {report.opset} ({ops}); other runtimes and the ONNX checker reject "
            "them: --target onnx writes standard ops only"
        )
    _render_checker(report.checker, console)
    for note in [*report.notes, *report.fusions.notes]:
        console.print(f"[yellow]note[/]: {note}")


def _render_rollback(rollback: Outcome, console: Console) -> None:
    """One line per rewrite undone after the passes, and how many models it took to find; or
    why none was, where the model with no rewrite fails too."""
    if rollback.unexplained:
        console.print(
            "[red]no rewrite is to blame[/]: the optimized model fails its check "
            f"({rollback.unexplained.message}), and so does the model built with no rewrite "
            f"of normexport's ({rollback.checks} models checked); it is published as the "
            "passes made it"
        )
        return
    console.print(
        f"[yellow]rolled back[/] {len(rollback.undone)} rewrite(s) that the ONNX checker or "
        "ONNX Runtime rejected or that changed the function; the model is published without "
        f"them ({rollback.checks} models checked):"
    )
    for u in rollback.undone:
        console.print(
            f"  {u.rewrite.kind} at {u.rewrite.node!r} ({u.rewrite.became}): {u.rejection.code}"
        )


def _render_fusions(fusions: Fusions, norm: NormOps, console: Console) -> None:
    """Counts per kind, norm ops before -> after, and the candidates left alone."""
    table = Table(title="Fusions", title_justify="left")
    table.add_column("kind")
    table.add_column("count", justify="right")
    for kind, count in fusions.counts.items():
        table.add_row(kind, str(count))
    for op in sorted(set(norm.before) | set(norm.after)):
        table.add_row(f"{op} nodes", f"{norm.before.get(op, 0)} -> {norm.after.get(op, 0)}")
    console.print(table)
    if fusions.refused:
        refused = Table(title="Left alone", title_justify="left")
        for col in ("family", "module (node)", "code", "detail"):
            refused.add_column(col, overflow="fold")
        for r in fusions.refused:
            refused.add_row(r.family, r.where, r.code, r.detail)
        console.print(refused)


def _render_autotune(tuned: AutotuneResult, console: Console) -> None:
    """Which form autotune kept, and the session setting it needs."""
    line = f"autotune on {tuned.provider}: kept [bold]{tuned.best}[/]"
    if tuned.best != tuned.default:
        ratio = tuned.ratio_to_default[tuned.best]
        line += f" ({ratio.median:.2f}x the time of {tuned.default})"
    console.print(line)
    if tuned.disabled_optimizers:
        console.print(
            "[yellow]deploy it with this ORT session setting: "
            f"disabled_optimizers={list(tuned.disabled_optimizers)}[/] (ORT's own fusion would "
            "undo the faster form)"
        )


def _render_precision(precision: PrecisionReport, console: Console) -> None:
    """The half-precision conversion: converter, norms with float32 statistics, what stayed
    float32 and why."""
    half = "bfloat16" if precision.precision == "bf16" else "float16"
    io = "float32" if precision.keep_io_types else half
    console.print(
        f"precision [bold]{precision.precision}[/] by {precision.converter} (inputs/outputs "
        f"{io}); {len(precision.stash_float32)} fused norm(s) compute statistics in float32"
    )
    if precision.float32_op_types:
        console.print(
            f"no {half} kernel on this provider, kept float32: "
            + ", ".join(precision.float32_op_types)
        )
    if precision.kept_float32:
        console.print(_kept_table("Kept in float32", precision.kept_float32))


def _kept_table(title: str, kept) -> Table:
    """The nodes a conversion kept in a wider type: node, op, reason, detail."""
    table = Table(title=title, title_justify="left")
    for col in ("node", "op", "reason", "detail"):
        table.add_column(col, overflow="fold")
    for k in kept:
        table.add_row(k.node, k.op, k.reason, k.detail)
    return table


def _render_int8(int8: Int8Report, console: Console) -> None:
    """The int8 stage: the quantizer, the calibration, what stayed float and why, and what
    was published."""
    line = f"precision [bold]{int8.precision}[/] by {int8.quantizer}"
    if int8.calibration:
        line += f", calibrated on {int8.calibration}"
    console.print(line)
    if int8.kept_float:
        console.print(_kept_table("Kept in float", int8.kept_float))
    if int8.why_float32:
        console.print(f"[yellow]float32 published[/]: {int8.why_float32}")


def render(report: Report, console: Console) -> None:
    """Print ``report`` (from :func:`normexport.pipeline.run`) as tables."""
    _render_header(report, console)
    _render_fusions(report.fusions, report.norm_ops, console)
    if report.rollback:
        _render_rollback(report.rollback, console)
    if report.precision and hasattr(report.precision, "published"):
        _render_int8(report.precision, console)
    elif report.precision:
        _render_precision(report.precision, console)
    _render_parity(report.parity, console)
    _render_export(report, console)
    console.print(f"provider: [bold]{report.provider}[/]")
    if report.provider_note:
        console.print(f"[yellow]{report.provider_note}[/]")
    if report.cuda_fallbacks is not None:
        console.print(_cuda_note(report.cuda_fallbacks))
    if report.latency and report.latency.timings:
        render_latency(report.latency, console)
    elif report.latency and report.latency.apart:
        console.print(f"[yellow]note[/]: {report.latency.apart}")
    if report.speed:
        render_speed(report.speed, console)
    if report.autotune:
        _render_autotune(report.autotune, console)
    if report.cost:
        console.print(_cost(report.cost))
    console.print(_verdict(report.parity))


#: The smallest weights (bytes) the peak memory is given as a multiple of.
WEIGHTS_SHOWN = 2**26


def _cost(cost: Cost) -> str:
    """One line: the run's time, and its peak memory against the weights, with the stage."""
    line = f"the run took {sum(s.wall_s for s in cost.stages):.1f} s"
    if cost.process_s is not None:
        line += f" ({cost.process_s:.1f} s since the process started, imports included)"
    peak = cost.peak_rss_bytes
    if peak is not None:
        where = max(cost.stages, key=lambda s: s.peak_rss_bytes or 0).name
        line += f", peak memory {peak / 2**30:.2f} GiB (during the {where} stage)"
        if (
            cost.weight_bytes >= WEIGHTS_SHOWN
        ):  # beside the interpreter's own, small ones say little
            weights = cost.weight_bytes
            line += f", {peak / weights:.2f}x the weights' {weights / 2**30:.2f} GiB"
    return line


def _verdict(parity: ParityResult) -> str:
    """The last line: passed, passed with warnings, or what failed."""
    failed = [
        what
        for what, found in (
            ("the optimized model diverges", parity.failures()),
            ("the export differs from the model", parity.export_failures()),
            ("--strict: noise ratio above the factor", parity.strict and parity.warnings()),
            ("it runs otherwise as deployed", parity.deployed and not parity.deployed.passed),
        )
        if found
    ]
    if failed:
        return f"[red]parity FAILED[/] ({'; '.join(failed)})"
    if parity.warnings():
        return f"[yellow]parity passed, with {len(parity.warnings())} warning(s)[/]"
    return "[green]parity passed[/]"
