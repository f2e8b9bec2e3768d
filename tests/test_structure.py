"""The code's shape: no function over 60 lines of code, no module over 400 (docstrings, comments
and blank lines not counted: documenting a function never splits it), no import cycle in the
shipped packages, and normexport's packages in layers (docs/architecture.md).

All read the source with :mod:`ast` (nothing is imported), so they are fast and fail naming
every offender with its file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fusion", "normexport", "models")
MAX_LINES = 60
MAX_MODULE_LINES = 400
#: normexport's parts from the bottom up: a module may import its own part and the parts of
#: lower layers, nothing above it and nothing beside it (another part of its own layer). A part
#: is a package (all its modules) or a module. ``fusion`` imports no part of normexport.
LAYERS = (
    ("errors", "progress"),
    ("io", "runtime"),
    ("precision",),
    ("verdict",),
    ("latency",),
    ("tuning",),
    ("report",),
    ("arguments",),
    ("pipeline",),
    ("bench",),
    ("cli", ""),
    ("__main__",),
)


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of :data:`PACKAGES`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of :data:`PACKAGES` that ``name`` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1]])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m != name}


def _long_functions(source: str) -> list[tuple[int, str, int]]:
    """``(line, name, lines of code)`` of each function of ``source`` over :data:`MAX_LINES`
    lines of code (:func:`_prose_lines` not counted)."""
    prose = _prose_lines(source)
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            span = range(node.lineno, node.end_lineno + 1)
            lines = sum(1 for number in span if number not in prose)
            if lines > MAX_LINES:
                long.append((node.lineno, node.name, lines))
    return long


def test_no_function_is_longer_than_60_lines_of_code():
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({lines})"
        for path in _modules().values()
        for line, name, lines in _long_functions(path.read_text())
    ]
    assert not long, "functions over 60 lines of code:\n" + "\n".join(long)


@pytest.mark.parametrize(("code", "doc", "long"), [(61, 0, 1), (60, 100, 0), (58, 0, 0)])
def test_the_function_cap_counts_code_not_docstrings(code, doc, long):
    body = "".join(f"    x{i} = {i}\n" for i in range(code - 2))
    source = 'def f():\n    """Doc.\n' + "    more\n" * doc + '    """\n' + body
    source += "    return 0\n"
    assert len(_long_functions(source)) == long


def test_no_module_is_longer_than_400_lines_of_code():
    long = [
        f"{path.relative_to(ROOT)} ({n})"
        for name, path in _modules().items()
        if name.startswith(("fusion", "normexport"))
        and (n := _code_lines(path.read_text())) > MAX_MODULE_LINES
    ]
    assert not long, "modules over 400 lines of code:\n" + "\n".join(long)


def _part(module: str) -> str:
    """``normexport.verdict.parity`` -> ``verdict``; ``normexport`` -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` (normexport module -> modules it imports) that goes up a layer
    of :data:`LAYERS` or sideways to another part of its own layer."""
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    wrong = []
    for name, imported in sorted(graph.items()):
        for other in sorted(m for m in imported if m.startswith("normexport")):
            mine, theirs = _part(name), _part(other)
            if mine != theirs and layer[theirs] >= layer[mine]:
                wrong.append(f"{name} imports {other}")
    return wrong


def test_normexport_parts_are_in_layers():
    modules = _modules()
    parts = {_part(n) for n in modules if n.startswith("normexport")}
    assert parts <= {p for layer in LAYERS for p in layer}, "parts not in LAYERS"
    graph = {n: _imports(n, p, modules) for n, p in modules.items() if n.startswith("normexport")}
    wrong = _layer_violations(graph)
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_fusion_imports_nothing_of_normexport_or_models():
    modules = _modules()
    wrong = [
        f"{name} imports {other}"
        for name, path in modules.items()
        if name.startswith("fusion")
        for other in _imports(name, path, modules)
        if not other.startswith("fusion")
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("graph", "wrong"),
    [
        ({"normexport.io.files": {"normexport.verdict.parity"}}, 1),  # up
        ({"normexport.io.files": {"normexport.runtime"}}, 1),  # sideways
        ({"normexport.verdict.parity": {"normexport.io.files", "normexport.verdict"}}, 0),
    ],
)
def test_layer_check_finds_imports_up_and_sideways(graph, wrong):
    assert len(_layer_violations(graph)) == wrong


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_no_import_cycle():
    modules = _modules()
    # A package's __init__ may import its own modules; a module importing its package's
    # __init__ back is the cycle this looks for.
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]), ({"a": {"b"}, "b": set()}, None)],
)
def test_find_cycle_finds_cycles(graph, expected):
    assert _find_cycle(graph) == expected


#: Lines of code (no blank line, comment or docstring) an ``__init__.py`` may hold: a package's
#: face, its public names and at most a short entry point; the machinery lives in modules
#: named for it.
MAX_INIT_CODE = 100


def _prose_lines(source: str) -> set[int]:
    """The numbers of the lines of ``source`` that are not code: blank, a comment, or in a
    docstring (of the module, a class or a function)."""
    prose: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                prose.update(range(first.lineno, first.end_lineno + 1))
    for number, line in enumerate(source.splitlines(), 1):
        if not line.strip() or line.strip().startswith("#"):
            prose.add(number)
    return prose


def _code_lines(source: str) -> int:
    """How many lines of ``source`` are code (:func:`_prose_lines` left out)."""
    return len(source.splitlines()) - len(_prose_lines(source))


def test_code_lines_leave_docstrings_and_comments_out():
    source = '"""Doc\n\nmore."""\n\n# note\nimport os\n\n\ndef f():\n    """Doc."""\n    return 1\n'
    assert _code_lines(source) == 3


def test_no_init_holds_more_than_its_face():
    big = [
        f"{path.relative_to(ROOT)} ({n})"
        for path in _modules().values()
        if path.name == "__init__.py" and (n := _code_lines(path.read_text())) > MAX_INIT_CODE
    ]
    assert not big, f"__init__.py over {MAX_INIT_CODE} lines of code:\n" + "\n".join(big)


#: What no file of a clone may cite: the design note that lived outside the repository.
OUTSIDE_NOTE = re.compile(r"\bDESIGN\.md\b")
#: What the packages and the docs may not refer to either: the shared folder beside a checkout
#: (tests and benchmarks read the peer files there as optional inputs, skipped without them).
OUTSIDE_FOLDER = re.compile(r"\.\./shared\b|\bshared/")


def _cites_outside() -> list[str]:
    """``path:line`` of each citation of a file outside the repository."""
    own = [*_modules().values(), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    inputs = [p for d in ("tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    checks = [(p, (OUTSIDE_NOTE, OUTSIDE_FOLDER)) for p in own]
    checks += [(p, (OUTSIDE_NOTE,)) for p in inputs if p != Path(__file__)]
    return [
        f"{path.relative_to(ROOT)}:{number}"
        for path, patterns in checks
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(pattern.search(line) for pattern in patterns)
    ]


def test_nothing_cites_a_file_outside_the_repository():
    cites = _cites_outside()
    assert not cites, "cites a file outside the repository:\n" + "\n".join(cites)


def _absolute_imports(source: str) -> set[str]:
    """Every module an absolute import of ``source`` names, at any depth of its code, and for
    ``from a import b`` also ``a.b`` (``b`` may be a module)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _private_fusion(source: str) -> list[str]:
    """The private modules of fusion (a part named ``_*``, such as ``fusion._ir``) that
    ``source`` imports."""
    return sorted(
        name
        for name in _absolute_imports(source)
        if name.split(".")[0] == "fusion" and any(p.startswith("_") for p in name.split(".")[1:])
    )


def _normexport_imports(source: str) -> list[str]:
    """The modules of normexport, or of its tests (``tests.normexport``), that ``source``
    imports."""
    return sorted(
        name
        for name in _absolute_imports(source)
        if name.split(".")[0] == "normexport" or name.startswith("tests.normexport")
    )


@pytest.mark.parametrize(
    ("source", "private", "of_normexport"),
    [
        ("from fusion._ir import label", ["fusion._ir", "fusion._ir.label"], []),
        ("def f():\n    from fusion import _symbolic", ["fusion._symbolic"], []),
        ("import fusion.fold_batchnorm._x", ["fusion.fold_batchnorm._x"], []),
        ("from fusion.graph import const_array\nimport fusion", [], []),
        ("from normexport import runtime", [], ["normexport", "normexport.runtime"]),
        ("import normexport.io", [], ["normexport.io"]),
        ("from tests.normexport import test_cli", [], ["tests.normexport",
                                                      "tests.normexport.test_cli"]),
        ("from graphs import run  # normexport", [], []),
    ],
)  # fmt: skip
def test_the_boundary_checks_find_what_they_look_for(source, private, of_normexport):
    assert _private_fusion(source) == private
    assert _normexport_imports(source) == of_normexport


def _python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def test_no_module_outside_fusion_imports_its_private_modules():
    """fusion's face is public (:mod:`fusion.graph` for its graph helpers); its ``_*`` modules
    are its own machinery (docs/architecture.md)."""
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _python_files("normexport", "models", "tests", "benchmarks", "tools")
        for name in _private_fusion(path.read_text())
    ]
    assert not wrong, "\n".join(wrong)


def test_no_file_of_fusion_names_normexport():
    """fusion is a library of its own: it describes itself without the product around it."""
    wrong = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted(p for p in (ROOT / "fusion").rglob("*") if p.is_file())
        if path.suffix != ".pyc"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "normexport" in line.lower()
    ]
    assert not wrong, "names normexport:\n" + "\n".join(wrong)


def test_the_tests_of_fusion_import_no_normexport():
    """fusion's tests (tests/fusion, and tests/support, which they import) run ONNX Runtime
    directly: fusion is tested alone."""
    paths = [*_python_files("tests/fusion"), *_python_files("tests/support")]
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in _normexport_imports(path.read_text())
    ]
    assert not wrong, "\n".join(wrong)
