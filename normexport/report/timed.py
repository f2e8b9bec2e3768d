"""The timings on the terminal: the latency table and the latency verdict's lines."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from normexport.latency.measure import BUSY_SPREAD
from normexport.latency.verdict import FLOAT32_OPTIMIZED
from normexport.report.schema import Latency

if TYPE_CHECKING:
    from normexport.latency.verdict import Speed


def render_latency(latency: Latency, console: Console) -> None:
    """Median, p90 and runs per variant, as ratios to the optimized model; the threads."""
    table = Table(
        title="Latency (ms per call; ONNX models interleaved, PyTorch alone; ORT spinning off)",
        title_justify="left",
    )
    for col in ("variant", "median", "p90", "runs", "÷ optimized"):
        table.add_column(col, justify="right" if col != "variant" else "left")
    opt = latency.timings["ort_optimized"].median_ms
    for name, t in latency.timings.items():
        ratio = f"{t.median_ms / opt:.2f}x"
        table.add_row(name, f"{t.median_ms:.3f}", f"{t.p90_ms:.3f}", str(t.runs), ratio)
    console.print(table)
    console.print(
        f"threads: PyTorch {latency.pytorch_threads}, ONNX Runtime "
        f"{latency.onnxruntime_threads} (intra-op; inter-op 1)"
        + (
            f"; {latency.sessions} sessions of each model, each run once a round"
            if latency.sessions > 1
            else "; each model run twice a round"
        )
    )
    if latency.busy:
        console.print(
            f"[yellow]the machine was busy[/]: p90 over {BUSY_SPREAD:g}x the median for "
            f"{', '.join(latency.busy)}; compare these numbers with care, or re-run"
        )
    if latency.apart:
        console.print(f"[yellow]note[/]: {latency.apart}")
    past = [n for n, t in latency.timings.items() if t.bound == "min_runs"]
    if past:
        console.print(
            f"[yellow]note[/]: {', '.join(past)} timed past --budget: a round took longer than "
            "the budget held, and the fewest rounds were run"
        )


def render_speed(speed: Speed, console: Console) -> None:
    """The latency verdict in a line (and one line per rewrite undone): unchecked and why,
    kept as optimized, slower rewrites undone, or slower and kept, and why."""
    if speed.unchecked is not None:
        kept = "; published as the stages made it" if speed.as_optimized is not None else ""
        console.print(f"[yellow]speed unchecked[/]: {speed.unchecked}{kept}")
        return
    first, published = speed.as_optimized, speed.published
    if first.against == FLOAT32_OPTIMIZED:  # int8, timed against float32
        kept = "int8 published" if first.faster else "float32 published"
        console.print(f"speed: int8 at {first.message()}: {kept}")
        return
    timed = f"{speed.models_timed} model(s) timed"
    if not speed.undone and not published.slower:
        console.print(f"speed: not slower than the raw model, kept as optimized: {first.message()}")
        return
    if speed.undone:
        console.print(
            f"[yellow]slower here[/]: as optimized {first.message()}, {len(speed.again)} "
            f"timing(s) more agreed; undid {len(speed.undone)} rewrite(s) ({timed}), "
            f"published: {published.message()}; as optimized against it: "
            f"{speed.head_to_head.message()}"
        )
        for u in speed.undone:
            console.print(f"  {u.rewrite.kind} at {u.rewrite.node!r}: {u.rejection.message}")
    if published.slower:
        console.print(
            f"[red]slower than the raw model[/]: {published.message()}; published even so: "
            f"{speed.kept_slower}"
        )
