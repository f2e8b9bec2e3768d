"""The report's files: the JSON (:func:`write_json`) and the latency chart (:func:`write_chart`).

The chart is drawn on a :class:`matplotlib.figure.Figure` of its own, not one of pyplot's:
no matplotlib backend is chosen or switched, the caller's is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

from normexport.io.files import atomic_path, save_figure
from normexport.report.schema import Report


def write_json(report: Report | dict, path: Path) -> None:
    """Write ``report`` (a :class:`Report`, or any JSON-ready dict) as JSON, atomically
    (temporary file in the same folder, then rename)."""
    data = report.to_dict() if isinstance(report, Report) else report
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2))


def write_chart(report: Report, path: Path) -> bool:
    """The latency chart of ``report`` as PNG at ``path`` (:func:`chart`).

    Returns:
        False (and writes nothing) when the report has no latency.
    """
    figure = chart(report)
    if figure is None:
        return False
    save_figure(figure, path)
    return True


def chart(report: Report):
    """The latency chart, a :class:`matplotlib.figure.Figure`: ONNX Runtime's raw and optimized
    models in a panel of their own (their scale is theirs, not PyTorch eager's, which can be
    ten times slower), PyTorch eager beside it where it was timed; median ms per call as the
    bar, p90 as the whisker, the median written on each bar. None where nothing was timed."""
    if not report.latency or not report.latency.timings:
        return None
    from matplotlib.figure import Figure  # not pyplot's: the backend is left alone

    latency = {k: t.to_dict() for k, t in report.latency.timings.items()}
    ort = [n for n in latency if n.startswith("ort_")]
    groups = [g for g in (ort, [n for n in latency if n not in ort]) if g]
    figure = Figure(figsize=(7, 1.2 + 0.5 * len(latency)))
    axes = figure.subplots(1, len(groups), squeeze=False)[0]
    colors = {"ort_raw": "#999", "ort_optimized": "#2a6"}
    for ax, names in zip(axes, groups, strict=True):
        med = [latency[n]["median_ms"] for n in names]
        p90 = [latency[n]["p90_ms"] - latency[n]["median_ms"] for n in names]
        bars = ax.barh(
            names, med, xerr=[[0] * len(names), p90], color=[colors.get(n, "#69c") for n in names]
        )
        ax.bar_label(bars, labels=[f"{m:.3g} ms" for m in med], label_type="center", color="w")
        ax.set_xlabel("ms per call (median; p90 whisker)")
    figure.suptitle(f"{Path(report.model).name}, {report.provider}")
    figure.tight_layout()
    return figure
