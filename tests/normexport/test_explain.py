"""``normexport explain`` against the run: on every provider, explain lists what the run's passes
do to the same graph, with the run's policies (the Skip fusion's per provider:
``normexport.runtime.fusion_policy.fusion_policy``). Graphs built node by node; no PyTorch
export, no session on the model."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto
from rich.console import Console

import fusion
from normexport import cli, runtime
from normexport.report import explain
from normexport.runtime.fusion_policy import SKIP_PROVIDERS
from normexport.runtime.fusion_policy import fusion_policy as policy
from tests.fusion.test_subgraphs_graphs import _if_layernorms
from tests.support.graphs import make_model
from tests.support.reparam_graphs import MERGED, Block

SHAPE = (2, 5, 16)
F = TensorProto.FLOAT


def _residual_layernorm() -> ir.Model:
    """``LayerNormalization(a + b)`` at opset 17: what FuseSkip makes one
    SkipLayerNormalization of, where the Skip policy asks for it."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            ("Add", ["a", "b"], ["sum"], {"name": "add"}),
            ("LayerNormalization", ["sum", "gamma", "beta"], ["y"], {"name": "norm", "axis": -1}),
        ],
        {"a": (F, SHAPE), "b": (F, SHAPE)},
        {"y": (F, SHAPE)},
        {
            "gamma": (1 + 0.5 * rng.standard_normal(SHAPE[-1])).astype(np.float32),
            "beta": rng.standard_normal(SHAPE[-1]).astype(np.float32),
        },
        opset=17,
    )


@pytest.mark.parametrize("provider", ["cpu", "cuda"])
def test_explain_and_the_run_agree_on_each_provider(provider):
    ran = _residual_layernorm()
    already = explain.already_fused(ran)
    outcomes = fusion.optimize(ran, policy("ort", provider, 2))  # the run's
    explained = _residual_layernorm()
    findings = explain.explain(explained, policy("ort", provider, 2))
    assert findings == explain.from_report(outcomes.fused, outcomes.refused, already)
    assert [n.op_type for n in explained.graph] == [n.op_type for n in ran.graph]
    # the policy decides here: one Skip op on the providers it is fused for, the Add elsewhere
    skip_fused = [f for f in findings if f.kind == "skip" and f.outcome == "fused"]
    assert len(skip_fused) == (provider in SKIP_PROVIDERS)


def test_the_skip_policy_differs_between_the_providers():
    """What makes the test above able to fail: a fusion that one provider's policy skips."""
    assert policy("ort", "cuda", 2).skip is True
    assert policy("ort", "cpu", 2).skip == "kv_cache"  # this model has none: not fused on the CPU
    assert not policy("onnx", "cuda", 2).skip  # the Skip ops are ONNX Runtime's


def test_explain_command_resolves_the_provider_as_the_run_does(monkeypatch, capsys, tmp_path):
    path = tmp_path / "residual.onnx"
    ir.save(_residual_layernorm(), path)
    asked = []

    def cuda(requested):
        asked.append(requested)
        return "cuda", None

    monkeypatch.setattr(runtime, "resolve_provider", cuda)
    code = cli.main(["explain", str(path)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and asked == ["auto"]  # explain's options: the run's default provider
    assert "SkipLayerNormalization" in out and "fused: 1" in out


def _one_head_attention(path) -> None:
    """softmax(Q @ K^T / 4) @ V of one head, (1, 1, 8, 16), at opset 23."""
    shape = (1, 1, 8, 16)
    nodes = [
        ("Transpose", ["k"], ["kt"], {"perm": [0, 1, 3, 2]}),
        ("MatMul", ["q", "kt"], ["raw"], {}),
        ("Mul", ["raw", "scale"], ["scores"], {}),
        ("Softmax", ["scores"], ["p"], {"axis": -1}),
        ("MatMul", ["p", "v"], ["y"], {}),
    ]
    inputs = {name: (F, shape) for name in ("q", "k", "v")}
    scale = {"scale": np.array(0.25, np.float32)}
    ir.save(make_model(nodes, inputs, {"y": (F, shape)}, scale, opset=23), path)


@pytest.mark.parametrize(("threads", "outcome"), [(1, "fused"), (2, "few_heads")])
def test_threads_is_the_machine_the_fusions_are_chosen_for(
    tmp_path, capsys, monkeypatch, threads, outcome
):
    """``--threads``: on the CPU provider an attention of fewer heads than the threads the model
    will run on is left alone by both attention passes (``few_heads``); on one thread it is
    fused (into ONNX Runtime's MultiHeadAttention, FuseAttention's, for ``--target ort``)."""
    path = tmp_path / "attention.onnx"
    _one_head_attention(path)
    monkeypatch.setenv("COLUMNS", "300")  # the reason on one line
    code = cli.main(["explain", str(path), "--provider", "cpu", "--threads", str(threads)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    if outcome == "fused":
        assert "MultiHeadAttention" in out and "fewer than" not in out, out
    else:
        assert "fewer than the 2 intra-op threads" in out, out


def test_a_norm_the_model_has_is_named_by_the_pass_that_makes_it():
    """BERT's LayerNormalization is a ``layernorm`` (the op FuseLayerNorm writes), not the
    channels-first family's, whose pass also writes the op and runs first."""
    model = _residual_layernorm()
    findings = explain.explain(model, policy("ort", "cpu", 2))
    (already,) = [f for f in findings if f.outcome == "already fused"]
    assert (already.kind, already.detail) == ("layernorm", "LayerNormalization")


def test_explain_names_a_merge_reparam_not_batchnorm(rng):
    """A RepVGG-style merge is listed under its own family (it was listed as ``batchnorm``)."""
    build, _, _ = MERGED["mobileone_k2"]
    block = Block(rng)
    findings = explain.explain(block.model(build(block)))
    assert {f.kind for f in findings if f.outcome == "fused"} == {"reparam", "batchnorm"}


def _layernorm_without_eps() -> ir.Model:
    """``(x - m) / sqrt(var) * w + b`` over the last axis, no eps: what ``torch.onnx.export``'s
    own optimizer leaves of an eps of 1e-8."""
    rng = np.random.default_rng(0)
    nodes = [
        ("ReduceMean", ["x", "axes"], ["m"], {}),
        ("Sub", ["x", "m"], ["d"], {}),
        ("Mul", ["d", "d"], ["sq"], {}),
        ("ReduceMean", ["sq", "axes"], ["v"], {}),
        ("Sqrt", ["v"], ["den"], {}),
        ("Div", ["d", "den"], ["normed"], {}),
        ("Mul", ["normed", "w"], ["scaled"], {}),
        ("Add", ["scaled", "b"], ["y"], {}),
    ]
    params = {
        "axes": np.array([-1], np.int64),
        "w": (1 + 0.5 * rng.standard_normal(SHAPE[-1])).astype(np.float32),
        "b": rng.standard_normal(SHAPE[-1]).astype(np.float32),
    }
    return make_model(nodes, {"x": (F, SHAPE)}, {"y": (F, SHAPE)}, params)


def test_explain_says_the_norm_has_no_eps():
    findings = explain.explain(_layernorm_without_eps())
    assert [f.outcome for f in findings] == ["fused", "note"]
    console = Console(record=True, width=400)
    explain.render(findings, "no eps", console)
    text = console.export_text()
    assert "epsilon 0" in text and "note: a LayerNorm with no eps" in text


def test_explain_names_a_norm_in_a_branch_by_its_path():
    model = _if_layernorms(np.random.default_rng(0), eps_outside=True)
    findings = explain.explain(model)
    (left,) = [f for f in findings if f.outcome == "left alone"]
    assert left.node.startswith("If 'cond_node' / then_branch / '"), left
    assert [f.node for f in findings if f.outcome == "fused"][0].startswith("If 'cond_node' / else")
    assert not [f for f in findings if f.outcome == explain.UNLISTED]
