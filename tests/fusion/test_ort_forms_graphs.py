"""fusion.ort_forms: each known ONNX Runtime LayerNorm-fusion bug reproduces on the ONNX Runtime
installed (else the test skips, saying so), and the exact form avoids it: the same outputs as
written, and the same under ORT_ENABLE_ALL (docs/parity.md#judged-as-deployed)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from fusion.ort_forms import ISSUES, avoid_ort_misfusions
from tests.support.graphs import cpu_session, run
from tests.support.ort_bugs import GRAPHS, feeds


def _deployed(model, x) -> np.ndarray | str:
    """The output under ORT_ENABLE_ALL, or ONNX Runtime's error."""
    try:
        return cpu_session(model).run(None, x)[0]
    except Exception as err:  # ORT's own error types
        return str(err)


@pytest.mark.parametrize("issue", sorted(GRAPHS))
def test_the_form_for_each_issue_runs_alike_as_deployed(issue):
    model = GRAPHS[issue]()
    x = feeds(model)
    (written,) = run(model, x)
    before = _deployed(model, x)
    if not isinstance(before, str) and np.allclose(before, written, atol=1e-5):
        pytest.skip(f"{issue} is fixed in onnxruntime {ort.__version__}")
    changed = avoid_ort_misfusions(model)
    assert issue in {ISSUES[k] for k in changed}
    np.testing.assert_array_equal(run(model, x)[0], written)  # exact
    after = _deployed(model, x)
    assert not isinstance(after, str), after
    np.testing.assert_allclose(after, written, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("issue", "key"),
    [("onnxruntime#30513", "keepdims"), ("onnxruntime#31980", "full_rank_scale")],
)
def test_each_rewrite_alone_avoids_its_issue(issue, key, monkeypatch):
    model = GRAPHS[issue]()
    x = feeds(model)
    (written,) = run(model, x)
    for other in {"keepdims", "constant_last", "full_rank_scale"} - {key}:
        monkeypatch.setattr(f"fusion.ort_forms._{other}", lambda *a: False)
    assert avoid_ort_misfusions(model) == {key: 2 if key == "keepdims" else 1}
    np.testing.assert_allclose(_deployed(model, x), written, atol=1e-5, rtol=1e-5)


def test_each_rewrite_is_made_only_where_its_issue_holds():
    # onnxruntime#30513's graph writes its Mul's constant first too, on a rank-3 input: no
    # onnxruntime#31147 there (a rank-1 input only), so the swap is not made nor cited
    assert avoid_ort_misfusions(GRAPHS["onnxruntime#30513"]()) == {"keepdims": 2}
    assert avoid_ort_misfusions(GRAPHS["onnxruntime#31147"]()) == {"constant_last": 1}


def test_a_mean_that_keeps_its_axis_is_left_as_written():
    model = GRAPHS["onnxruntime#30513"]()
    for node in model.graph:
        if node.op_type == "ReduceMean":
            node.attributes.pop("keepdims")
    assert avoid_ort_misfusions(model) == {}
