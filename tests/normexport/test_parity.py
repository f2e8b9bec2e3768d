"""Parity metrics and verdicts, on arrays with known errors."""

import numpy as np
import pytest

from normexport.inputs import id_ranges, input_sets, parse_input_shape
from normexport.parity import check_parity, closeness, compare


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


def test_integer_inputs_get_random_sets_and_no_probes():
    example = {"ids": np.arange(6).reshape(1, 6), "attention_mask": np.ones((1, 6), np.int64)}
    sets = input_sets(example, id_ranges={"ids": 1000})
    assert list(sets) == ["example", "random_0", "random_1", "random_2"]
    ids = np.stack([sets[f"random_{i}"]["ids"] for i in range(3)])
    assert ids.min() >= 0 and ids.max() < 1000 and ids.max() > 5  # the vocabulary, not the example
    assert np.all(sets["random_0"]["attention_mask"] == 1)
    assert sets["random_1"]["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0]]


def test_id_range_is_read_from_the_embedding():
    import onnx_ir as ir

    ids = ir.Value(name="ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1, 4]))
    table = ir.Value(name="emb", const_value=ir.tensor(np.zeros((37, 8), np.float32)))
    cast = ir.node("Cast", [ids], attributes={"to": ir.DataType.INT32})
    gather = ir.node("Gather", [table, cast.outputs[0]])
    graph = ir.Graph([ids], gather.outputs, nodes=[cast, gather], initializers=[table])
    assert id_ranges(ir.Model(graph, ir_version=10)) == {"ids": 37}


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


def test_verdict_judges_the_optimizer_not_float32():
    """Issue 11's numbers: against float64, PyTorch float32 is 3.0e-2 off, the raw export 6.3e-3,
    the optimized model 2.7e-3 (tolerance 3.4e-3 at max |oracle| 3.3). Judged against PyTorch
    float32 it failed; judged against the oracle and the export's own error it passes."""
    rng = np.random.default_rng(0)
    oracle = rng.uniform(-3.3, 3.3, 1000)
    oracle[0] = 3.3

    def off(err):
        y = oracle.copy()
        y[1] += err
        return y.astype(np.float64)

    e = compare("y", off(2.7e-3), oracle, 1e-4, 1e-3, raw=off(6.3e-3), pytorch=off(3.0e-2))
    assert e.passed and e.pytorch_max_abs_err == pytest.approx(3.0e-2)
    assert not compare("y", off(2.7e-3), off(3.0e-2), 1e-4, 1e-3).passed  # the old verdict
    # beyond the tolerance and beyond NOISE_FACTOR x the export's own error: fails
    assert not compare("y", off(3e-2), oracle, 1e-4, 1e-3, raw=off(6.3e-3)).passed
    # within the tolerance: passes whatever the export did
    assert compare("y", off(1e-3), oracle, 1e-4, 1e-3, raw=off(0.0)).passed


def test_nan_fails_even_where_the_raw_export_has_nan():
    oracle = np.ones(4)
    got = oracle.copy()
    got[0] = np.nan
    assert not compare("y", got, oracle, 1e-4, 1e-3, raw=got).passed


@pytest.mark.parametrize("ref", [np.zeros(5), np.full(5, 7.0)])
def test_constant_reference_is_a_weak_check(ref):
    assert compare("y", ref, ref, 1e-4, 1e-3).weak
    assert not compare("y", np.arange(5.0), np.arange(5.0), 1e-4, 1e-3).weak


def test_random_sets_do_not_repeat_a_generated_example():
    """The example that --input-shape generates and the random sets come from different seeds:
    a random set equal to the example would be a parity run wasted."""
    from normexport.inputs import parse_input_shape, random_array

    spec = parse_input_shape("x=2x3x8")
    example = {"x": random_array(spec, np.random.default_rng(0))}
    sets = input_sets(example)
    for i in range(3):
        assert not np.array_equal(sets[f"random_{i}"]["x"], example["x"]), i


def test_closeness_is_atol_plus_rtol_times_max_ref():
    ref = np.array([-4.0, 1.0, np.nan, np.inf])
    got = np.array([-4.3, 1.0, 7.0, 0.0])  # where ref is NaN/Inf nothing is compared
    c = closeness(got, ref, atol=0.1, rtol=0.05)
    assert (c.max_abs_err, c.max_abs_ref, c.nonfinite_mismatch) == pytest.approx((0.3, 4.0, 0))
    assert c.tolerance == pytest.approx(0.1 + 0.05 * 4.0) and c.within
    assert not closeness(got, ref, atol=0.1, rtol=0.04).within
    assert "> tolerance" in closeness(got, ref, atol=0.0, rtol=0.0).describe()


def test_closeness_nan_where_reference_is_finite_is_never_close():
    c = closeness(np.array([np.nan, np.inf]), np.zeros(2), atol=1e9, rtol=1e9)
    assert c.nonfinite_mismatch == 2 and c.max_abs_err == np.inf and not c.within
    assert "2 NaN/Inf" in c.describe()
    with pytest.raises(ValueError, match="shape"):
        closeness(np.zeros(2), np.zeros(3))
    assert closeness(np.zeros(0), np.zeros(0)).within
