"""The README and docs/ say what the code does: the API's keywords, the count of fusion kinds in
the quickstart, the scripts ``make bench`` runs. Read from the files; nothing imported but the
names they describe."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import normexport
from fusion import FUSION_KINDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen".split()  # noqa: SIM905


def test_the_readme_lists_every_keyword_of_the_api():
    """Each keyword of ``normexport.optimize`` is named in the README's Python API section, and
    each one it names is a keyword."""
    section = README.split("## Python API", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)(?:=[^`]*)?`", section))  # in the text
    named |= set(re.findall(r"\b([a-z_]+)=", section))  # in the example
    keywords = set(inspect.signature(normexport.optimize).parameters) - {"model"}
    assert keywords <= named, sorted(keywords - named)


def test_the_quickstart_counts_the_kinds():
    """``(the N other kinds: 0)`` in the quickstart's table: every kind but the one shown."""
    (count,) = re.findall(r"\(the (\w+) other kinds: 0\)", README)
    assert WORDS.index(count) == len(FUSION_KINDS) - 1


def test_the_docs_name_the_scripts_make_bench_runs():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    run = re.findall(r"benchmarks/(\w+\.py)", target)
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    said = docs.split("`make bench` installs", 1)[1].split(" and runs ", 1)[1].split(".\n")[0]
    assert re.findall(r"`(\w+\.py)`", said) == run
