"""Does ``pip install 'normexport[cpu]'`` (or ``[gpu]``) resolve on the machines users have,
where this one cannot run them? The project's dependencies resolved for each platform and Python
by uv's resolver (``uv pip compile --python-platform``), which evaluates each dependency's
environment markers for the target: pip's ``--dry-run --platform`` evaluates them for the
machine it runs on, so torch's Linux-only CUDA requirements fail it for macOS.

uv is installed into a venv of its own (``.compat/uv``). Each case records whether it
resolved, which ONNX Runtime distribution and torch it chose, and the resolver's reason where it
did not. The expectation: ``cpu`` resolves everywhere with ``onnxruntime`` and never
``onnxruntime-gpu``; ``gpu`` resolves on Linux x86-64 and fails on macOS and aarch64 (no wheels).
Writes ``benchmarks/results/platforms.json`` and prints the table ``docs/compat.md`` holds.

    python benchmarks/platforms.py          # make compat runs it too
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: (uv's platform name, MACOSX_DEPLOYMENT_TARGET or None): the machines users have.
PLATFORMS = (
    ("aarch64-apple-darwin", "14.0"),
    ("aarch64-unknown-linux-gnu", None),
    ("x86_64-unknown-linux-gnu", None),
    ("x86_64-pc-windows-msvc", None),
)
PYTHONS = ("3.11", "3.12", "3.13")
EXTRAS = ("cpu", "gpu")


def uv() -> Path:
    """uv's executable, installed into ``.compat/uv`` where it is not there yet."""
    venv = ROOT / ".compat" / "uv"
    exe = venv / "bin" / "uv"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "uv"], check=True)
    return exe


def resolve(exe: Path, platform: str, macos: str | None, python: str, extra: str) -> dict:
    """One case: the project with ``extra`` resolved for ``platform`` and ``python``."""
    env = dict(os.environ, MACOSX_DEPLOYMENT_TARGET=macos) if macos else None
    command = [str(exe), "pip", "compile", str(ROOT / "pyproject.toml"), "--extra", extra]
    command += ["--python-platform", platform, "--python-version", python, "--no-header", "-q"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", done.stdout, re.M))
    entry = {"platform": platform, "python": python, "extra": extra}
    entry["resolved"] = done.returncode == 0
    entry["onnxruntime"] = {k: v for k, v in pins.items() if k.startswith("onnxruntime")}
    entry["torch"] = pins.get("torch")
    if done.returncode:
        cause = re.search(r"cause: (.*)", done.stderr)
        entry["why"] = (cause.group(1) if cause else done.stderr.strip()[-300:])[:300]
    return entry


def table(entries: list[dict]) -> str:
    """The cases as docs/compat.md's table."""
    rows = ["| platform | Python | extra | resolves | ONNX Runtime | torch |", "|---" * 6 + "|"]
    for e in entries:
        runtime = ", ".join(f"{k} {v}" for k, v in e["onnxruntime"].items()) or "-"
        done = "yes" if e["resolved"] else "no (no wheels)"
        rows.append(
            f"| {e['platform']} | {e['python']} | `{e['extra']}` | {done} | {runtime} | "
            f"{e['torch'] or '-'} |"
        )
    return "\n".join(rows)


def main() -> int:
    exe = uv()
    entries = [
        resolve(exe, platform, macos, python, extra)
        for platform, macos in PLATFORMS
        for python in PYTHONS
        for extra in EXTRAS
    ]
    bad = [
        e
        for e in entries
        if (e["extra"] == "cpu" and (not e["resolved"] or "onnxruntime-gpu" in e["onnxruntime"]))
        or (e["resolved"] and len(e["onnxruntime"]) != 1)
    ]
    out = ROOT / "benchmarks" / "results" / "platforms.json"
    out.write_text(json.dumps({"cases": entries, "unexpected": bad}, indent=1) + "\n")
    print(table(entries))
    for e in bad:
        print(f"unexpected: {e}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
