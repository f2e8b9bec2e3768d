"""FoldBatchNorm run on a model, for its graph-level tests and its export tests."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion.base import FusionReport
from fusion.fold_batchnorm import FoldBatchNorm
from tests.support.graphs import assert_close


def fold(model: ir.Model) -> tuple[FusionReport, bool]:
    """Run :class:`FoldBatchNorm` on ``model`` in place: its outcomes, and whether it changed
    the model."""
    fusion_pass = FoldBatchNorm()
    modified = fusion_pass(model).modified
    return fusion_pass.outcomes, modified


def assert_close_folded(actual: np.ndarray, expected: np.ndarray) -> None:
    """``max |actual - expected| <= 1e-4 + 1e-4 * max |expected|``, all finite: a fold
    reassociates a product of float32 factors (:func:`tests.support.graphs.mismatch`)."""
    assert_close([actual], [expected], rtol=1e-4, atol=1e-4)


def assert_second_run_is_noop(model: ir.Model) -> None:
    """A second :func:`fold` of a folded ``model`` changes nothing, byte for byte."""
    before = ir.to_proto(model).SerializeToString()
    report, modified = fold(model)
    assert not modified
    assert report.counts["batchnorm_folded"] == 0
    assert ir.to_proto(model).SerializeToString() == before
