"""``--autotune``'s candidate without attention fusion, on one BERT layer exported by PyTorch:
offered beside the fused model, and exact."""

import pytest

import fusion
from normexport.io.files import save_model
from normexport.tuning import autotune
from tests.fusion.test_fuse_attention import TinyBert, _export, _inputs

pytestmark = pytest.mark.slow


def test_autotune_offers_attention_unfused_and_it_is_exact(tmp_path):
    module = TinyBert()
    fused, unfused = _export(module), _export(module)
    fusion.optimize(fused, target="ort")
    fusion.optimize(unfused, target="ort", attention=False)
    paths = {"fused": tmp_path / "fused.onnx", "unfused": tmp_path / "unfused.onnx"}
    save_model(fused, paths["fused"], external_data=True)
    save_model(unfused, paths["unfused"], external_data=True)
    cands = autotune.candidates(paths["fused"], attention_unfused=paths["unfused"])
    assert list(cands)[0] == "as_built"  # the default stays the fused model
    assert autotune.ATTENTION_UNFUSED in cands
    result = autotune.autotune(cands, _inputs(), budget_s=0.3)
    assert result.rejected == {}  # the unfused forms agree with the fused one
    assert set(result.timings) == set(cands)
