"""``--precision fp16`` over the gallery: every float32 entry, exported by its first exporter
(dynamo where it exports), through :func:`normexport.optimize` with ``precision="fp16"``.

Each must pass the half-precision parity rule against PyTorch in float64 on the random sets, the
eps probes and the overflow probe (inputs with outliers of about 1e3, whose squares pass
float16's range), with no NaN / Inf; a norm the fusions refuse (a look-alike) must stay float32
(``decomposed_norm``), and a fused LayerNorm / RMSNorm must compute its statistics in float32.
``benchmarks/precision_sweep.py`` runs the same over both exporters and the demo models.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import normexport
from fusion.registry import DECOMPOSED_FAMILIES
from models.norms import FUSED, GALLERY, Entry
from normexport import precision

pytestmark = pytest.mark.slow  # exports every float32 gallery entry

CASES = [pytest.param(entry, id=entry.name) for entry in GALLERY if entry.dtype == torch.float32]


@pytest.mark.parametrize("entry", CASES)
def test_gallery_entry_in_float16(entry: Entry, tmp_path):
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(io.StringIO()):
        report = normexport.optimize(
            entry.build(),
            output=tmp_path / "m.onnx",
            input_shape=[",".join(map(str, entry.shape))],
            exporter=entry.exporters[0],
            precision="fp16",
            benchmark=False,
            provider="cpu",
        ).to_dict()
    parity = report["parity"]
    assert parity["passed"], parity["failures"]
    (probe,) = parity["sets"][precision.OVERFLOW_PROBE]
    assert probe["nonfinite_mismatch"] == 0 and probe["max_abs_ref"] > 0
    kept = {k["reason"] for k in report["precision"]["kept_float32"]}
    if entry.expect is None and entry.family in DECOMPOSED_FAMILIES:
        assert "decomposed_norm" in kept, report["precision"]
    if entry.expect == FUSED and entry.family in ("layernorm", "rmsnorm"):
        assert report["precision"]["stash_float32"], report["precision"]
