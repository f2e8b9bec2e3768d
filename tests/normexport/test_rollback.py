"""The rollback: rewrites that ONNX Runtime rejects or that change the function are found and
left out, and the model without them is published (exit 0).

The search is tested on a stand-in for building and checking (which rewrites are bad is known);
the pipeline on real models with a pass broken on purpose: ONNX Runtime rejecting the fused
attention of LeViT (key and value heads of different sizes, as before the fix in
``fusion.fuse_attention``), and a BatchNorm fold off by x1.001 on one channel (within the
tolerance: warned, a failure with ``--strict``, never rolled back). The same search with a
measured check, as the latency verdict runs it (a budget, a failure that may be noise), on the
stand-in too.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from fusion import Code, Fused, FusionReport
from fusion.fold_batchnorm import algebra, before
from normexport import cli
from normexport.verdict.rollback import Rejection, RollbackFailed, roll_back

BAD = Rejection(Code.REJECTED_BY_RUNTIME, "ONNX Runtime cannot run it")
CHANGED = Rejection(Code.CHANGED_THE_FUNCTION, "output 'y' diverges on random_0")


def _rewrites(n: int) -> list[Fused]:
    kinds = ("batchnorm_folded", "layernorm_fused", "attention_fused")
    return [Fused(kinds[i % 3], f"node_{i}", "op") for i in range(n)]


class StandIn:
    """Builds "models" (the set of rewrites made) and checks them: a model fails while it holds
    a bad rewrite, or both rewrites of a bad pair."""

    def __init__(self, rewrites, bad=(), pairs=(), after_passes=None):
        self.rewrites, self.bad, self.pairs = rewrites, set(bad), [set(p) for p in pairs]
        self.after_passes = after_passes  # a fault outside every rewrite
        self.models: dict[Path, frozenset] = {}

    def build(self, excluded):
        made = frozenset(f for f in self.rewrites if f not in excluded)
        path = Path(f"model-{len(self.models)}")
        self.models[path] = made
        report = FusionReport()
        report.fused.extend(f for f in self.rewrites if f in made)
        return path, report

    def check(self, path):
        made = self.models[path]
        if self.after_passes is not None:
            return self.after_passes
        if made & self.bad or any(pair <= made for pair in self.pairs):
            return BAD
        return None

    def first(self):
        return self.build(frozenset())


@pytest.mark.parametrize("n, bad", [(1, [0]), (12, [5]), (12, [0, 11]), (40, [3, 17, 18, 39])])
def test_the_bad_rewrites_and_only_they_are_undone(n, bad):
    rewrites = _rewrites(n)
    stand_in = StandIn(rewrites, bad=[rewrites[i] for i in bad])
    outcome = roll_back(*stand_in.first(), stand_in.build, stand_in.check)
    assert {u.rewrite for u in outcome.undone} == {rewrites[i] for i in bad}
    assert all(u.rejection == BAD for u in outcome.undone)
    assert stand_in.check(outcome.path) is None
    assert outcome.report.fused == [f for f in rewrites if f not in stand_in.bad]
    # group testing: about log2(n) checks per bad rewrite, not n
    assert outcome.checks <= 3 + len(bad) * (2 * np.log2(n) + 4), outcome.checks


def test_builds_are_deleted_once_of_no_more_use(tmp_path):
    """A large model's builds are GBs each: every build the search no longer needs (the group
    tests, the model with no rewrite, a build replaced by a later one) is deleted with its
    external data file; the first model and the one kept stay."""
    rewrites = _rewrites(12)
    stand_in = StandIn(rewrites, bad=[rewrites[i] for i in (2, 9)])

    def build(excluded):
        path, report = stand_in.build(excluded)
        on_file = tmp_path / f"{path.name}.onnx"
        stand_in.models[on_file] = stand_in.models.pop(path)
        on_file.write_text("model")
        Path(f"{on_file}.data").write_text("weights")
        return on_file, report

    first = build(frozenset())
    outcome = roll_back(*first, build, stand_in.check)
    assert outcome.undone and len(stand_in.models) > 3
    kept = sorted(p.name for p in tmp_path.iterdir())
    expected = [first[0].name, f"{first[0].name}.data", outcome.path.name]
    assert kept == sorted([*expected, f"{outcome.path.name}.data"])


def test_a_model_that_passes_is_checked_once():
    stand_in = StandIn(_rewrites(8))
    outcome = roll_back(*stand_in.first(), stand_in.build, stand_in.check)
    assert outcome.checks == 1 and not outcome.undone and outcome.unexplained is None


def test_rewrites_bad_only_together_are_left_out():
    rewrites = _rewrites(10)
    stand_in = StandIn(rewrites, pairs=[(rewrites[2], rewrites[7])])
    outcome = roll_back(*stand_in.first(), stand_in.build, stand_in.check)
    assert stand_in.check(outcome.path) is None
    undone = {u.rewrite for u in outcome.undone}
    assert undone & {rewrites[2], rewrites[7]} and len(undone) == 1


def test_a_fault_outside_every_rewrite_is_not_blamed_on_one():
    """The model with no rewrite fails too: nothing undone; a changed function is published
    (the verdict fails it), a model ONNX Runtime rejects is a bug of normexport's."""
    stand_in = StandIn(_rewrites(6), after_passes=CHANGED)
    outcome = roll_back(*stand_in.first(), stand_in.build, stand_in.check)
    assert not outcome.undone and outcome.unexplained == CHANGED
    assert outcome.path == Path("model-0")  # the model as the passes made it
    stand_in = StandIn(_rewrites(6), after_passes=BAD)
    with pytest.raises(RollbackFailed, match="no rewrite at all"):
        roll_back(*stand_in.first(), stand_in.build, stand_in.check)


# --- a measured check (the latency verdict's), within a budget --------------------------------

SLOW = Rejection(Code.SLOWER_HERE, "2x the raw model's time")


def test_a_pass_the_search_cannot_afford_to_descend_into_is_left_out_whole():
    rewrites = _rewrites(12)  # 4 rewrites in each of 3 passes
    stand_in = StandIn(rewrites, bad=[rewrites[4]])
    outcome = roll_back(*stand_in.first(), stand_in.build, stand_in.check, afford=lambda n: n < 4)
    assert {u.rewrite for u in outcome.undone} == {
        f for f in rewrites if f.kind == "layernorm_fused"
    }
    assert stand_in.check(outcome.path) is None
    # not even the passes: every rewrite (the model with none passed)
    stand_in = StandIn(rewrites, bad=[rewrites[4]])
    outcome = roll_back(*stand_in.first(), stand_in.build, stand_in.check, afford=lambda n: False)
    assert {u.rewrite for u in outcome.undone} == set(rewrites)


def test_a_measured_failure_with_no_rewrite_left_ends_the_search():
    """The model with none passed once, then a build with none fails (the timing's noise): with
    a tolerated code the search ends with it; a deterministic check's failure is a bug."""
    rewrites = _rewrites(4)

    def noisy():
        checks = []

        def check(path):
            checks.append(path)
            return None if len(checks) == 2 else SLOW  # the second: the model with none

        return check

    stand_in = StandIn(rewrites)
    outcome = roll_back(*stand_in.first(), stand_in.build, noisy(), tolerated=(Code.SLOWER_HERE,))
    assert {u.rewrite for u in outcome.undone} == set(rewrites)
    assert not stand_in.models[outcome.path]  # the build with no rewrite
    stand_in = StandIn(rewrites)
    with pytest.raises(RollbackFailed, match="fails once"):
        roll_back(*stand_in.first(), stand_in.build, noisy())
    # slower with no rewrite too: nothing undone, where the code is tolerated
    stand_in = StandIn(rewrites, after_passes=SLOW)
    outcome = roll_back(
        *stand_in.first(), stand_in.build, stand_in.check, tolerated=(Code.SLOWER_HERE,)
    )
    assert not outcome.undone and outcome.unexplained == SLOW


# --- the pipeline, with a pass broken on purpose ----------------------------------------------


class Levit(nn.Module):
    """transformers' LevitModel of two stages (key/query heads of 8, value heads of 16:
    attention_ratio 2; two attentions and some 17 Conv/Linear + BatchNorm pairs), random
    weights and BatchNorm statistics; returns ``last_hidden_state``."""

    def __init__(self):
        super().__init__()
        from transformers import LevitConfig, LevitModel

        config = LevitConfig(
            image_size=32, hidden_sizes=[16, 24], num_attention_heads=[1, 2], depths=[1, 1],
            key_dim=[8, 8], drop_path_rate=0, mlp_ratio=[2, 2], attention_ratio=[2, 2],
            down_ops=[["Subsample", 8, 2, 4, 2, 2]],
        )  # fmt: skip
        torch.manual_seed(0)
        self.levit = LevitModel(config).eval()
        with torch.no_grad():
            for m in self.levit.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.running_mean.uniform_(-1, 1)
                    m.running_var.uniform_(0.5, 2)
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)

    def forward(self, pixel_values):
        return self.levit(pixel_values=pixel_values).last_hidden_state


@pytest.mark.slow
def test_attention_onnx_runtime_rejects_is_rolled_back(tmp_path, out_dir, capsys):
    """LeViT saved with torch.export.save, as the issue had it; with the key/value shape check
    of fusion.fuse_attention off, every fused attention is one ONNX Runtime cannot run: each is
    undone (rejected_by_runtime, ONNX Runtime's message), the rest kept, exit 0."""
    path = tmp_path / "given" / "levit.pt2"
    path.parent.mkdir()
    torch.export.save(torch.export.export(Levit(), (torch.randn(1, 3, 32, 32),)), path)
    report_path = out_dir / "report.json"
    args = [str(path), "--no-benchmark", "-o", str(out_dir / "levit.onnx")]
    args += ["--report", str(report_path), "--provider", "cpu"]
    assert cli.main(args) == 0  # the fix: nothing to undo
    clean = json.loads(report_path.read_text())
    assert clean["rollback"] is None and clean["fusions"]["attention_fused"] >= 1
    with mock.patch("fusion.fuse_attention._same_shape", lambda key, value: True):
        code = cli.main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(report_path.read_text())
    undone = report["rollback"]["undone"]
    assert len(undone) == clean["fusions"]["attention_fused"], undone
    assert {u["code"] for u in undone} == {"rejected_by_runtime"}
    assert all("'key' and 'value' shall have same shape" in u["message"] for u in undone)
    assert report["fusions"]["attention_fused"] == 0
    assert report["fusions"]["batchnorm_folded"] == clean["fusions"]["batchnorm_folded"]
    refused = {(r["node"], r["code"]) for r in report["fusions"]["refused"]}
    assert {(u["node"], "rejected_by_runtime") for u in undone} <= refused
    assert report["parity"]["passed"] and "rolled back" in out


def _conv_bn() -> nn.Module:
    """Conv -> BatchNorm (random statistics), the BatchNorm's output the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
    bn = model[1]
    bn.running_mean.data.uniform_(-1, 1)
    bn.running_var.data.uniform_(0.3, 3)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


@pytest.mark.slow
def test_a_fold_off_by_a_thousandth_is_warned_and_fails_with_strict(tmp_path, capsys):
    path = tmp_path / "m.pt"
    torch.save(_conv_bn(), path)
    real = algebra.batchnorm_affine

    def off(node):  # output channel 0 x1.001: off by 1e-3 of |y|, within rtol 1e-3 of max|y|
        s, t = (a.copy() for a in real(node))
        s[0] *= 1.001
        t[0] *= 1.001
        return s, t

    args = [str(path), "--trust-pickle", "--input-shape", "2,3,8,8", "--no-benchmark"]
    args += ["--provider", "cpu", "--report", str(tmp_path / "r.json")]
    for strict in (False, True):
        with (
            mock.patch.object(algebra, "batchnorm_affine", off),
            mock.patch.object(before, "batchnorm_affine", off),
        ):
            code = cli.main(args + ["--strict"] * strict)
        out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at 80 columns
        report = json.loads((tmp_path / "r.json").read_text())
        parity = report["parity"]
        assert report["rollback"] is None  # within the tolerance: nothing to undo
        assert not parity["failures"] and parity["warnings"], parity["outputs"]
        assert code == (1 if strict else 0), out
        last = "parity FAILED (--strict: noise ratio" if strict else "parity passed, with"
        assert last in out and ("fails (--strict)" if strict else "warning:") in out, out
    assert cli.main(args + ["--strict"]) == 0  # unbroken: no warning, strict passes
    assert not json.loads((tmp_path / "r.json").read_text())["parity"]["warnings"]
