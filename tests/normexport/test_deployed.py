"""The published model judged as deployed (docs/parity.md#judged-as-deployed): for each known
ONNX Runtime LayerNorm-fusion bug (tests.support.ort_bugs), the published output runs in ONNX
Runtime's default session (ORT_ENABLE_ALL) as the oracle does, and the verdict fails (exit 1)
a published model whose deployed outputs differ."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import fusion
from normexport import cli
from tests.support.graphs import cpu_session, run
from tests.support.ort_bugs import GRAPHS, feeds


def _normexport(tmp_path, issue: str) -> tuple[int, dict]:
    """Run the CLI on the graph of ``issue``; its exit code and the report's ``parity``."""
    ir.save(GRAPHS[issue](), tmp_path / "in.onnx")
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    code = cli.main(
        [str(tmp_path / "in.onnx"), "-o", str(out), "--no-benchmark"]
        + ["--provider", "cpu", "--report", str(report)]
    )
    return code, json.loads(report.read_text())["parity"]


def _as_deployed(path, x) -> np.ndarray | str:
    try:
        return cpu_session(path).run(None, x)[0]
    except Exception as err:  # ORT's own error types
        return str(err)


@pytest.mark.parametrize("issue", sorted(GRAPHS))
def test_the_published_output_runs_alike_as_deployed(tmp_path, issue):
    model = GRAPHS[issue]()
    x = feeds(model, seed=3)
    (written,) = run(model, x)
    bug = _as_deployed(model, x)
    if not isinstance(bug, str) and np.allclose(bug, written, atol=1e-5):
        pytest.skip(f"{issue} is fixed in onnxruntime {ort.__version__}")
    code, parity = _normexport(tmp_path, issue)
    assert code == 0 and parity["passed"] and parity["deployed"]["passed"], parity["deployed"]
    deployed = _as_deployed(tmp_path / "out.onnx", x)
    assert not isinstance(deployed, str), deployed
    np.testing.assert_allclose(deployed, written, atol=1e-5, rtol=1e-5)
    if issue == "onnxruntime#30513":  # normexport's passes leave it alone: repaired for ORT
        assert parity["deployed"]["found"] and issue in parity["deployed"]["repairs"]


# onnxruntime#31147's graph fails to load under ORT_ENABLE_ALL: published as written, the
# optimize stage's own check (rollback.verify's load_check) stops the run before the verdict.
@pytest.mark.parametrize("issue", ["onnxruntime#30513", "onnxruntime#31980"])
def test_the_verdict_fails_a_model_that_runs_otherwise_as_deployed(tmp_path, issue, monkeypatch):
    model = GRAPHS[issue]()
    bug = _as_deployed(model, feeds(model))
    if not isinstance(bug, str) and np.allclose(bug, run(model, feeds(model))[0], atol=1e-5):
        pytest.skip(f"{issue} is fixed in onnxruntime {ort.__version__}")
    # published as written (no pass rewrites it), and not repaired for ONNX Runtime
    monkeypatch.setattr(fusion, "optimize", lambda *a, **k: fusion.FusionReport())
    monkeypatch.setattr("normexport.pipeline.published.avoid_ort_misfusions", lambda m: {})
    code, parity = _normexport(tmp_path, issue)
    assert code == 1 and not parity["passed"]
    assert not parity["deployed"]["passed"] and parity["deployed"]["found"] is None
    assert not parity["failures"]  # as written, it passes
