"""The fuzzer's runner: mutated ONNX files (:mod:`tests.fuzz.mutate`), each run through the CLI
as a new user would (a subprocess, from a folder of its own, the output written elsewhere), and
checked against the promises of docs/errors.md: exit 0, 1 or 2 with no traceback, no signal,
no hang, the input unchanged, nothing written outside the output's folder, no partial output
left where the run failed.

    python -m tests.fuzz.run [--n 40] [--first 0] [--out DIR]     # make fuzz N=300

Seeds: ONNX Runtime's fusion test models (``tests/data/ort/``, :mod:`tests.support.peer`), and
two small models built here (a hand-written LayerNorm after a MatMul, one with its
weight in external data). Prints one line per case and the counts; exit 1 on any violation.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.fuzz.mutate import mutate
from tests.support.peer import FILES, ORT

ROOT = Path(__file__).resolve().parents[2]
#: A case's wall-clock limit (s): a run past it is a hang. The CLI's own --run-timeout is less.
HANG_S = 240
#: The seeds from the peer folder: the small ones (kB), for speed.
SEED_BYTES = 200_000


@dataclasses.dataclass
class Case:
    """One mutated file and what the CLI did with it."""

    seed: int
    source: str
    mutation: str
    code: int | None
    seconds: float
    violations: list[str]
    line: str


def _built_seeds(folder: Path) -> list[Path]:
    """Two small models: MatMul then a hand-written LayerNorm; the same with the MatMul's
    weight in an external data file."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    consts = [
        numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("eps", 1e-5), ("two", 2))
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["m"], axes=[-1]),
        helper.make_node("Sub", ["h", "m"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["v"], axes=[-1]),
        helper.make_node("Add", ["v", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
        helper.make_node("Div", ["d", "s"], ["y"]),
    ]
    shape = [2, 4, 8]
    graph = helper.make_graph(
        nodes,
        "seed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [w, *consts],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    plain, external = folder / "layernorm.onnx", folder / "external" / "model.onnx"
    onnx.save(model, plain)
    external.parent.mkdir()
    onnx.save(model, external, save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)  # fmt: skip
    return [plain, external]


def seeds(folder: Path) -> list[Path]:
    """The seed files: the peer models (sorted, the small ones) and :func:`_built_seeds`."""
    peer = [p for p in FILES if p.parent == ORT and p.stat().st_size < SEED_BYTES]
    return [*peer, *_built_seeds(folder)]


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> SHA-256)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def run_case(seed: int, sources: list[Path], scratch: Path) -> Case:
    """Mutate ``sources[seed % len]`` by ``seed``, run the CLI on it, check the promises."""
    source = sources[seed % len(sources)]
    data, mutation = mutate(source.read_bytes(), seed)
    case = scratch / f"case{seed}"
    given, out, cwd = case / "in", case / "out", case / "cwd"
    for folder in (given, out, cwd):
        folder.mkdir(parents=True)
    for extra in source.parent.glob(f"{source.name}.data"):
        (given / extra.name).write_bytes(extra.read_bytes())
    (given / source.name).write_bytes(data)
    before = _tree(case)
    argv = [str(given / source.name), "-o", str(out / "model.onnx"), "--no-benchmark"]
    argv += ["--provider", "cpu", "--run-timeout", "60"]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    try:
        ran = subprocess.run(
            [sys.executable, "-m", "normexport", *argv],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_S,
        )  # fmt: skip
        code, err = ran.returncode, ran.stderr
    except subprocess.TimeoutExpired:
        code, err = None, ""
    seconds = time.perf_counter() - start
    violations = _violations(code, err, before, _tree(case))
    lines = err.strip().splitlines()
    return Case(seed, source.name, mutation, code, seconds, violations, lines[-1] if lines else "")


def _violations(code: int | None, err: str, before: dict, after: dict) -> list[str]:
    """What broke a promise of docs/errors.md."""
    found = []
    if code is None:
        found.append("hang")
    elif code < 0 or code >= 128:
        found.append(f"signal {code}")
    elif code not in (0, 1, 2):
        found.append(f"exit {code}")
    if "Traceback" in err:
        found.append("traceback")
    if any(after.get(k) != v for k, v in before.items()):
        found.append("input modified")
    new = [k for k in after if k not in before]
    if any(not k.startswith("out/") for k in new):
        found.append("outside the output's folder")
    if code not in (0, 1) and any(k.startswith("out/") for k in new):
        found.append("partial output left")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40, help="cases")
    parser.add_argument("--first", type=int, default=0, help="the first case's seed")
    parser.add_argument("--out", type=Path, help="keep the cases here (default: a temp dir)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="normexport-fuzz-") as tmp:
        scratch = args.out or Path(tmp)
        sources = seeds(Path(tmp))
        cases = []
        for seed in range(args.first, args.first + args.n):
            case = run_case(seed, sources, scratch)
            cases.append(case)
            mark = "FAIL " + ", ".join(case.violations) if case.violations else "ok"
            print(f"{case.seed:4d} {case.mutation:10} {case.source[:40]:40} exit {case.code} "
                  f"{case.seconds:5.1f} s {mark}: {case.line[:110]}", flush=True)  # fmt: skip
    codes = collections.Counter(c.code for c in cases)
    broken = collections.Counter(v for c in cases for v in c.violations)
    print(f"{len(cases)} cases in {time.perf_counter() - start:.0f} s; exits {dict(codes)}; "
          f"violations {dict(broken) or 'none'}")  # fmt: skip
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
