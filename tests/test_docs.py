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
NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)
WORDS = NUMBERS.split()


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


def test_the_compat_table_is_the_measured_one():
    """docs/compat.md's table is what ``benchmarks/compat.py`` makes of its results
    (``benchmarks/results/compat.json``), row for row."""
    import json

    from benchmarks import compat

    results = json.loads((ROOT / "benchmarks" / "results" / "compat.json").read_text())["runs"]
    doc = (ROOT / "docs" / "compat.md").read_text()
    assert compat.table(results) in doc


def test_the_declared_torch_range_is_the_measured_one():
    """pyproject.toml's torch requirement: a lower bound, the oldest torch that passed in
    ``benchmarks/results/compat.json``, and no upper bound (users keep the torch they have)."""
    import json
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert "<" not in spec, spec
    (floor,) = re.findall(r">=\s*([\d.]+)", spec)
    runs = json.loads((ROOT / "benchmarks" / "results" / "compat.json").read_text())["runs"]
    passed = [r["asked"]["torch"] for r in runs.values() if r["passed"]]
    oldest = min(passed, key=lambda v: tuple(map(int, v.split("."))))
    assert floor == oldest, (spec, oldest)
