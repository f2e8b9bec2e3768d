"""The main job on files made by others: every ONNX file of ONNX Runtime's fusion tests
(``../shared/peer/ort/``, read in place) and the Optimum LLaMA decoder with its KV cache
(``../shared/field/``), optimized from another folder, the output written elsewhere.

Every rewrite normexport makes there is exact: each file must pass parity with no noise-ratio
warning and nothing rolled back. A file ONNX Runtime cannot run as given is refused (exit 2),
with the reason, as it is named here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import normexport
from normexport.errors import UsageError

pytestmark = pytest.mark.slow  # about 60 pipeline runs

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
PEER = sorted((SHARED / "peer" / "ort").rglob("*.onnx"))
FIELD = SHARED / "field" / "optimum-llama-with-past" / "model.onnx"

#: Files ONNX Runtime cannot run as given (see ``../shared/peer/README.md``): refused, and the
#: words that say why (``layer_norm.onnx``, whose axes are all named ``None``, runs at the sizes
#: normexport picks).
REFUSED = {
    "fuse-matmul-bn-directly-dont-fuse.onnx": "cannot run this model as given",
    "fuse-matmul-bn-only-reshape.onnx": "cannot run this model as given",
    "fuse-matmul-bn-only-transpose.onnx": "cannot run this model as given",
    "fuse-conv-bn-no-bias.bn_empty_opt_output.onnx": "cannot load this model",
    "fuse-matmul-bn-with-reshape.bn_empty_opt_output.onnx": "cannot load this model",
}
#: A prefill of 8 tokens, batch 2, no past, for the field decoder.
FIELD_SHAPES = [
    "input_ids=2x8:int64",
    "attention_mask=2x8:int64",
    "position_ids=2x8:int64",
    *(f"past_key_values.{i}.{kv}=2x2x0x32" for i in (0, 1) for kv in ("key", "value")),
]


@pytest.mark.parametrize("path", [*PEER, FIELD], ids=lambda p: p.name if p in PEER else "field")
def test_files_made_by_others_pass_with_no_warning(path, tmp_path, out_dir, monkeypatch):
    if not path.exists():
        pytest.skip(f"{path} is missing: ../shared/ is not beside this checkout")
    monkeypatch.chdir(tmp_path)  # another folder than the model's
    shapes = FIELD_SHAPES if path == FIELD else []
    run = {"output": out_dir / "m.onnx", "benchmark": False, "provider": "cpu"}
    if path.name in REFUSED:
        with pytest.raises(UsageError, match=REFUSED[path.name]):
            normexport.optimize(path, input_shape=shapes, **run)
        return
    report = normexport.optimize(path, input_shape=shapes, **run)
    parity = report.parity
    assert parity.passed, parity.failures()[:3]
    assert not parity.warnings(), parity.warnings()[:3]
    assert report.rollback is None and parity.export_failures() == []
