"""The report: a table on the terminal, JSON on request, and a latency chart (PNG)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fusion import FUSION_KINDS
from normexport.files import atomic_path, save_figure


def _render_checker(checker: dict, console: Console) -> None:
    """One line when the input already fails the ONNX checker (old exporters' files)."""
    if checker["input"] == "full":
        return
    which = "full check" if checker["input"] == "basic" else "check"
    line = f"[yellow]the input fails the ONNX checker's {which}[/] ({checker['input_problem']})"
    if checker["input"] == "basic":
        line += "; the output was checked as far as the input passes (no shape inference)"
    elif checker["output"] == "full":
        line += "; the output passes it"
    else:
        line += f"; so does the output ({checker['output_problem']})"
    console.print(line + "; ONNX Runtime loads and runs both")


def render(report: dict, console: Console) -> None:
    """Print ``report`` (from :func:`normexport.pipeline.run`) as tables."""
    console.print(
        f"[bold]{report['model']}[/] ({report['kind'].replace('_', ' ')}, exporter "
        f"{report['exporter']}, opset {report['opset']}, target {report['target']}) -> "
        f"[bold]{report['output']}[/]"
    )
    if report["external_data"]:
        console.print(f"external data: {report['files_written'][1]} (the output's own)")
    _render_checker(report["checker"], console)
    for note in report.get("notes", []):
        console.print(f"[yellow]note[/]: {note}")
    fusions = report["fusions"]
    for note in fusions.get("notes", []):
        console.print(f"[yellow]note[/]: {note}")
    table = Table(title="Fusions", title_justify="left")
    table.add_column("kind")
    table.add_column("count", justify="right")
    for kind in FUSION_KINDS:
        table.add_row(kind, str(fusions[kind]))
    norm = report["norm_ops"]
    for op in sorted(set(norm["before"]) | set(norm["after"])):
        table.add_row(f"{op} nodes", f"{norm['before'].get(op, 0)} -> {norm['after'].get(op, 0)}")
    console.print(table)
    if fusions["refused"]:
        refused = Table(title="Left alone", title_justify="left")
        for col in ("kind", "node", "reason"):
            refused.add_column(col, overflow="fold")
        for r in fusions["refused"]:
            refused.add_row(r["kind"], r["node"], r["reason"])
        console.print(refused)

    parity = report["parity"]
    table = Table(
        title=f"Parity vs {parity['reference']} (atol {parity['atol']:g}, rtol "
        f"{parity['rtol']:g}; inputs: {', '.join(parity['probes'])})",
        title_justify="left",
    )
    for col in ("output", "max abs err", "rel L2 err", "max |ref|", "verdict"):
        table.add_column(col, justify="right" if col != "output" else "left")
    for name, e in parity["outputs"].items():
        table.add_row(
            name,
            f"{e['max_abs_err']:.3g}",
            f"{e['rel_l2_err']:.3g}",
            f"{e['max_abs_ref']:.3g}",
            "[green]pass[/]" if e["passed"] else "[red]FAIL[/]",
        )
    console.print(table)
    for f in parity["failures"][:10]:
        console.print(
            f"[red]diverges[/]: output {f['output']!r} on input set {f['probe']!r}: max abs err "
            f"{f['max_abs_err']:.3g}, rel L2 {f['rel_l2_err']:.3g}, "
            f"{f['nonfinite_mismatch']} NaN/Inf where the reference is finite"
        )

    console.print(f"provider: [bold]{report['provider']}[/]")
    if report["provider_note"]:
        console.print(f"[yellow]{report['provider_note']}[/]")
    latency = report["latency_ms"]
    if latency:
        table = Table(
            title="Latency (ms per call; interleaved, ORT thread spinning off)",
            title_justify="left",
        )
        for col in ("variant", "median", "p90", "runs", "÷ optimized"):
            table.add_column(col, justify="right" if col != "variant" else "left")
        opt = latency["ort_optimized"]["median_ms"]
        for name, t in latency.items():
            table.add_row(
                name,
                f"{t['median_ms']:.3f}",
                f"{t['p90_ms']:.3f}",
                str(t["runs"]),
                f"{t['median_ms'] / opt:.2f}x",
            )
        console.print(table)
    tuned = report.get("autotune")
    if tuned:
        line = f"autotune on {tuned['provider']}: kept [bold]{tuned['best']}[/]"
        if tuned["best"] != tuned["default"]:
            ratio = tuned["ratio_to_default"][tuned["best"]]
            line += f" ({ratio['median']:.2f}x the time of {tuned['default']})"
        console.print(line)
        if tuned["disabled_optimizers"]:
            console.print(
                "[yellow]deploy it with this ORT session setting: "
                f"disabled_optimizers={tuned['disabled_optimizers']}[/] (ORT's own fusion would "
                "undo the faster form)"
            )
    verdict = "[green]parity passed[/]" if parity["passed"] else "[red]parity FAILED[/]"
    console.print(verdict)


def write_json(report: dict, path: Path) -> None:
    """Write ``report`` as JSON, atomically (temporary file in the same folder, then rename)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(report, indent=2))


def write_chart(report: dict, path: Path) -> bool:
    """Bar chart of median latency (p90 as error bar) per variant, as PNG.

    Returns:
        False (and writes nothing) when the report has no latency.
    """
    latency = report["latency_ms"]
    if not latency:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(latency)
    med = [latency[n]["median_ms"] for n in names]
    p90 = [latency[n]["p90_ms"] - latency[n]["median_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(names, med, xerr=[[0] * len(names), p90], color=["#999", "#69c", "#2a6"][-len(names) :])
    ax.set_xlabel(f"ms per call, median (bar) and p90 (whisker), {report['provider']}")
    ax.set_title(Path(report["model"]).name)
    fig.tight_layout()
    save_figure(fig, path)
    return True
