"""The README and docs/ say what the code does: the API's keywords, the count of fusion kinds in
the quickstart, the scripts ``make bench`` runs, the modules
docs/architecture.md's layout names. Read from the files; nothing imported but the
names they describe."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import normexport
from fusion import FUSION_KINDS
from tests.support.readme import README, WORDS

ROOT = Path(__file__).resolve().parents[1]


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


def _layout_parts() -> dict[Path, str]:
    """docs/architecture.md's Layout block, part by part: the package folder of each part of
    fusion/ and normexport/ (a subpackage's part indented under its package's) -> its text."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    parts, top = {}, None
    for indent, name, body in re.findall(
        r"^( {4}| {6})(\w+)/ +(.*?)(?=^ {4,6}\w+/ |\Z)", block, re.M | re.S
    ):
        top = name if len(indent) == 4 else top
        folder = ROOT / name if len(indent) == 4 else ROOT / top / name
        if top in ("fusion", "normexport"):
            parts[folder] = body
    return parts


def _public(folder: Path) -> list[str]:
    """The public modules and subpackages of the package ``folder``, by name."""
    return sorted(
        p.stem if p.suffix == ".py" else p.name
        for p in folder.iterdir()
        if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").is_file())
    )


def _named(folder: Path, text: str) -> list[str]:
    """The modules that ``text``, the layout's part of ``folder``, names in backticks, as paths
    relative to ``folder`` (``driver``, ``fold_batchnorm/algebra``): a name is a module of the
    subpackage named last before it where that subpackage has one of that name, else a module
    or subpackage of ``folder`` (or, where it is neither, what the layout names wrongly)."""
    named, current = [], None
    for name in re.findall(r"`(\w+)`", text):
        if current is not None and name in _public(folder / current):
            named.append(f"{current}/{name}")
            continue
        current = name if (folder / name / "__init__.py").is_file() else None
        named.append(name)
    return named


def _expected(folder: Path, parts: dict[Path, str]) -> list[str]:
    """What the layout's part of ``folder`` must name: its public modules, and its subpackages
    with their public modules, but for the subpackages that have a part of their own."""
    out = []
    for name in _public(folder):
        if folder / name not in parts:
            out.append(name)
            if (folder / name).is_dir():
                out.extend(f"{name}/{module}" for module in _public(folder / name))
    return out


def test_the_layout_names_every_module_and_only_modules():
    """docs/architecture.md's Layout names each public module and subpackage of fusion/ and
    normexport/ in backticks in its package's part, and names nothing else that way."""
    parts = _layout_parts()
    assert {ROOT / "fusion", ROOT / "normexport", ROOT / "normexport" / "io"} <= set(parts)
    wrong = {
        folder.relative_to(ROOT).as_posix(): (
            sorted(set(_expected(folder, parts)) - set(_named(folder, text))),
            sorted(set(_named(folder, text)) - set(_expected(folder, parts))),
        )
        for folder, text in parts.items()
    }
    wrong = {folder: found for folder, found in wrong.items() if any(found)}
    assert not wrong, f"part: (not named, named but no module): {wrong}"
