"""A :class:`~normexport.bench.results.BenchResult` shown: tables on the terminal, and a
latency chart drawn on a :class:`matplotlib.figure.Figure` of its own (the caller's pyplot
state and backend are left alone)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from normexport.bench.results import BenchResult, Point
from normexport.bench.variants import REFERENCE_VARIANT
from normexport.io.files import save_figure
from normexport.latency.measure import Ratio


def fmt_ratio(ratio: Ratio | Mapping[str, float] | None) -> str:
    """``"1.23x [1.10, 1.40]"``: a paired ratio and its 95% interval, from a
    :class:`~normexport.latency.measure.Ratio` or its JSON form (as the benchmarks read it
    back); ``"-"`` for none."""
    if not ratio:
        return "-"
    r = ratio.to_dict() if isinstance(ratio, Ratio) else ratio
    return f"{r['median']:.2f}x [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def render(result: BenchResult, console: Console) -> None:
    """Print what each variant is, one table per point, then the floor."""
    m = result.machine
    where = m.gpu or f"{m.cpu}, {m.cpu_cores_visible} cores"
    opts = result.options
    console.print(
        f"[bold]{result.model or ''}[/] on [bold]{result.provider}[/] ({where}); "
        f"io_binding={opts.io_binding}, cuda_graph={opts.cuda_graph}"
    )
    for name, v in result.variants.items():
        if v.variant.model is None:
            console.print(f"[red]{name} not built[/]: {v.variant.error}")
            continue
        ops = ", ".join(f"{k} {n}" for k, n in v.variant.norm_ops.items()) or "no norm ops"
        ran = v.ran_norm_ops
        ran = "?" if ran is None else ", ".join(f"{k} {n}" for k, n in ran.items()) or "none"
        console.print(
            f"  {name}: {v.variant.nodes} nodes, {ops}; the norm ops ONNX Runtime ran after its "
            f"own session optimizations: {ran}"
        )
    for point in result.points:
        if point.timings:
            console.print(_point_table(point))
        else:  # no empty table: nothing ran at this size, the errors below say why
            sizes = ", ".join(f"{k} {v}" for k, v in point.inputs.items())
            console.print(f"[red]{sizes}: nothing ran[/]")
        for name, err in point.errors.items():
            console.print(f"[red]{name}[/]: {err}")
    floor = result.floor
    if result.floor_error:
        console.print(f"[red]floor not measured[/]: {result.floor_error}")
    elif floor:
        console.print(
            f"floor: {floor.op} over {floor.shape} takes "
            f"{floor.norm.median_ms:.3f} ms, one Relu over it "
            f"{floor.elementwise.median_ms:.3f} ms: "
            f"{fmt_ratio(floor.norm_over_floor)} the memory-bound floor"
        )


def _point_table(point: Point) -> Table:
    """Each variant's timing at one point, with its ratios and its distance to the
    reference."""
    title = ", ".join(f"{k} {v}" for k, v in point.inputs.items())
    table = Table(
        title=f"{title}: ms per call (median [95% CI], p90, min-max); ratios > 1: slower",
        title_justify="left",
    )
    cols = ("variant", "median", "p90", "min-max", "÷ normexport", "÷ eager", "max |Δ|")
    for col in cols:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, t in point.timings.items():
        diff = point.max_abs_diff.get(name)
        table.add_row(
            name,
            f"{t.median_ms:.3f} [{t.ci_low_ms:.3f}, {t.ci_high_ms:.3f}]",
            f"{t.p90_ms:.3f}",
            f"{t.min_ms:.3f}-{t.max_ms:.3f}",
            fmt_ratio(point.ratio_to_normexport.get(name)),
            fmt_ratio(point.ratio_to_eager.get(name)),
            "-" if diff is None else f"{diff:.2g}",
        )
    return table


def _size(point: Point, axis: int) -> int:
    """The point's batch (axis 0) or sequence length (axis 1) as run."""
    return next(s[axis] for s in point.inputs.values() if len(s) > axis)


def _panels(points: list[Point]) -> list[tuple[str, list[Point], str]]:
    """(x axis, points, title suffix) per panel: against batch, one per sequence length that
    has two batches or more (or the only one); against sequence length, one per batch that
    has two lengths or more."""
    panels = []
    seqs = list(dict.fromkeys(p.seq for p in points))
    for seq in seqs:
        pts = [p for p in points if p.seq == seq]
        if len(pts) > 1 or len(seqs) == 1:
            panels.append(("batch", pts, f", seq {seq}" if seq else ""))
    for batch in dict.fromkeys(p.batch for p in points):
        pts = [p for p in points if p.batch == batch]
        if len({p.seq for p in pts}) > 1:
            panels.append(("sequence", pts, f", batch {_size(pts[0], 0)}"))
    return panels


def chart(result: BenchResult) -> Figure:
    """Latency (median, 95% CI as error bars) against batch and against sequence length, one
    line per variant (panels: :func:`_panels`); log-log axes, provider in the axis label, the
    model's file name in the title.

    Returns:
        A :class:`matplotlib.figure.Figure` of its own, not one of pyplot's: no backend is
        chosen, no pyplot figure left open.
    """
    panels = _panels(result.points)
    fig = Figure(figsize=(5.5 * len(panels), 4))
    axes = fig.subplots(1, len(panels), squeeze=False)
    names = list(dict.fromkeys(k for p in result.points for k in p.timings))
    for ax, (xname, pts, suffix) in zip(axes[0], panels, strict=True):
        for name in names:
            xs, ys, lo, hi = [], [], [], []
            for p in pts:
                t = p.timings.get(name)
                if t is None:
                    continue
                xs.append(_size(p, 0 if xname == "batch" else 1))
                ys.append(t.median_ms)
                lo.append(t.median_ms - t.ci_low_ms)
                hi.append(t.ci_high_ms - t.median_ms)
            style = {"linewidth": 2.5, "color": "black"} if name == REFERENCE_VARIANT else {}
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xname)
        ax.set_ylabel(f"ms per call (median, 95% CI), {result.provider}")
        ax.set_title(Path(result.model or "").name + suffix)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def write_chart(result: BenchResult, path: Path) -> None:
    """Write :func:`chart` to ``path`` as PNG, atomically."""
    save_figure(chart(result), path)
