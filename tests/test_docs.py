"""The README and docs/ say what the code does: the API's keywords, the scripts ``make bench``
runs, the modules docs/architecture.md's layout names, the parts ``tools/docs.py`` writes from
the passes' declarations (the report's kinds, the layout's passes); and docs/ is the one home of
the design's facts: every document and section a docstring or a document names is there, each
pass has its doc docs/fusions/<module>.md, and no module docstring restates them. Read from the
files; nothing imported but the names they describe."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import normexport
from fusion.registry import PASSES
from tools import docs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_lists_every_keyword_of_the_api():
    """Each keyword of ``normexport.optimize`` is named in the README's Python API section, and
    each one it names is a keyword."""
    section = README.split("## Python API", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)(?:=[^`]*)?`", section))  # in the text
    named |= set(re.findall(r"\b([a-z_]+)=", section))  # in the example
    keywords = set(inspect.signature(normexport.optimize).parameters) - {"model"}
    assert keywords <= named, sorted(keywords - named)


def test_the_generated_parts_are_written():
    """docs/report.md's table of kinds and the passes of docs/architecture.md's Layout are what
    ``python -m tools.docs`` writes from the passes' declarations (run it after adding a pass
    or changing a kind's meaning or a pass's summary)."""
    assert docs.stale() == [], "run python -m tools.docs"


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


def test_the_declared_pythons_are_the_measured_ones():
    """pyproject.toml's requires-python is the oldest Python a run in
    ``benchmarks/results/compat.json`` passed on, with no upper bound, and its Python
    classifiers name every Python (major.minor) a run passed on, and no other."""
    import json
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runs = json.loads((ROOT / "benchmarks" / "results" / "compat.json").read_text())["runs"]
    passed = {
        ".".join((r["installed"].get("python") or r["machine"]["python"]).split(".")[:2])
        for r in runs.values()
        if r["passed"]
    }
    declared = {
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: \d+\.\d+", c)
    }
    assert declared == passed, (declared, passed)
    oldest = min(passed, key=lambda v: tuple(map(int, v.split("."))))
    assert project["requires-python"] == f">={oldest}", (project["requires-python"], oldest)


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


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_``
    dropped, each space a ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of the headings of the Markdown file ``path`` (a repeated one as
    ``name-1``, ``name-2``, as GitHub numbers them), outside code blocks."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (heading := re.match(r"#{1,6} (.+)", line)):
            slug, n = _slug(heading.group(1)), 0
            while (slug if not n else f"{slug}-{n}") in found:
                n += 1
            found.add(slug if not n else f"{slug}-{n}")
    return found


#: ``file.md#anchor``, in a Markdown link or named in prose or code.
_SECTION = re.compile(r"([\w./-]*?)([\w-]+\.md)#([\w-]+)")


def _broken_sections(text: str, documents: dict[str, set[str]]) -> list[str]:
    """Each ``file.md#anchor`` of ``text`` whose file is one of ``documents`` (file name -> its
    anchors) and has no such heading (another project's, as ONNX's ``Operators.md#Gelu``, is
    not checked)."""
    return [
        f"{name}#{anchor}"
        for _, name, anchor in _SECTION.findall(text)
        if name in documents and anchor not in documents[name]
    ]


def _documents() -> list[Path]:
    """The README and every Markdown file of docs/ (docs/fusions/ included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_section_named_exists():
    """A docstring or a document that points to a section (``docs/fusions.md#subgraphs``,
    ``[report.md](report.md#fusions)``) points to a heading that is there."""
    files = _documents()
    documents = {path.name: _anchors(path) for path in files}
    for folder in ("fusion", "normexport", "models", "benchmarks", "tests", "tools"):
        files += (ROOT / folder).rglob("*.py")
    broken = [
        f"{path.relative_to(ROOT)}: {section}"
        for path in files
        if path.name != "test_docs.py"  # its made-up sections
        for section in _broken_sections(path.read_text(), documents)
    ]
    assert not broken, "sections that are not there:\n" + "\n".join(broken)


def test_the_section_check_finds_a_missing_heading():
    documents = {"fusions.md": _anchors(ROOT / "docs" / "fusions.md")}
    assert _slug("Why wasn't my LayerNorm fused?") == "why-wasnt-my-layernorm-fused"
    assert _broken_sections("see docs/fusions.md#subgraphs and (#x)", documents) == []
    assert _broken_sections("docs/fusions.md#fuse-sdpa", documents) == ["fusions.md#fuse-sdpa"]
    assert _broken_sections("[a](fusions.md#x), Operators.md#Gelu", documents) == ["fusions.md#x"]


#: A document of ours a docstring or a document names: ``docs/fusions/fuse_gelu.md`` from the
#: repository's root (ONNX Runtime's ``docs/OperatorKernels.md`` is another project's), or a
#: Markdown link's relative target, ``](fusions/fuse_gelu.md#...)``.
_FROM_ROOT = re.compile(r"(?<![\w./-])(docs/[a-z][\w/-]*\.md)\b")
_LINKED = re.compile(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)")
#: The doc of the recipe's example pass (docs/architecture.md, "A new pass"): no pass has it.
_EXAMPLE = "docs/fusions/fuse_bar.md"


def test_every_document_named_exists():
    """Each ``docs/...md`` a docstring, a test or a document names, and each Markdown file a
    document links to (relative to the document), is there: a renamed or moved doc leaves no
    link behind."""
    files = [*_documents()]
    for folder in ("fusion", "normexport", "models", "benchmarks", "tests", "tools"):
        files += (ROOT / folder).rglob("*.py")
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in files
        for name in _FROM_ROOT.findall(path.read_text())
        if name != _EXAMPLE and not (ROOT / name).is_file()
    ]
    missing += [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _documents()
        for name in _LINKED.findall(path.read_text())
        if not (path.parent / name).is_file()
    ]
    assert not missing, "documents that are not there:\n" + "\n".join(missing)


#: The most lines a pass's module docstring holds: what the module is and where its doc is;
#: the facts live in the doc.
PASS_DOCSTRING_LINES = 12


def test_each_pass_has_a_doc_that_its_module_points_to():
    """docs/fusions/<module>.md is the one home of a pass's math, refusals and sources, beside
    its module by name (``fusion/fold_batchnorm`` -> ``docs/fusions/fold_batchnorm.md``): each
    pass of ``fusion.registry.PASSES`` has its doc, titled with the pass's name, and its
    module's docstring (a package's ``__init__.py``) names it and stays short."""
    wrong = []
    for fusion_pass in PASSES:
        path = docs.doc_of(fusion_pass)
        face = importlib.import_module(".".join(fusion_pass.__module__.split(".")[:2]))
        doc = face.__doc__ or ""
        if not (ROOT / path).is_file():
            wrong.append(f"{fusion_pass.__name__}: no {path}")
        elif not (ROOT / path).read_text().startswith(f"# {fusion_pass.__name__}\n"):
            wrong.append(f"{path}: its title is not # {fusion_pass.__name__}")
        if path.as_posix() not in doc:
            wrong.append(f"{face.__name__}'s docstring does not name {path.as_posix()}")
        if len(doc.splitlines()) > PASS_DOCSTRING_LINES:
            wrong.append(f"{face.__name__}'s docstring: {len(doc.splitlines())} lines")
    assert not wrong, "\n".join(wrong)


#: The most lines any module's docstring of fusion or normexport holds: what the module holds,
#: takes and gives, and the docs/ section of its facts. Rules, derivations, sources and
#: measurements live in docs/, once.
MODULE_DOCSTRING_LINES = 20


def test_no_module_docstring_restates_the_docs():
    long = []
    for package in ("fusion", "normexport"):
        for path in sorted((ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if len(doc.splitlines()) > MODULE_DOCSTRING_LINES:
                long.append(f"{path.relative_to(ROOT)} ({len(doc.splitlines())} lines)")
    assert not long, "module docstrings that hold what docs/ should:\n" + "\n".join(long)
