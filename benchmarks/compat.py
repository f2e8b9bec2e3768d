"""normexport under another torch (and transformers) than the pinned one: does installing the
project keep the user's torch, and do ``make demo``'s models and the graph-level tests pass?

For ``--torch VERSION``: a virtual environment of its own, ``.compat/torch-VERSION`` (made by
``make install VENV=... TORCH=VERSION``, the same steps as the development venv's, with that
torch installed first: torch's own wheels from the package index carry CUDA libraries, GBs);
the project is installed into it with its declared dependencies, so a range in
``pyproject.toml`` that excludes that torch replaces it, which is recorded (``torch_kept``).
With ``--transformers VERSION``, that release replaces the one the install chose. Then, with
that venv's Python, from the repository root:

- ``python -m models.demo`` (``make demo``'s models, PyTorch's and the ONNX files, each saved in
  its own format and run through the CLI, latency included): each model's exit code, parity,
  fusions and the checks ``make demo`` holds (:data:`models.demo.EXPECTED`);
- ``pytest -m "not slow"`` (the graph-level tests) and the test files whose subject is the
  torch side (:data:`TORCH_TESTS`: the export, the loaders, the gallery of norm spellings
  through both exporters): passed, failed, skipped, and the failures' ids.

Each step's wall time is kept. The entry is merged into ``benchmarks/results/compat.json``
under its versions, and the table of every entry is printed as ``docs/compat.md`` holds it.

With ``--onnxruntime SPEC`` (``onnxruntime==1.32.0``, ``onnxruntime-gpu==1.31.1``) the venv
takes that ONNX Runtime package through its extra (``cpu`` or ``gpu``) at that version; with
``--python PATH`` the venv is made with that Python (3.12, 3.13).

    python benchmarks/compat.py --torch 2.15.0 [--transformers 5.23.0] [--onnxruntime SPEC]
                                [--python PATH] [--keep]
    make compat TORCH=2.15.0 [TRANSFORMERS=5.23.0] [ONNXRUNTIME=onnxruntime==1.32.0]
                [COMPAT_PYTHON=python3.12]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The test files that exercise torch itself (beside the graph-level ones, which need none).
TORCH_TESTS = (
    "tests/normexport/test_export.py",
    "tests/normexport/test_load.py",
    "tests/models/test_gallery.py",
)
#: The tests that hold the repository's records of these runs (the table in docs/compat.md,
#: the declared ranges) to ``compat.json``, which a run is in the middle of rewriting: left out.
RECORD_TESTS = (
    "tests/test_docs.py::test_the_compat_table_is_the_measured_one",
    "tests/test_docs.py::test_the_declared_torch_range_is_the_measured_one",
    "tests/test_docs.py::test_the_declared_pythons_are_the_measured_ones",
)
#: The packages whose versions each entry records.
PACKAGES = ("torch", "transformers", "onnx", "onnx_ir", "onnxscript", "onnxruntime", "numpy")


def _run(cmd: list[str], log: Path, **kwargs) -> tuple[int, float]:
    """Run ``cmd`` from the repository root, its output appended to ``log``; (exit code, s)."""
    start = time.perf_counter()
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    return code, round(time.perf_counter() - start, 1)


def versions(python: Path) -> dict[str, str | None]:
    """The installed version of each of :data:`PACKAGES` in the venv of ``python``, its
    Python's (``python``) and which ONNX Runtime distribution it has (``onnxruntime_package``:
    ``onnxruntime-gpu`` or ``onnxruntime``)."""
    probe = (
        "import importlib, importlib.metadata as md, json, platform\nfound = {}\n"
        f"for name in {list(PACKAGES)!r}:\n"
        "    try:\n        found[name] = importlib.import_module(name).__version__\n"
        "    except Exception:\n        found[name] = None\n"
        "found['python'] = platform.python_version()\n"
        "for dist in ('onnxruntime-gpu', 'onnxruntime'):\n"
        "    try:\n        md.version(dist)\n        found['onnxruntime_package'] = dist\n"
        "        break\n    except md.PackageNotFoundError:\n        pass\n"
        "print(json.dumps(found))"
    )
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/")
    return json.loads(out.stdout) if out.returncode == 0 else dict.fromkeys(PACKAGES)


def run_demo(python: Path, scratch: Path, log: Path) -> dict:
    """``make demo``'s run in the venv: each model's exit code, parity and checks."""
    out = scratch / "demo"
    code, seconds = _run([str(python), "-m", "models.demo", "--out", str(out)], log)
    summary = out / "summary.json"
    rows = json.loads(summary.read_text()) if summary.exists() else []
    found = {}
    for row in rows:
        report = row["report"] or {}
        fusions = report.get("fusions", {})
        found[row["model"]] = {
            "exit_code": row["exit_code"],
            "parity_passed": (report.get("parity") or {}).get("passed"),
            "exporter": report.get("exporter"),
            "fusions": {k: v for k, v in fusions.items() if isinstance(v, int) and v},
            "unmet": row["unmet"],
        }
    return {"exit_code": code, "seconds": seconds, "passed": code == 0, "models": found}


def run_tests(python: Path, scratch: Path, log: Path) -> dict:
    """The graph-level tests and :data:`TORCH_TESTS` in the venv: counts and failures."""
    entry = {}
    graph_level = ["-m", "not slow", *(f"--deselect={t}" for t in RECORD_TESTS)]
    for name, selection in (("graph_level", graph_level), ("torch", list(TORCH_TESTS))):
        junit = scratch / f"{name}.xml"
        cmd = [str(python), "-m", "pytest", "-q", "-n", "auto", "-p", "no:cacheprovider"]
        code, seconds = _run([*cmd, f"--junitxml={junit}", *selection], log)
        entry[name] = {"exit_code": code, "seconds": seconds, **_junit(junit)}
    return entry


def _junit(path: Path) -> dict:
    """Passed, failed, skipped and the failing tests' ids from a pytest JUnit XML file."""
    if not path.exists():
        return {"passed": 0, "failed": None, "skipped": 0, "failures": ["no results"]}
    cases = ET.parse(path).getroot().iter("testcase")
    failed, skipped, total = [], 0, 0
    for case in cases:
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            skipped += 1
    passed = total - len(failed) - skipped
    return {"passed": passed, "failed": len(failed), "skipped": skipped, "failures": failed}


def measure(
    torch: str,
    transformers: str | None,
    root: Path,
    keep: bool,
    onnxruntime: str | None = None,
    base: str = sys.executable,
) -> dict:
    """Build the venv for ``torch`` (and ``transformers``, the ``onnxruntime`` requirement,
    the Python ``base``) and run everything in it."""
    name = f"torch-{torch}" + (f"-transformers-{transformers}" if transformers else "")
    name += f"-{onnxruntime}" if onnxruntime else ""
    if base != sys.executable:  # one venv (and log) per Python: make would reuse another's
        probe = [base, "-c", "import platform; print(platform.python_version())"]
        name += "-python-" + subprocess.run(probe, capture_output=True, text=True).stdout.strip()
    venv = root / name
    python = venv / "bin" / "python"
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    log.write_text("")
    entry: dict = {"asked": {"torch": torch, "transformers": transformers}}
    if onnxruntime:
        entry["asked"]["onnxruntime"] = onnxruntime
    runtime = "gpu" if (onnxruntime or "-gpu").split("=")[0].endswith("-gpu") else "cpu"
    make = ["make", "install", f"VENV={venv}", f"TORCH={torch}", f"PYTHON={base}"]
    code, entry["install_s"] = _run([*make, f"RUNTIME={runtime}"], log)
    pins = [f"transformers=={transformers}"] if transformers else []
    pins += [onnxruntime] if onnxruntime else []
    if code == 0 and pins:
        code, seconds = _run([str(python), "-m", "pip", "install", "-q", *pins], log)
        entry["install_s"] += seconds
    entry["installed"] = versions(python)
    entry["install_ok"] = code == 0
    got = entry["installed"]["torch"] or ""
    entry["torch_kept"] = got.split("+")[0] == torch
    if code == 0:
        with tempfile.TemporaryDirectory(prefix="compat-") as tmp:
            entry["demo"] = run_demo(python, Path(tmp), log)
            entry["tests"] = run_tests(python, Path(tmp), log)
    entry["passed"] = bool(
        entry["install_ok"]
        and entry["torch_kept"]
        and entry.get("demo", {}).get("passed")
        and all(t["failed"] == 0 for t in entry.get("tests", {}).values())
    )
    entry["log"] = str(log.relative_to(ROOT)) if log.is_relative_to(ROOT) else str(log)
    if not keep:
        shutil.rmtree(venv, ignore_errors=True)
    return entry


def machine() -> dict:
    """This machine, as each entry records it."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
    }


def table(results: dict) -> str:
    """The markdown table of ``docs/compat.md``: one row per entry."""
    head = (
        "| torch | Python | ONNX Runtime | transformers | onnxscript | install keeps torch | "
        "demo (7 models) | graph-level tests | torch tests | time (install + runs) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = []
    for entry in sorted(results.values(), key=_order):
        got = entry["installed"]
        demo = entry.get("demo", {})
        models = demo.get("models", {})
        ok = sum(m["exit_code"] == 0 and not m["unmet"] for m in models.values())
        tests = entry.get("tests", {})
        seconds = entry["install_s"] + demo.get("seconds", 0)
        seconds += sum(t["seconds"] for t in tests.values())

        def counts(kind: str, tests=tests) -> str:
            t = tests.get(kind)
            return f"{t['passed']} passed, {t['failed']} failed" if t else "-"

        python = got.get("python") or entry["machine"]["python"]
        runtime = f"{got.get('onnxruntime_package', 'onnxruntime-gpu')} {got['onnxruntime']}"
        rows.append(
            f"| {got['torch']} | {python} | {runtime} | {got['transformers']} | "
            f"{got['onnxscript']} | "
            f"{'yes' if entry['torch_kept'] else 'no'} | "
            f"{f'{ok} of {len(models)} pass' if models else '-'} | {counts('graph_level')} | "
            f"{counts('torch')} | {seconds / 60:.0f} min |"
        )
    return head + "\n".join(rows) + "\n"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".") if p.isdigit())


def _order(entry: dict) -> tuple:
    """Rows by torch, then Python, then ONNX Runtime's package and version."""
    got = entry["installed"]
    python = got.get("python") or entry["machine"]["python"]
    return (
        _key(entry["asked"]["torch"]),
        _key(python),
        got.get("onnxruntime_package", "onnxruntime-gpu"),
        _key(got["onnxruntime"] or "0"),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", required=True, help="the torch release, e.g. 2.15.0")
    p.add_argument("--transformers", help="a transformers release to install over the chosen one")
    p.add_argument("--root", type=Path, default=ROOT / ".compat", help="where the venvs go")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--keep", action="store_true", help="keep the venv (GBs) afterwards")
    p.add_argument("--onnxruntime", help="an ONNX Runtime requirement, e.g. onnxruntime==1.32.0")
    p.add_argument("--python", default=sys.executable, help="the Python the venv is made with")
    args = p.parse_args(argv)
    entry = measure(
        args.torch, args.transformers, args.root, args.keep, args.onnxruntime, args.python
    ) | {"machine": machine()}
    path = args.out / "compat.json"
    results = json.loads(path.read_text())["runs"] if path.exists() else {}
    key = f"torch {args.torch}"
    if args.transformers:
        key += f", transformers {args.transformers}"
    if args.onnxruntime:
        key += f", {args.onnxruntime}"
    if args.python != sys.executable:
        key += f", Python {entry['installed'].get('python')}"
    results[key] = entry
    path.write_text(json.dumps({"runs": results}, indent=2) + "\n")
    print(table(results))
    print(f"compat: {key}: {'passed' if entry['passed'] else 'FAILED'} (log: {entry['log']})")
    return 0 if entry["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
