"""The main job as a list of stages: plan the outputs, prepare (load, example inputs, export),
take the raw model and run the references, optimize and check, autotune, convert to half
precision, latency (with the latency verdict), publish, parity, report (docs/architecture.md;
the report: docs/report.md).

Each stage lives in the module named for what it holds (:mod:`~normexport.pipeline.prepare`:
load and export; :mod:`~normexport.pipeline.raw_model`: the raw model on file;
:mod:`~normexport.pipeline.rewrite`: optimize, autotune, half precision;
:mod:`~normexport.pipeline.timing`: latency and its verdict;
:mod:`~normexport.pipeline.published`: parity of the published output) and takes what it needs:
the run's fixed facts (:class:`~normexport.pipeline.job.Job`), the raw model
(:class:`~normexport.pipeline.raw_model.RawModel`), the staged output
(:class:`~normexport.pipeline.rewrite.Staged`, a new one from each stage that changes it) and
the parity judge (:class:`normexport.verdict.references.Judge`).
"""

from __future__ import annotations

from normexport.arguments import Options, plan_outputs
from normexport.pipeline.prepare import Prepared, prepare
from normexport.pipeline.stages import run
from normexport.report import Report

__all__ = ["Options", "Prepared", "Report", "plan_outputs", "prepare", "run"]
