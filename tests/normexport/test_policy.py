"""The fusion policy per execution provider (:mod:`normexport.runtime.fusion_policy`): the
choices each provider's run makes, and their effect on graphs built node by node, run on ONNX
Runtime."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fusion
from fusion import Code
from normexport.arguments import make_options
from normexport.latency.measure import latency_threads
from normexport.pipeline.job import run_policy, run_threads
from normexport.runtime.fusion_policy import fusion_policy
from tests.support.attention_graphs import YOLO, random_feeds, yolo_attention
from tests.support.graphs import assert_close, ops, run


def test_each_provider_gets_its_choices_for_the_targets_its_passes_run_for():
    assert dataclasses.asdict(fusion_policy("ort", "cpu", 4)) == {
        "target": "ort",
        "skip": "kv_cache",
        "attention": None,
        "gqa": True,
        "sdpa": None,
        "threads": 4,
        "sdpa_transposed": False,
        "last_rows": (),
    }
    assert dataclasses.asdict(fusion_policy("ort", "cuda", 4)) == {
        "target": "ort",
        "skip": True,
        "attention": None,
        "gqa": False,
        "sdpa": None,
        "threads": 1,
        "sdpa_transposed": True,
        "last_rows": (),
    }
    onnx_cpu, onnx_cuda = fusion_policy("onnx", "cpu", 4), fusion_policy("onnx", "cuda", 4)
    assert (onnx_cpu.skip, onnx_cpu.gqa, onnx_cpu.threads) == (False, False, 4)
    assert (onnx_cuda.skip, onnx_cuda.gqa, onnx_cuda.threads) == (False, False, 1)


def test_threads_is_resolved_once_and_the_policy_gets_the_resolved_value():
    """``--threads`` None: this machine's cores, resolved by ``run_threads`` alone; the run's
    policy is built with what it resolved (on the CPU provider; 1 on any other)."""
    raw = yolo_attention()
    asked, default = make_options(model="m.onnx", threads=3), make_options(model="m.onnx")
    assert (run_threads(asked), run_threads(default)) == (3, latency_threads())
    assert run_policy(default, raw, "cpu", run_threads(default)).threads == latency_threads()
    assert run_policy(asked, raw, "cpu", 3).threads == 3
    assert run_policy(asked, raw, "cuda", 3).threads == 1


def test_a_users_settings_reach_the_policy_and_its_own_choices_stay_its_own():
    policy = fusion_policy("ort", "cpu", 2, last_rows=("logits",))
    assert policy.last_rows == ("logits",) and policy.skip == "kv_cache"
    with pytest.raises(TypeError, match="skip"):  # a choice per provider: decided here
        fusion_policy("ort", "cpu", 2, skip=True)
    with pytest.raises(TypeError, match="no_such_field"):
        fusion_policy("ort", "cpu", 2, no_such_field=1)
    with pytest.raises(ValueError, match="unknown target"):
        fusion_policy("tensorrt", "cpu", 2)


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_the_cpu_policy_leaves_the_transposed_form_cudas_fuses_it(target):
    """``sdpa_transposed``: the CPU provider's policy leaves C2PSA's attention
    (``transposed_form``: ONNX Runtime runs the MatMuls with the Transposes taken in, where
    Attention needs four copies), the model as it was; CUDA's fuses it, exact."""
    feeds = random_feeds(np.random.default_rng(0), YOLO)
    cpu, cuda = (fusion_policy(target, provider, 2) for provider in ("cpu", "cuda"))
    model = yolo_attention()
    before = ops(model)
    report = fusion.optimize(model, cpu)
    assert report.codes("attention") == [Code.TRANSPOSED_FORM], report.refused
    assert ops(model) == before and model.opset_imports[""] == 20
    model = yolo_attention()
    want = run(model, feeds)
    report = fusion.optimize(model, cuda)
    assert report.counts["sdpa_fused"] == 1, report.refused
    assert "Attention" in ops(model) and "Softmax" not in ops(model)
    assert_close(run(model, feeds), want)
