"""Write the docs' text that the code declares, from :data:`fusion.registry.PASSES`: the table of
kinds of docs/report.md (each :class:`fusion.Kind`'s name and meaning), the passes of
docs/architecture.md's Layout (each pass's module, its modules where it is a package, and its
summary) and the index of docs/fusions.md (each pass, its doc ``docs/fusions/<module>.md``, its
report counts and its summary). One source per fact: a new pass declares them in its module and
this script writes them here; ``tests/test_docs.py`` fails until it has.

    python -m tools.docs            # rewrite the generated parts
    python -m tools.docs --check    # exit 1, naming the files, where they differ
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from fusion.base import FusionPass
from fusion.registry import PASSES, declarations

ROOT = Path(__file__).resolve().parents[1]
REPORT = Path("docs/report.md")
ARCHITECTURE = Path("docs/architecture.md")
FUSIONS = Path("docs/fusions.md")

#: The lines around the report's table of kinds (Markdown comments: not rendered).
KINDS_BEGIN = "<!-- The kinds: written by `python -m tools.docs` from fusion.registry. -->\n"
KINDS_END = "<!-- End of the kinds. -->\n"
#: The lines around docs/fusions.md's index of the passes.
INDEX_BEGIN = "<!-- The passes: written by `python -m tools.docs` from fusion.registry. -->\n"
INDEX_END = "<!-- End of the passes. -->\n"
#: The Layout's line before the passes, and the first line after them.
PASSES_BEGIN = (
    "                  the passes, in the order they run (written by `python -m tools.docs`\n"
    "                  from fusion.registry: each pass's module and summary):\n"
)
PASSES_END = "    normexport/ "
#: The Layout's width and the indent of its text.
WIDTH, INDENT = 100, 18


def kinds_table(passes: Sequence[type[FusionPass]]) -> str:
    """The report's table of kinds: a row per kind of ``passes``, in report order."""
    kinds, _ = declarations(passes)
    rows = [f"| `{kind.name}` | integer | {kind.meaning} |\n" for kind in kinds]
    return "| key | type | meaning |\n| --- | --- | --- |\n" + "".join(rows)


def doc_of(fusion_pass: type[FusionPass]) -> Path:
    """The doc of ``fusion_pass``: ``docs/fusions/<module>.md``, named as its module or package
    under ``fusion/`` is (``fusion/fold_batchnorm`` -> ``docs/fusions/fold_batchnorm.md``)."""
    return Path("docs/fusions") / f"{fusion_pass.__module__.split('.')[1]}.md"


def fusions_index(passes: Sequence[type[FusionPass]]) -> str:
    """docs/fusions.md's index: a row per pass of ``passes``, in the order they run: the pass
    linked to its doc, its module, its report counts and its summary."""
    rows = []
    for fusion_pass in passes:
        doc = doc_of(fusion_pass)
        link = doc.relative_to(FUSIONS.parent).as_posix()
        counts = ", ".join(f"`{kind.name}`" for kind in fusion_pass.kinds)
        rows.append(
            f"| [`{fusion_pass.__name__}`]({link}) | `fusion.{doc.stem}` | {counts} "
            f"| {fusion_pass.summary} |\n"
        )
    return "| pass | module | report count | what it does |\n| --- | --- | --- | --- |\n" + "".join(
        rows
    )


def _modules(fusion_pass: type[FusionPass], root: Path) -> tuple[str, list[str]]:
    """The name of the module or package of ``fusion_pass`` under ``fusion/``, and the public
    modules of the package (none for a module)."""
    name = fusion_pass.__module__.split(".")[1]
    folder = root / "fusion" / name
    if not (folder / "__init__.py").is_file():
        return name, []
    return name, sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))


def layout_passes(passes: Sequence[type[FusionPass]], root: Path = ROOT) -> str:
    """The Layout's lines of ``passes``: per pass, its module in backticks (its package's
    modules in parentheses) and its summary, wrapped to the Layout's width."""
    lines = []
    for fusion_pass in passes:
        name, modules = _modules(fusion_pass, root)
        inside = f" ({', '.join(f'`{m}`' for m in modules)})" if modules else ""
        text = f"`{name}`{inside}: {fusion_pass.summary};"
        lines += textwrap.wrap(
            text,
            WIDTH,
            initial_indent=" " * INDENT,
            subsequent_indent=" " * (INDENT + 2),
            break_on_hyphens=False,
            break_long_words=False,
        )
    return "\n".join(lines) + "\n"


def _between(text: str, begin: str, end: str, new: str, where: Path) -> str:
    """``text`` with what lies between ``begin`` and the next ``end`` replaced by ``new``.

    Raises:
        ValueError: ``begin`` or ``end`` is not in ``text`` once (the markers were edited).
    """
    if text.count(begin) != 1 or end not in text.split(begin, 1)[1]:
        raise ValueError(f"{where}: the markers of the generated part are not there once")
    head, rest = text.split(begin, 1)
    return head + begin + new + end + rest.split(end, 1)[1]


def generated(root: Path = ROOT, passes: Sequence[type[FusionPass]] = PASSES) -> dict[Path, str]:
    """The texts of docs/report.md, docs/architecture.md and docs/fusions.md under ``root`` with
    their generated parts written from ``passes``, by path relative to ``root``."""
    report = (root / REPORT).read_text()
    layout = (root / ARCHITECTURE).read_text()
    index = (root / FUSIONS).read_text()
    return {
        REPORT: _between(report, KINDS_BEGIN, KINDS_END, kinds_table(passes), REPORT),
        ARCHITECTURE: _between(
            layout, PASSES_BEGIN, PASSES_END, layout_passes(passes, root), ARCHITECTURE
        ),
        FUSIONS: _between(index, INDEX_BEGIN, INDEX_END, fusions_index(passes), FUSIONS),
    }


def stale(root: Path = ROOT) -> list[Path]:
    """The files whose generated parts differ from what :func:`generated` writes."""
    return [path for path, text in generated(root).items() if (root / path).read_text() != text]


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the generated parts (``--check``: only say which differ); the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tools.docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    if args.check:
        if paths := stale():
            print("stale: " + ", ".join(map(str, paths)) + ": run python -m tools.docs")
            return 1
        return 0
    for path, text in generated().items():
        (ROOT / path).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
