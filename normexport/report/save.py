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
    """Bar chart of median latency (p90 as error bar) per variant, as PNG.

    Returns:
        False (and writes nothing) when the report has no latency.
    """
    if not report.latency or not report.latency.timings:
        return False
    latency = {k: t.to_dict() for k, t in report.latency.timings.items()}
    from matplotlib.figure import Figure  # not pyplot's: the backend is left alone

    names = list(latency)
    med = [latency[n]["median_ms"] for n in names]
    p90 = [latency[n]["p90_ms"] - latency[n]["median_ms"] for n in names]
    fig = Figure(figsize=(6, 3))
    ax = fig.subplots()
    ax.barh(names, med, xerr=[[0] * len(names), p90], color=["#999", "#69c", "#2a6"][-len(names) :])
    ax.set_xlabel(f"ms per call, median (bar) and p90 (whisker), {report.provider}")
    ax.set_title(Path(report.model).name)
    fig.tight_layout()
    save_figure(fig, path)
    return True
