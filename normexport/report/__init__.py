"""The report: typed (:class:`Report`, whose :meth:`Report.to_dict` is the JSON), a table on
the terminal, JSON on request, and a latency chart (PNG).

- :mod:`normexport.report.schema`: :class:`Report` and its parts;
- :mod:`normexport.report.terminal`: :func:`render`, the tables printed with rich (the latency
  table and the latency verdict's lines from :mod:`normexport.report.timed`);
- :mod:`normexport.report.save`: :func:`write_json` and :func:`write_chart`;
- :mod:`normexport.report.explain`: ``normexport explain``.

The names below are importable from the package itself. The JSON schema, key by key with types
and units, is in ``docs/report.md``.
"""

from normexport.report.save import write_chart, write_json
from normexport.report.schema import (
    Checker,
    Cost,
    Fusions,
    InputInfo,
    Latency,
    NormOps,
    Report,
    Versions,
)
from normexport.report.terminal import render

__all__ = [
    "Checker",
    "Cost",
    "Fusions",
    "InputInfo",
    "Latency",
    "NormOps",
    "Report",
    "Versions",
    "render",
    "write_chart",
    "write_json",
]
