"""The recipes of docs/architecture.md ("Recipes") followed for real: each recipe's edits made,
file by file, in a copy of the tree (an option ``foo``, a pass ``FuseBar``, a policy field
``bar`` that a user and the provider's rule set), and the tests that catch a missed file run
there. They pass with every edit and fail with any one file's edits left out; the files a
recipe names are the files it edits, no more and no fewer. What no test catches (the module
that reads ``opts.foo``, the test of its effect) the recipes say so, unnamed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.support.readme import README, WORDS

ROOT = Path(__file__).resolve().parents[1]
RECIPES_TEXT = (ROOT / "docs" / "architecture.md").read_text().split("\n## Recipes", 1)[1]
RECIPES_TEXT = RECIPES_TEXT.split("\n## ", 1)[0]
#: A file a recipe names: a path in backticks (``README.md`` alone has no folder).
NAMED_FILE = re.compile(r"`((?:\w+/)+\w+\.(?:py|md)|README\.md)`")


class Edit(NamedTuple):
    """One edit of one file: ``old`` (exactly once in it) replaced by ``new``; ``old`` None:
    a new file, ``""``: ``new`` added at its end."""

    path: str
    old: str | None
    new: str


class Recipe(NamedTuple):
    """A recipe's edits (made on the tree with ``before``'s), and the tests that check them."""

    edits: tuple[Edit, ...]
    checks: tuple[str, ...]
    before: tuple[Edit, ...] = ()


def _raised_count() -> Edit:
    """The README's ``(the N other kinds: 0)`` with N one more."""
    (count,) = re.findall(r"\(the (\w+) other kinds: 0\)", README)
    raised = WORDS[WORDS.index(count) + 1]
    return Edit("README.md", f"(the {count} other kinds: 0)", f"(the {raised} other kinds: 0)")


LAST_FLAG = '"last position only, (batch, 1, vocabulary), computing only what that reads",\n    )\n'
CHECKS = ("tests/test_docs.py", "tests/test_structure.py")
OPTION_CHECKS = (
    "tests/normexport/test_api.py::test_flags_fill_options_by_name",
    "tests/normexport/test_api.py::test_flags_keywords_and_fields_are_one_set_of_names",
)
FUSE_BAR = '''"""FuseBar: fuses nothing, refuses every Relu (tests/test_recipes.py); see
docs/fusions.md#fusebar."""

from fusion import Code
from fusion.base import CannotFuse, Kind, NodeFusionPass, Op


class FuseBar(NodeFusionPass):
    """Refuses every Relu (``bar_refused``)."""

    kinds = (Kind("bar_fused", "bar", (Op("Bar", "com.example"),), norm=False),)

    def match(self, model, node):
        """None, or the refusal of a Relu."""
        if node.op_type == "Relu":
            raise CannotFuse(Code.BAR_REFUSED, "refused")
        return None
'''
RELU = 'make_model([("Relu", ["x"], ["y"], {})], {"x": (1, [2])}, {"y": (1, [2])})'
FUSE_BAR_TEST = f'''"""FuseBar on a graph (tests/test_recipes.py)."""

import fusion
from tests.support.graphs import make_model


def test_fuse_bar_refuses_a_relu():
    assert fusion.optimize({RELU}).codes("bar") == ["bar_refused"]
'''
BAR_TEST = f"""

def test_bar_reaches_the_pass_from_the_provider_and_the_user():
    from normexport.arguments import make_options
    from normexport.pipeline.job import run_policy
    from tests.support.graphs import make_model

    model = {RELU}
    assert [r.detail for r in fusion.optimize(model, bar=True).refused] == ["bar=True"]
    assert run_policy(make_options(model="m.onnx"), model, "cuda").bar is True
    assert run_policy(make_options(model="m.onnx", bar=False), model, "cuda").bar is False
"""

A_NEW_OPTION = Recipe(
    edits=(
        Edit(
            "normexport/arguments/options.py",
            "    last_token_logits: bool = False\n",
            "    last_token_logits: bool = False\n    foo: bool = False\n",
        ),
        Edit(
            "normexport/arguments/flags.py",
            LAST_FLAG,
            LAST_FLAG
            + '    p.add_argument("--foo", action="store_true", default=_default("foo"))\n',
        ),
        Edit(
            "normexport/__init__.py",
            "    last_token_logits: bool = False,\n",
            "    last_token_logits: bool = False,\n    foo: bool = False,\n",
        ),
        Edit("README.md", "`last_token_logits`.", "`last_token_logits`, `foo`."),
    ),
    checks=(*CHECKS, *OPTION_CHECKS),
)
A_NEW_PASS = Recipe(
    edits=(
        Edit("fusion/fuse_bar.py", None, FUSE_BAR),
        Edit(
            "fusion/registry.py",
            "from fusion.fuse_attention import FuseAttention\n",
            "from fusion.fuse_attention import FuseAttention\n"
            "from fusion.fuse_bar import FuseBar\n",
        ),
        Edit("fusion/registry.py", "    FuseSkip,\n)", "    FuseBar,\n    FuseSkip,\n)"),
        Edit(
            "fusion/base/codes.py",
            '    SHARED_OUTPUT = "shared_output"\n',
            '    SHARED_OUTPUT = "shared_output"\n    BAR_REFUSED = "bar_refused"\n',
        ),
        Edit(
            "docs/report.md",
            "| `gelu_fused` |",
            "| `bar_fused` | integer | bars |\n| `gelu_fused` |",
        ),
        _raised_count(),
        Edit(
            "docs/architecture.md",
            "`fuse_gelu`, `fuse_skip`,",
            "`fuse_gelu`, `fuse_skip`, `fuse_bar`,",
        ),
        Edit(
            "docs/fusions.md",
            "\n## The fusion policy\n",
            "\n### FuseBar\n\nEvery Relu refused, `bar_refused`.\n\n## The fusion policy\n",
        ),
        Edit("tests/fusion/test_fuse_bar_graphs.py", None, FUSE_BAR_TEST),
    ),
    checks=(
        *CHECKS,
        "tests/normexport/test_api.py::test_every_report_key_is_documented",
        "tests/fusion/test_fuse_bar_graphs.py",
    ),
)
AN_OPTION_THAT_REACHES_A_PASS = Recipe(
    before=A_NEW_PASS.edits,
    edits=(
        Edit(
            "fusion/base/policy.py",
            "    last_rows: tuple[str, ...] = ()\n",
            "    last_rows: tuple[str, ...] = ()\n    bar: bool = False\n",
        ),
        Edit(
            "fusion/fuse_bar.py",
            "norm=False),)\n",
            'norm=False),)\n    settings = ("bar",)\n    bar = False\n',
        ),
        Edit("fusion/fuse_bar.py", '"refused"', 'f"bar={self.bar}"'),
        Edit(
            "normexport/runtime/policy.py",
            'TRANSPOSED_SDPA_PROVIDERS = ("cuda",)\n',
            'TRANSPOSED_SDPA_PROVIDERS = ("cuda",)\nBAR_PROVIDERS = ("cuda",)\n',
        ),
        Edit(
            "normexport/runtime/policy.py",
            "threads: int | None = None, **settings",
            "threads: int | None = None, bar: bool | None = None, **settings",
        ),
        Edit(
            "normexport/runtime/policy.py",
            "        **settings,\n    )",
            "        bar=provider in BAR_PROVIDERS if bar is None else bar,\n"
            "        **settings,\n    )",
        ),
        Edit(
            "normexport/arguments/options.py",
            "    last_token_logits: bool = False\n",
            "    last_token_logits: bool = False\n    bar: bool | None = None\n",
        ),
        Edit(
            "normexport/arguments/flags.py",
            LAST_FLAG,
            LAST_FLAG
            + '    p.add_argument("--bar", action=argparse.BooleanOptionalAction, '
            + 'default=_default("bar"))\n',
        ),
        Edit(
            "normexport/__init__.py",
            "    last_token_logits: bool = False,\n",
            "    last_token_logits: bool = False,\n    bar: bool | None = None,\n",
        ),
        Edit("README.md", "`last_token_logits`.", "`last_token_logits`, `bar`."),
        Edit(
            "normexport/pipeline/job.py",
            "last_rows=last_rows)",
            "last_rows=last_rows, bar=opts.bar)",
        ),
        Edit(
            "tests/normexport/test_policy.py",
            '        "last_rows": (),\n    }\n    assert',
            '        "last_rows": (),\n        "bar": False,\n    }\n    assert',
        ),
        Edit(
            "tests/normexport/test_policy.py",
            '        "last_rows": (),\n    }\n    onnx_cpu',
            '        "last_rows": (),\n        "bar": True,\n    }\n    onnx_cpu',
        ),
        Edit("tests/normexport/test_policy.py", "", BAR_TEST),
    ),
    checks=(*CHECKS, *OPTION_CHECKS, "tests/normexport/test_policy.py"),
)
RECIPES = {
    "A new option": A_NEW_OPTION,
    "An option that reaches a pass": AN_OPTION_THAT_REACHES_A_PASS,
    "A new pass": A_NEW_PASS,
}


def _recipe_text(title: str) -> str:
    """The paragraphs of the recipe ``title``: from its bold title to the next one."""
    return RECIPES_TEXT.split(f"**{title}**", 1)[1].split("\n**", 1)[0]


def _apply(root: Path, edit: Edit) -> None:
    """Make ``edit`` in the tree at ``root``.

    Raises:
        ValueError: the text to replace is not in the file exactly once (the code moved on:
            the edit, not the recipe, is stale).
    """
    path = root / edit.path
    if edit.old is None:
        path.write_text(edit.new)
        return
    text = path.read_text()
    if edit.old and text.count(edit.old) != 1:
        raise ValueError(f"{edit.path}: {edit.old!r} is there {text.count(edit.old)} times")
    path.write_text(text.replace(edit.old, edit.new) if edit.old else text + edit.new)


def _follow(root: Path, recipe: Recipe, left_out: str | None = None) -> subprocess.CompletedProcess:
    """Copy the tracked tree to ``root``, make ``recipe``'s edits there but those of the file
    ``left_out``, and run its checks there."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)
    for edit in (*recipe.before, *recipe.edits):
        if edit not in recipe.edits or edit.path != left_out:
            _apply(root, edit)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    if left_out is not None:  # a failure is what is looked for: the first one will do
        command.append("-x")
    return subprocess.run([*command, *recipe.checks], cwd=root, capture_output=True, text=True)


def _needed(recipe: Recipe) -> list[str]:
    """The files of ``recipe`` whose edits its checks need: all but the new tests."""
    tests = {e.path for e in recipe.edits if e.old is None and e.path.startswith("tests/")}
    return sorted({e.path for e in recipe.edits} - tests)


@pytest.mark.parametrize("title", RECIPES)
def test_each_recipe_names_the_files_it_edits(title):
    """The files a recipe names (paths in backticks) are the files following it edits."""
    named = set(NAMED_FILE.findall(_recipe_text(title)))
    assert named == {e.path for e in RECIPES[title].edits}, _recipe_text(title)


@pytest.mark.slow
@pytest.mark.parametrize("title", RECIPES)
def test_a_recipe_followed_passes_its_checks(tmp_path, title):
    done = _follow(tmp_path, RECIPES[title])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("title", "left_out"), [(t, path) for t, recipe in RECIPES.items() for path in _needed(recipe)]
)
def test_a_recipe_without_one_of_its_files_fails_its_checks(tmp_path, title, left_out):
    done = _follow(tmp_path, RECIPES[title], left_out)
    failed = re.search(r"^(FAILED|ERROR) tests/", done.stdout, re.M)  # a test, not pytest's use
    assert done.returncode != 0 and failed, done.stdout[-4000:] + done.stderr[-2000:]
