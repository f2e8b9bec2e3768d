"""The spellings each pass's doc lists, held to its matcher: every row of the section
"Spellings held by a test" of docs/fusions/<module>.md names a builder, of the pass's own
graph-level test module or of :mod:`tests.support.spellings`, as a call with literal keywords;
each is built (random weights and statistics), run through :func:`fusion.optimize` for the
row's target, and must be fused by that pass (its report counts) with the same outputs on ONNX
Runtime before and after. A row whose builder is not there fails; so does a doc of the required
passes that lists none."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import fusion
from fusion.registry import PASSES
from tests.support import spellings
from tests.support.graphs import assert_close, run
from tests.support.norm_graphs import inputs
from tools import docs

ROOT = Path(__file__).resolve().parents[2]
#: The heading of a doc's list of spellings, and a row of its table: ``| spelling | target |
#: `builder(keyword=literal, ...)` |``.
HEADING = "\n## Spellings held by a test\n"
ROW = re.compile(r"^\| (?!spelling \|)(.+?) \| (ort|onnx) \| `(.+)` \|$", re.MULTILINE)
#: The passes whose docs must list their spellings (every norm, GELU, BatchNorm folding).
REQUIRED = {
    "FoldBatchNorm",
    "FuseInstanceNorm",
    "FuseGroupNorm",
    "FuseChannelsFirstLayerNorm",
    "FuseLayerNorm",
    "FuseRMSNorm",
    "FuseGelu",
}


def listed(text: str) -> list[tuple[str, str, str]]:
    """The rows ``(spelling, target, builder call)`` of the section "Spellings held by a test"
    of a doc's ``text`` (none where it has no such section)."""
    if HEADING not in text:
        return []
    return ROW.findall(text.split(HEADING, 1)[1].split("\n## ", 1)[0])


def _rows():
    for fusion_pass in PASSES:
        path = ROOT / docs.doc_of(fusion_pass)
        for spelling, target, call in listed(path.read_text()):
            name = f"{path.stem}:{call}"
            yield pytest.param(fusion_pass, spelling, target, call, id=f"{name}-{target}")


def _builder(call: str, fusion_pass):
    """The builder that ``call`` (``layernorm(square="mul")``) names and its keywords: a
    function written in the pass's own graph-level test module
    (``tests/fusion/test_<module>_graphs.py``) where it has one by that name, else of
    :mod:`tests.support.spellings` (those several passes share).

    Raises:
        AssertionError: ``call`` is no call of a name with literal keywords, or the name is no
            function of either module.
    """
    node = ast.parse(call, mode="eval").body
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args, call
    own = _test_module(fusion_pass)
    builder = getattr(own, node.func.id, None)
    if getattr(builder, "__module__", None) != getattr(own, "__name__", ""):
        builder = getattr(spellings, node.func.id, None)  # not written there, only imported
    where = f"{own.__name__} or " if own is not None else ""
    assert callable(builder), f"no builder {node.func.id} in {where}tests.support.spellings"
    return builder, {k.arg: ast.literal_eval(k.value) for k in node.keywords}


def _test_module(fusion_pass):
    """The pass's graph-level test module (named after the pass's module), or None."""
    name = f"test_{docs.doc_of(fusion_pass).stem}_graphs"
    if not (ROOT / "tests" / "fusion" / f"{name}.py").exists():
        return None
    return importlib.import_module(f"tests.fusion.{name}")


@pytest.mark.parametrize(("fusion_pass", "spelling", "target", "call"), list(_rows()))
def test_each_listed_spelling_is_fused(rng, fusion_pass, spelling, target, call):
    builder, keywords = _builder(call, fusion_pass)
    model = builder(rng, **keywords)
    feeds = inputs(rng, model)
    before = run(model, feeds)
    report = fusion.optimize(model, target=target)
    fused = sum(report.counts[kind.name] for kind in fusion_pass.kinds)
    assert fused >= 1, f"{spelling}: not fused by {fusion_pass.__name__}: {report.refused}"
    fusion.check(model)
    assert_close(run(model, feeds), before, rtol=1e-4, atol=1e-5)


def test_the_required_passes_list_their_spellings():
    """Every norm pass, FuseGelu and FoldBatchNorm lists spellings, and each row parses (a
    table row that the pattern misses would go untested)."""
    wrong = []
    for fusion_pass in PASSES:
        text = (ROOT / docs.doc_of(fusion_pass)).read_text()
        if fusion_pass.__name__ in REQUIRED and not listed(text):
            wrong.append(f"{fusion_pass.__name__}: no spellings listed")
        if HEADING in text:
            table = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
            rows = [line for line in table.splitlines() if line.startswith("| ")]
            if len(rows) != len(listed(text)) + 2:  # the header and its rule
                wrong.append(
                    f"{fusion_pass.__name__}: a row that is not | spelling | target | call |"
                )
    assert not wrong, "\n".join(wrong)


def test_a_row_without_its_builder_fails():
    table = "| spelling | target | builder |\n| --- | --- | --- |\n| a | ort | `nowhere()` |\n"
    ((_, _, call),) = listed(HEADING + table)
    layernorm_pass = next(p for p in PASSES if p.__name__ == "FuseLayerNorm")
    with pytest.raises(AssertionError, match="no builder nowhere"):
        _builder(call, layernorm_pass)
    # a name the pass's test module only imports is not its builder: the shared one is
    assert _builder("layernorm()", layernorm_pass)[0] is spellings.layernorm
