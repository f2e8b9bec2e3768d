"""fusion.unlisted (docs/fusions.md#nothing-left-unlisted): on every committed model file
(ONNX Runtime's own test models in tests/data/ort among them) optimized for each target,
what still looks like a norm, a BatchNorm or an attention is either fused or left alone with a
code; and on a model no pass ran on, the same check finds each of them unlisted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

import fusion
from tests.fusion.test_subgraphs_graphs import _if_layernorms, _loop_attention
from tests.support.graphs import make_model

ROOT = Path(__file__).parents[2]
FILES = sorted((ROOT / "tests/data").rglob("*.onnx"))


@pytest.mark.parametrize("target", fusion.TARGETS)
@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_nothing_is_left_unlisted_in_a_committed_file(path, target):
    model = ir.load(path)
    report = fusion.optimize(model, target=target)
    assert fusion.unlisted(model, report) == []


def _batchnorm() -> ir.Model:
    rng = np.random.default_rng(4)
    stats = {n: rng.random(4).astype(np.float32) + 0.5 for n in ("s", "b", "m", "v")}
    node = ("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], {})
    return make_model([node], {"x": (1, [2, 4, 3, 3])}, {"y": (1, None)}, stats)


@pytest.mark.parametrize(
    ("model", "found"),
    [
        (lambda: _if_layernorms(np.random.default_rng(0)), ["norm", "norm"]),
        (lambda: _loop_attention(18), ["attention"]),
        (_batchnorm, ["batchnorm"]),
    ],
)
def test_what_no_pass_ran_on_is_found_unlisted(model, found):
    """The check can fail: on a model as it came, with an empty report, each look-alike is
    found, in its subgraph, and unlisted."""
    model = model()
    unlisted = fusion.unlisted(model, fusion.FusionReport())
    assert sorted(u.family for u in unlisted) == found, unlisted
    report = fusion.optimize(model)
    assert fusion.unlisted(model, report) == []
