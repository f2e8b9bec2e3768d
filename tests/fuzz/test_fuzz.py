"""The fuzzer in CI: one mutated file per kind of mutation (:mod:`tests.fuzz.mutate`), each run
through the CLI and held to the promises of docs/errors.md (:mod:`tests.fuzz.run`); ``make fuzz
N=300`` runs more. Each defect the fuzzer found stays below as a regression case."""

from __future__ import annotations

import os
import subprocess
import sys

import onnx
import pytest

from normexport import cli
from tests.fuzz.mutate import STRUCTURED
from tests.fuzz.run import ROOT, run_case, seeds

#: One case per mutation (the seed picks the mutation by its remainder).
CASES = range(len(STRUCTURED) + 1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return seeds(tmp_path_factory.mktemp("seeds"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", CASES)
def test_a_mutated_file_keeps_every_promise(seed, sources, tmp_path):
    case = run_case(seed, sources, tmp_path)
    assert not case.violations, (case.mutation, case.source, case.code, case.line)


def test_an_input_of_undefined_type_is_refused_with_one_line(tmp_path):
    """Found by the fuzzer (a graph input's element type set to UNDEFINED): exit 3, a
    TypeError from numpy; now exit 2 naming the input."""
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Relu", ["x"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.UNDEFINED, [2])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 17)],
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code = cli.main([str(path), "-o", str(tmp_path / "o.onnx"), "--no-benchmark"])
    assert code == 2


def test_a_pass_failing_on_a_model_the_checker_rejects_is_the_files(tmp_path, capsys):
    """Found by the fuzzer (an attribute renamed): a Constant whose value attribute is
    ``no_such_attribute`` loads and runs in ONNX Runtime, but onnx-ir's constant folding raises
    on it: exit 3; now exit 2, the passes' error and the ONNX checker's complaint."""
    value = onnx.helper.make_tensor("t", onnx.TensorProto.FLOAT, [1], [2.0])
    constant = onnx.helper.make_node("Constant", [], ["c"], no_such_attribute=value)
    graph = onnx.helper.make_graph(
        [constant, onnx.helper.make_node("Add", ["x", "c"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    code = cli.main([str(path), "-o", str(tmp_path / "o.onnx"), "--no-benchmark"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "the ONNX checker rejects it" in line, line


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_successful_run_prints_no_library_traceback(tmp_path, debug):
    """Found by the fuzzer (a graph output renamed to an initializer's name): the run passes,
    but onnx-ir's shape inference logged its InferenceError with a traceback on stderr. The
    libraries' log records now go to ``--debug`` only."""
    (source,) = [p for p in seeds(tmp_path) if p.name == "layernorm.onnx"]
    model = onnx.load(source)
    weight = model.graph.initializer[0].name
    model.graph.output.append(onnx.helper.make_tensor_value_info(weight, 1, [2, 4, 8]))
    path = tmp_path / "renamed.onnx"
    onnx.save(model, path)
    argv = [str(path), "-o", str(tmp_path / "o.onnx"), "--no-benchmark", "--provider", "cpu"]
    # a process of its own, as a user runs it: pytest's log capture would take the records
    ran = subprocess.run(
        [sys.executable, "-m", "normexport", *argv, *["--debug"] * debug],
        env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    code, err = ran.returncode, ran.stderr
    assert code == 0, err
    assert ("Traceback" in err) == debug and ("InferenceError" in err) == debug, err
