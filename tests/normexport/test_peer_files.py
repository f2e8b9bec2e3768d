"""The main job, through the API, on files made by others: every ONNX file of ONNX Runtime's
fusion tests (``tests/data/ort/``, :mod:`tests.support.peer`) and the Optimum LLaMA decoder
with its KV cache (``../shared/field/``, where it is beside the checkout), each optimized once,
from another folder, the output written elsewhere, CPU provider, no timing.

Every rewrite normexport makes there is exact: each file passes parity against its own graph
in float64 (the optimized model and the file as written both run by ONNX Runtime with its
graph optimizations off) with no noise-ratio warning and nothing rolled back, and the written
model loads. A file ONNX Runtime cannot run as given is refused, with the reason, as
:data:`tests.support.peer.UNRUNNABLE` names it. What each fusion became, case by case against
ONNX Runtime's own expectations, is tested in ``tests/fusion/test_peer_ort.py``; the command's
exit codes and lines on a few of these files in ``test_peer_cli.py``.
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

import normexport
from normexport.errors import UsageError
from tests.support.peer import FILES, UNRUNNABLE

pytestmark = pytest.mark.slow  # about 50 pipeline runs

FIELD = Path(__file__).resolve().parents[2].parent / "shared/field/optimum-llama-with-past"
#: A prefill of 8 tokens, batch 2, no past, for the field decoder.
FIELD_SHAPES = [
    "input_ids=2x8:int64",
    "attention_mask=2x8:int64",
    "position_ids=2x8:int64",
    *(f"past_key_values.{i}.{kv}=2x2x0x32" for i in (0, 1) for kv in ("key", "value")),
]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_peer_file_passes_with_no_warning(path, tmp_path, out_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # another folder than the model's
    run = {"output": out_dir / "m.onnx", "benchmark": False, "provider": "cpu"}
    if path.name in UNRUNNABLE:
        ours, theirs = UNRUNNABLE[path.name]
        with pytest.raises(UsageError, match=ours) as refused:
            normexport.optimize(path, **run)
        assert theirs in str(refused.value)
        assert not run["output"].exists()
        return
    report = normexport.optimize(path, **run)
    parity = report.parity
    assert parity.passed, parity.failures()[:3]
    assert not parity.warnings(), parity.warnings()[:3]
    assert report.rollback is None and parity.export_failures() == []
    result = report.to_dict()["parity"]
    assert result["reference"] == "onnx"
    # every file's oracle is float64 on ONNX Runtime, its Convs by their float64 form (the
    # BatchNorm in training mode and the negative Unsqueeze axes onnx.reference refused too)
    assert result["oracle"] == "onnx_float64", result["oracle_notes"]
    assert result["oracle_float32"] == [], result["oracle_float32"]
    assert all(e["raw_max_abs_err"] is not None for e in result["outputs"].values())
    checker = report.to_dict()["checker"]
    assert checker["output"] != "none" or checker["input"] == "none"
    session = ort.InferenceSession(str(run["output"]), providers=["CPUExecutionProvider"])
    assert session.get_outputs()  # the written model loads, with ORT's optimizations on too


def test_the_field_decoder_passes_with_no_warning(tmp_path, out_dir, monkeypatch):
    path = FIELD / "model.onnx"
    if not path.exists():
        pytest.skip(f"{path} is missing: ../shared/ is not beside this checkout")
    monkeypatch.chdir(tmp_path)
    report = normexport.optimize(
        path, input_shape=FIELD_SHAPES, output=out_dir / "m.onnx", benchmark=False, provider="cpu"
    )
    assert report.parity.passed, report.parity.failures()[:3]
    assert not report.parity.warnings(), report.parity.warnings()[:3]
    assert report.rollback is None and report.parity.export_failures() == []
