"""The recipe "A new pass" of docs/architecture.md checked directly: a pass ``FuseBar``, declared
here as its module would declare it (its kind and the kind's meaning, its summary, its own
refusal code), is all the registry, the driver and ``tools/docs.py`` need; the registry refuses
a pass that declares too little or a code twice; and the recipe names the files it takes.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

import pytest

import fusion
from fusion import driver
from fusion.base import CannotFuse, Kind, NodeFusionPass, Op
from fusion.registry import PASSES, declarations
from tests.support.graphs import make_model
from tools import docs

ROOT = Path(__file__).resolve().parents[1]
#: A file a recipe names: a path in backticks (``README.md`` alone has no folder).
NAMED_FILE = re.compile(r"`((?:\w+/)+\w+\.(?:py|md)|README\.md)`")


class BarCode(enum.StrEnum):
    """FuseBar's own refusal code."""

    BAR_REFUSED = "bar_refused"


class FuseBar(NodeFusionPass):
    """Refuses every Relu (``bar_refused``), fuses nothing."""

    __module__ = "fusion.fuse_bar"  # where the recipe puts it
    kinds = (Kind("bar_fused", "bar", (Op("Bar", "com.example"),), norm=False, meaning="bars"),)
    summary = "every Relu refused"
    codes = BarCode

    def match(self, model, node):
        """None, or the refusal of a Relu."""
        if node.op_type == "Relu":
            raise CannotFuse(BarCode.BAR_REFUSED, "a Relu")
        return None


def _relu():
    return make_model([("Relu", ["x"], ["y"], {})], {"x": (1, [2])}, {"y": (1, [2])})


def test_a_pass_in_the_registry_runs_and_reports(monkeypatch):
    """The driver runs a pass of the registry's list and its report carries the pass's
    refusal and the count of its kind: nothing else is edited."""
    monkeypatch.setattr(driver, "PASSES", (*PASSES, FuseBar))
    kinds, _ = declarations((*PASSES, FuseBar))
    report = fusion.optimize(_relu())
    assert report.codes("bar") == ["bar_refused"]
    assert report.to_dict([kind.name for kind in kinds])["bar_fused"] == 0


def test_the_registry_collects_what_a_pass_declares():
    kinds, codes = declarations((*PASSES, FuseBar))
    assert kinds[-1] == FuseBar.kinds[0] and kinds[:-1] == fusion.KINDS
    assert codes[-1] is BarCode.BAR_REFUSED and codes[:-1] == fusion.CODES
    assert fusion.Code("few_heads") == "few_heads" and len(fusion.Code) == len(fusion.CODES)


def _variant(**declared) -> type[FuseBar]:
    """FuseBar with some of its declarations replaced."""
    return type("FuseBaz", (FuseBar,), declared)


def test_the_registry_refuses_too_little_or_twice():
    """A pass without its summary, a kind without its meaning, a code value, a code name or a
    kind declared twice: each refused by name."""
    twice = enum.StrEnum("BazCode", [("BAZ", "shared_output")])
    renamed = enum.StrEnum("BazCode", [("EVERY_ROW_READ", "baz")])
    meaningless = (Kind("baz_fused", "baz", norm=False),)
    with pytest.raises(TypeError, match="FuseBaz"):
        declarations((*PASSES, _variant(summary="")))
    with pytest.raises(TypeError, match="baz_fused"):
        declarations((*PASSES, _variant(kinds=meaningless)))
    with pytest.raises(ValueError, match="shared_output"):
        declarations((*PASSES, _variant(codes=twice)))
    with pytest.raises(ValueError, match="EVERY_ROW_READ"):
        declarations((*PASSES, _variant(codes=renamed)))
    with pytest.raises(ValueError, match="bar_fused"):
        declarations((*PASSES, FuseBar, _variant(codes=None)))
    assert declarations(PASSES) == (fusion.KINDS, fusion.CODES)


def test_the_docs_are_written_from_a_new_pass():
    """``tools/docs.py`` writes the new pass's row of the report's kinds, its lines of the
    Layout and its row of docs/fusions.md's index: the committed docs differ until it is run."""
    written = docs.generated(ROOT, (*PASSES, FuseBar))
    assert "| `bar_fused` | integer | bars |\n" in written[docs.REPORT]
    assert "`fuse_bar`: every Relu refused;" in written[docs.ARCHITECTURE]
    row = "| [`FuseBar`](fusions/fuse_bar.md) | `fusion.fuse_bar` | `bar_fused` | every Relu"
    assert row in written[docs.FUSIONS]
    assert all(text != (ROOT / path).read_text() for path, text in written.items())


def test_the_recipe_names_its_files():
    """The recipe "A new pass" names the module, the registry, the pass's doc beside its module
    by name and its test (which holds the builders of the spellings its doc lists): the four
    files a maintainer edits (``tools/docs.py`` writes the rest)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    recipe = text.split("**A new pass**", 1)[1].split("\n## ", 1)[0]
    assert set(NAMED_FILE.findall(recipe)) == {
        "fusion/fuse_bar.py",
        "fusion/registry.py",
        "docs/fusions/fuse_bar.md",
        "tests/fusion/test_fuse_bar_graphs.py",
    }
    assert docs.doc_of(FuseBar).as_posix() == "docs/fusions/fuse_bar.md"
