"""Variants, sessions and autotune on one-op models built in code: no PyTorch, no export, fast.
No timed assertions."""

from __future__ import annotations

import sys

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto

from normexport import runtime
from normexport.bench import variants
from normexport.errors import UsageError
from normexport.io.files import data_path
from normexport.runtime import sessions
from normexport.tuning import autotune, forms
from normexport.verdict.parity import closeness
from tests.support.graphs import make_model, ops, run

# --- sessions --------------------------------------------------------------------------------


def test_cuda_graph_needs_cuda():
    with pytest.raises(ValueError, match="cuda_graph"):
        runtime.make_session(variants.op_model("Relu", (2, 2)), "cpu", cuda_graph=True)


def test_the_verdicts_cuda_sessions_compute_float32_without_tf32(monkeypatch):
    """ONNX Runtime's CUDA provider computes float32 matrix products in TF32 by default: a
    deployment's session keeps it, the verdict's (check_session) asks for use_tf32=0 (the
    session stubbed: no GPU here)."""
    asked = []

    class Session:
        def __init__(self, source, options, providers, **kwargs):
            asked.append(providers[0])

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    monkeypatch.setattr(sessions.ort, "InferenceSession", Session)
    model = variants.op_model("Relu", (2, 2))
    runtime.make_session(model, "cuda")
    runtime.check_session(model, "cuda")
    runtime.make_session(model, "cuda", cuda_graph=True)
    assert asked == [
        "CUDAExecutionProvider",
        ("CUDAExecutionProvider", {"use_tf32": "0"}),
        ("CUDAExecutionProvider", {"enable_cuda_graph": "1"}),
    ]


def test_auto_without_cuda_says_so_in_one_line(monkeypatch):
    def no_cuda(model, provider, **kwargs):
        raise runtime.ProviderUnavailable("CUDAExecutionProvider did not load")

    monkeypatch.setattr(sessions, "make_session", no_cuda)  # resolve_provider's own call
    provider, note = runtime.resolve_provider("auto")
    assert provider == "cpu"
    assert note == "CUDA was not available (the CUDA provider did not load): ran on CPU"
    with pytest.raises(UsageError, match="--provider cuda"):
        runtime.resolve_provider("cuda")


# --- other optimizers (the bench extra) ------------------------------------------------------


def _conv_bn(rng: np.random.Generator, c: int = 16) -> ir.Model:
    """Padded Conv then BatchNormalization (a fold every tool makes), every statistic random; the
    (c, c, 3, 3) weight is over 1 KiB, so the raw export keeps it in external data."""
    inits = {
        "w": rng.normal(size=(c, c, 3, 3)),
        "b": rng.normal(size=c),
        "scale": rng.uniform(-2, 2, c),
        "B": rng.uniform(-1, 1, c),
        "mean": rng.uniform(-1, 1, c),
        "var": rng.uniform(0.5, 2, c),
    }
    nodes = [
        ("Conv", ["x", "w", "b"], ["c"], {"pads": [1, 1, 1, 1]}),
        ("BatchNormalization", ["c", "scale", "B", "mean", "var"], ["y"], {"epsilon": 1e-3}),
    ]
    inits = {k: v.astype(np.float32) for k, v in inits.items()}
    f32 = TensorProto.FLOAT
    return make_model(nodes, {"x": (f32, [2, c, 5, 5])}, {"y": (f32, None)}, inits)


@pytest.mark.parametrize("tool", list(variants.OPTIONAL_VARIANTS))
def test_optional_tool_folds_batchnorm_exactly(tool, rng, tmp_path):
    pytest.importorskip(tool, reason=f"{tool} is in the bench extra: pip install -e '.[bench]'")
    raw = _conv_bn(rng)
    feeds = {"x": rng.standard_normal((2, 16, 5, 5)).astype(np.float32)}
    (want,) = run(raw, feeds)
    built = variants.build_variants(raw, "cpu", tmp_path, only=[tool])
    assert list(built) == [tool]
    variant = built[tool]
    assert variant.error is None and variant.model.parent == tmp_path
    assert data_path(variant.model).exists()  # written with external data, as the others
    assert variant.description == variants.OPTIONAL_VARIANTS[tool]
    assert ops(ir.load(variant.model)) == ["Conv"] and variant.norm_ops == {}
    if tool == "onnxsim":  # what it said it did, from its metadata
        assert variant.details["removed_nodes"] >= 1
    c = closeness(_outputs(variant.model, feeds), want, atol=1e-5, rtol=1e-4)
    assert c.within, c.describe()


def test_optional_tool_not_installed_is_recorded(monkeypatch, rng, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxsim", None)  # `import onnxsim` now raises ImportError
    built = variants.build_variants(_conv_bn(rng), "cpu", tmp_path, only=["onnxsim", "normexport"])
    assert built["onnxsim"].model is None
    assert built["onnxsim"].error.startswith(
        "ImportError: onnxsim is not installed (pip install -e '.[bench]')"
    )
    assert ops(ir.load(built["normexport"].model)) == ["Conv"]  # the others still built
    with pytest.raises(ValueError, match="onnxslim"):  # the optional ones are named as choices
        variants.build_variants(_conv_bn(rng), "cpu", tmp_path, only=["onnxslimm"])


# --- exact forms and one-op models ----------------------------------------------------------


@pytest.mark.parametrize("form", list(variants.OP_FORMS))
def test_op_forms_load_and_run(form):
    session = runtime.make_session(variants.op_model(form, (2, 3, 8)), "cpu")
    (y,) = runtime.run(session, variants.op_inputs(form, (2, 3, 8)))
    assert y.shape == (2, 3, 8) and np.isfinite(y).all()


def _outputs(model: bytes, feeds, disabled=()) -> np.ndarray:
    session = runtime.make_session(model, "cpu", disabled_optimizers=disabled)
    return runtime.run(session, feeds)[0]


def _model_file(folder, name: str, model: bytes):
    path = folder / f"{name}.onnx"
    path.write_bytes(model)
    return path


@pytest.mark.parametrize(
    ("form", "expected"),
    [
        ("SkipLayerNormalization", {"as_built", "skip_split"}),
        ("SkipSimplifiedLayerNormalization", {"as_built", "skip_split"}),
        ("RMSNormalization", {"as_built", "rms_as_SimplifiedLayerNormalization"}),
        ("Add+SimplifiedLayerNormalization", {"as_built"}),  # opset 17: no RMSNormalization
    ],
)
def test_exact_forms_compute_the_same(form, expected, tmp_path):
    shape = (2, 3, 8)
    feeds = variants.op_inputs(form, shape)
    found = forms.exact_forms(_model_file(tmp_path, "m", variants.op_model(form, shape)))
    assert set(found) == expected
    ref = _outputs(found["as_built"], feeds)
    for model in found.values():
        np.testing.assert_allclose(_outputs(model, feeds), ref, rtol=1e-5, atol=1e-5)
    rms = _model_file(tmp_path, "rms", variants.op_model("RMSNormalization", shape))
    assert set(forms.exact_forms(rms, target="onnx")) == {"as_built"}


# --- autotune --------------------------------------------------------------------------------


def test_autotune_picks_among_exact_candidates_and_rejects_inexact_ones(tmp_path):
    shape = (2, 3, 8)
    model = _model_file(tmp_path, "m", variants.op_model("SkipLayerNormalization", shape))
    cands = autotune.candidates(model)
    assert list(cands) == ["as_built", "skip_split", "skip_split+no_skip_fusion"]
    assert cands["skip_split+no_skip_fusion"].disabled_optimizers == (autotune.SKIP_FUSION,)
    cands["wrong"] = autotune.Candidate(variants.op_model("Add", shape))
    result = autotune.autotune(cands, variants.op_inputs("Add", shape), budget_s=0.2)
    assert result.default == "as_built"
    assert result.best in {"as_built", "skip_split", "skip_split+no_skip_fusion"}
    assert result.rejected == {"wrong": "outputs differ from the default's beyond the tolerance"}
    d = result.to_dict()
    assert d["provider"] == "CPUExecutionProvider"
    assert set(d["timings_ms"]) == {"as_built", "skip_split", "skip_split+no_skip_fusion"}
    assert set(d["ratio_to_default"]) == {"skip_split", "skip_split+no_skip_fusion"}
    if result.best != "as_built":  # switched only when faster beyond the spread
        assert d["ratio_to_default"][result.best]["ci_high"] < 1.0
    assert result.model == cands[result.best].model
