"""The report: a table on the terminal, JSON on request, and a latency chart (PNG)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fusion import FUSION_KINDS
from normexport.files import atomic_path, save_figure
from normexport.latency import BUSY_SPREAD


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


def _err(value) -> str:
    return "-" if value is None else f"{value:.3g}"


#: Above this many outputs the terminal shows each output's worst input set only.
ROWS_PER_SET_UP_TO = 4


def _render_parity(parity: dict, console: Console) -> None:
    """Errors against the oracle, per output and input set, with the verdict."""
    oracle = parity.get("oracle", parity["reference"])
    factor = parity.get("noise_factor")
    rule = f"atol {parity['atol']:g}, rtol {parity['rtol']:g}"
    if factor is not None:
        rule += f", noise factor {factor:g} x raw export"
    table = Table(
        title=f"Parity: error vs {oracle} ({rule}; inputs: {', '.join(parity['probes'])})",
        title_justify="left",
    )
    cols = ("output", "input set", "optimized", "raw export", "pytorch f32", "max |oracle|", "")
    for col in cols:
        table.add_column(col, justify="left" if col in ("output", "input set") else "right")
    sets = parity.get("sets") or {}
    if sets and len(parity["outputs"]) <= ROWS_PER_SET_UP_TO:
        rows = [
            (p, e)
            for name in parity["outputs"]
            for p, es in sets.items()
            for e in es
            if e["output"] == name
        ]
    else:
        rows = [(_worst_set(parity, name, e), e) for name, e in parity["outputs"].items()]
    for probe, e in rows:
        verdict = "[green]pass[/]" if e["passed"] else "[red]FAIL[/]"
        if e.get("weak"):
            verdict += " [yellow](weak)[/]"
        table.add_row(
            e["output"],
            probe,
            _err(e["max_abs_err"]),
            _err(e.get("raw_max_abs_err")),
            _err(e.get("pytorch_max_abs_err")),
            _err(e["max_abs_ref"]),
            verdict,
        )
    console.print(table)
    for note in parity.get("oracle_notes", []):
        console.print(f"[yellow]note[/]: {note}")
    weak: dict[str, list[str]] = {}
    for w in parity.get("weak_checks", []):
        weak.setdefault(w["output"], []).append(w["probe"])
    for name, probes in weak.items():
        every = len(probes) == len(parity["probes"])
        console.print(
            f"[yellow]weak check[/]: output {name!r}'s reference is constant (within atol) on "
            + (
                "[bold]every input set[/]: parity says little about it"
                if every
                else ", ".join(probes)
            )
        )
    for f in parity["failures"][:10]:
        console.print(
            f"[red]diverges[/]: output {f['output']!r} on input set {f['probe']!r}: max abs err "
            f"{f['max_abs_err']:.3g} (raw export {_err(f.get('raw_max_abs_err'))}), rel L2 "
            f"{f['rel_l2_err']:.3g}, {f['nonfinite_mismatch']} NaN/Inf where the reference is "
            "finite"
        )


def _worst_set(parity: dict, name: str, worst: dict) -> str:
    for probe, errors in (parity.get("sets") or {}).items():
        if any(e == worst for e in errors if e["output"] == name):
            return probe
    return "(worst)"


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
        for col in ("kind", "node", "code", "detail"):
            refused.add_column(col, overflow="fold")
        for r in fusions["refused"]:
            refused.add_row(r["kind"], r["node"], r["code"], r["detail"])
        console.print(refused)

    _render_parity(report["parity"], console)

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
        cond = report.get("latency_conditions")
        if cond:
            console.print(
                f"threads: PyTorch {cond['pytorch_threads']}, ONNX Runtime "
                f"{cond['onnxruntime_threads']} (intra-op; inter-op 1)"
            )
            if cond["busy"]:
                console.print(
                    f"[yellow]the machine was busy[/]: p90 over {BUSY_SPREAD:g}x the median for "
                    f"{', '.join(cond['busy'])}; compare these numbers with care, or re-run"
                )
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
    verdict = "[green]parity passed[/]" if report["parity"]["passed"] else "[red]parity FAILED[/]"
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
