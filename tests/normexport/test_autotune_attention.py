"""``--autotune``'s candidate without attention fusion, on one BERT layer exported by PyTorch:
offered beside the fused model, and exact."""

import pytest

import fusion
from normexport.io.files import save_model
from normexport.tuning import autotune
from tests.support.encoders import TinyBert, export_tiny_bert, tiny_bert_feeds

pytestmark = pytest.mark.slow


def test_autotune_offers_attention_unfused_and_it_is_exact(tmp_path):
    module = TinyBert()
    fused, unfused = export_tiny_bert(module), export_tiny_bert(module)
    fusion.optimize(fused, target="ort")
    fusion.optimize(unfused, target="ort", attention=False)
    paths = {"fused": tmp_path / "fused.onnx", "unfused": tmp_path / "unfused.onnx"}
    save_model(fused, paths["fused"], external_data=True)
    save_model(unfused, paths["unfused"], external_data=True)
    cands = autotune.candidates(paths["fused"], attention_unfused=paths["unfused"])
    assert list(cands)[0] == "as_built"  # the default stays the fused model
    assert autotune.ATTENTION_UNFUSED in cands
    result = autotune.autotune(cands, tiny_bert_feeds(), budget_s=0.3)
    assert result.rejected == {}  # the unfused forms agree with the fused one
    assert set(result.timings) == set(cands)
