"""Parity metrics and verdicts, on arrays with known errors."""

import numpy as np
import pytest

from normexport.inputs import input_sets, parse_input_shape
from normexport.parity import check_parity, compare


def test_compare_metrics_are_exact():
    ref = np.array([3.0, 4.0], dtype=np.float32)
    got = np.array([3.0, 4.5], dtype=np.float32)
    e = compare("y", got, ref, atol=0.0, rtol=0.1)
    assert e.max_abs_err == pytest.approx(0.5)
    assert e.rel_l2_err == pytest.approx(0.5 / 5.0)
    assert e.max_abs_ref == pytest.approx(4.0)
    assert not e.passed  # 0.5 > 0.1 * 4
    assert compare("y", got, ref, atol=0.0, rtol=0.2).passed


def test_half_wrong_output_fails_with_defaults():
    """onnxscript's assert_numerically_equal (rtol=1) passes a 50% error; ours must not."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(100).astype(np.float32)
    assert not compare("y", ref * 1.5, ref, atol=1e-4, rtol=1e-3).passed


def test_nan_where_reference_is_finite_always_fails():
    ref = np.zeros(4, dtype=np.float32)
    got = ref.copy()
    got[2] = np.nan
    e = compare("y", got, ref, atol=1e9, rtol=1e9)
    assert not e.passed and e.nonfinite_mismatch == 1


def test_check_parity_reports_failing_probe():
    sets = input_sets({"x": np.ones((2, 3), dtype=np.float32)}, n_random=1)
    assert list(sets) == ["example", "random_0", "constant", "zeros", "tiny_1e-4", "huge_1e3"]
    assert np.all(sets["zeros"]["x"] == 0) and np.ptp(sets["constant"]["x"]) == 0

    def reference(feeds):
        return [feeds["x"] * 2]

    def candidate(feeds):  # wrong only where every element is equal: a lost eps
        x = feeds["x"]
        return [x * 2 if np.ptp(x) > 0 else np.full_like(x, np.nan)]

    result = check_parity(candidate, reference, sets, ["y"], reference_kind="pytorch")
    assert not result.passed
    assert {p for p, _ in result.failures()} == {"example", "constant", "zeros"}


def test_integer_inputs_get_no_probes():
    sets = input_sets({"ids": np.arange(6).reshape(1, 6)})
    assert list(sets) == ["example"]


@pytest.mark.parametrize(
    ("text", "name", "shape", "dtype"),
    [
        ("1,3,224,224", None, (1, 3, 224, 224), "float32"),
        ("input_ids=2x16:int64", "input_ids", (2, 16), "int64"),
        ("x=1x1024", "x", (1, 1024), "float32"),
    ],
)
def test_parse_input_shape(text, name, shape, dtype):
    spec = parse_input_shape(text)
    assert (spec.name, spec.shape, str(spec.dtype)) == (name, shape, dtype)
