"""normexport.io.load on torch.export archives: transformers outputs, hostile pickles, bad files.

A transformers model's ``ModelOutput`` is known to torch's pytree only in a process that has
imported the module defining it; the tests that load such a program therefore load it in a
fresh Python process (the test process itself has imported transformers to build the model).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from normexport import cli
from normexport.errors import InputFileError, UsageError
from normexport.io.load import load_model

pytestmark = pytest.mark.slow  # loads torch.export programs and runs the CLI on them

ROOT = Path(__file__).resolve().parents[2]


def python(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run this venv's Python with the repository's packages importable, from ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def randomize_norms(model: nn.Module) -> None:
    """Norm weights (and biases) away from the 1 / 0 of default init."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower():
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)


# --- transformers models -----------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def tiny_llama(transformers, **config):
    """A 2-layer LLaMA, its heads of 16 (ONNX Runtime's CPU GroupQueryAttention takes no
    other size: with heads of 8 the fused attention is rolled back, seconds per run)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        **config,
    )
    model = transformers.LlamaModel(cfg).eval()
    randomize_norms(model)
    return model


def tiny_bert(transformers):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=100,
        max_position_embeddings=64,
    )
    model = transformers.BertModel(cfg).eval()
    randomize_norms(model)
    return model


def save_program(model, path: Path, ids: torch.Tensor, kwargs=None) -> torch.Tensor:
    """Export and save ``model``; returns its ``last_hidden_state`` on ``ids``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    program = torch.export.export(model, (ids,), kwargs=kwargs, strict=False)
    torch.export.save(program, path)
    with torch.no_grad():
        return model(ids, **(kwargs or {})).last_hidden_state


LOAD_AND_RUN = """
import sys, torch
from normexport.io.load import load_model

loaded = load_model(sys.argv[1])
ids = torch.from_numpy(loaded.example_inputs["input_ids"])
out = loaded.module.module()(ids, use_cache=False)
print(type(out).__name__, list(out), "transformers" in sys.modules)
torch.save(out.last_hidden_state, sys.argv[2])
"""


def test_llama_program_loads_in_a_fresh_process(transformers, tmp_path):
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    path = tmp_path / "model" / "llama.pt2"
    expected = save_program(tiny_llama(transformers), path, ids, {"use_cache": False})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = python("-c", LOAD_AND_RUN, str(path), str(tmp_path / "out.pt"), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # torch's ~35 lines of warnings are kept quiet
    # a mapping in place of BaseModelOutputWithPast, with transformers never imported
    assert result.stdout.split() == ["BaseModelOutputWithPast", "['last_hidden_state']", "False"]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["bert", "llama", "llama_kwargs"])
def test_transformers_program_through_the_cli(transformers, tmp_path, name):
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    # LLaMA with use_cache off in its config: no kwargs, so the program is called positionally;
    # llama_kwargs: exported with kwargs={"use_cache": False}, and called the same way
    kwargs = {"use_cache": False} if name == "llama_kwargs" else None
    if name == "bert":
        model = tiny_bert(transformers)
    elif kwargs:
        model = tiny_llama(transformers)
    else:
        model = tiny_llama(transformers, use_cache=False)
    path = tmp_path / "model" / f"{name}.pt2"
    expected = save_program(model, path, ids, kwargs)
    out_dir, report = tmp_path / "out", tmp_path / "report" / "r.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = ["--no-benchmark", "--provider", "cpu", "-o", out_dir / "m.onnx", "--report", report]
    argv.append("--make-dirs")  # as a user who asks for the folders to be made
    result = python("-m", "normexport", str(path), *map(str, argv), cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    parity = json.loads(report.read_text())["parity"]
    assert parity["passed"] and parity["reference"] == "pytorch"
    assert all(o["max_abs_err"] < 1e-5 for o in parity["outputs"].values())
    # and the written model against the original transformers model, not only the program
    session = ort.InferenceSession(out_dir / "m.onnx", providers=["CPUExecutionProvider"])
    (feed,) = session.get_inputs()
    got = session.run(None, {feed.name: ids.numpy()})[0]
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-4, atol=1e-5)
    assert not list(elsewhere.iterdir())  # nothing written in the working directory


def test_known_output_types_are_not_replaced(transformers, tmp_path):
    """In a process that has the real ModelOutput registered, the program returns it."""
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

    ids = torch.randint(0, 100, (1, 5))
    path = tmp_path / "bert.pt2"
    expected = save_program(tiny_bert(transformers), path, ids)
    out = load_model(path).module.module()(ids)
    assert type(out) is BaseModelOutputWithPoolingAndCrossAttentions
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=0, atol=1e-6)


def test_stand_in_keys():
    """Keys from the saved context; a context that is not one key per child gives 0, 1, ..."""
    from torch.utils import _pytree as pytree

    from normexport.io.program import StandIn, _stand_in

    leaf = {"type": None, "context": None, "children_spec": []}

    def spec(context: str) -> str:
        node = {"type": "nowhere.Output", "context": context, "children_spec": [leaf, leaf]}
        return json.dumps([1, node])

    _stand_in("nowhere.Output")
    out = pytree.tree_unflatten([1, 2], pytree.treespec_loads(spec('["a", "b"]')))
    assert isinstance(out, StandIn) and out == {"a": 1, "b": 2} and out.b == 2
    assert pytree.tree_leaves(out) == [1, 2]
    assert pytree.treespec_loads(pytree.treespec_dumps(pytree.tree_structure(out))) is not None
    for context in ('["a"]', '["a", "a"]', "not json", '{"x": 1}'):
        out = pytree.tree_unflatten([1, 2], pytree.treespec_loads(spec(context)))
        assert out == {0: 1, 1: 2}


# --- pickles and broken archives ----------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.c = torch.randn(3)  # a plain attribute: a lifted tensor constant

    def forward(self, x):
        return self.lin(x) + self.c


class Hostile:
    """Unpickling this creates ``marker`` (stands for any code a pickle can run)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def tiny_program(path: Path) -> Path:
    torch.export.save(torch.export.export(Tiny().eval(), (torch.randn(2, 4),)), path)
    return path


def rewrite(path: Path, edit) -> None:
    """Replace entries of the zip at ``path``: ``edit(name relative to the root, bytes)``."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries:
            root, _, rel = name.partition("/")
            archive.writestr(name, edit(rel, data))


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def make_hostile(path: Path, where: str, marker: Path) -> Path:
    """A real archive with one entry replaced by a pickle that creates ``marker``."""
    tiny_program(path)
    payload = pickled(Hostile(marker))

    def edit(rel: str, data: bytes) -> bytes:
        if where in ("weight", "constant"):
            config = f"data/{where}s/model_{where}s_config.json"
            first = "weight_0" if where == "weight" else "tensor_0"
            if rel == config:
                doc = json.loads(data)
                for meta in doc["config"].values():
                    if meta["path_name"] == first:
                        meta["use_pickle"] = True
                return json.dumps(doc).encode()
            if rel == f"data/{where}s/{first}":
                return payload
        if where == "sample_inputs" and rel == "data/sample_inputs/model.pt":
            return pickled(((Hostile(marker),), {}))
        return data

    rewrite(path, edit)
    return path


WHERE = ["weight", "constant", "sample_inputs"]


@pytest.mark.parametrize("where", WHERE)
def test_hostile_pickle_is_refused(tmp_path, capsys, where):
    marker = tmp_path / "pwned"
    path = make_hostile(tmp_path / "m.pt2", where, marker)
    env = dict(os.environ)
    with pytest.raises(InputFileError, match="--trust-pickle") as caught:
        load_model(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    assert not marker.exists()
    assert dict(os.environ) == env
    code = cli.main([str(path), "--no-benchmark", "--provider", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "--trust-pickle" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()


@pytest.mark.parametrize("where", WHERE)
def test_hostile_archive_does_run_code_when_trusted(tmp_path, where):
    """The fixture is hostile: torch.export.load, and --trust-pickle, do run its pickle."""
    marker = tmp_path / "pwned"
    path = make_hostile(tmp_path / "m.pt2", where, marker)
    with contextlib.suppress(Exception):  # it may choke on what the pickle made, or not
        torch.export.load(path)
    assert marker.exists()
    marker.unlink()
    with contextlib.suppress(UsageError):
        load_model(path, trust_pickle=True)
    assert marker.exists()


def test_trusted_clean_archive_loads(tmp_path):
    path = tiny_program(tmp_path / "m.pt2")
    for trust in (False, True):
        loaded = load_model(path, trust_pickle=trust)
        assert loaded.kind == "exported_program" and list(loaded.example_inputs) == ["x"]


def break_json(rel: str, data: bytes) -> bytes:
    return data[: len(data) // 2] if rel == "models/model.json" else data


def unknown_namedtuple(rel: str, data: bytes) -> bytes:
    if rel != "models/model.json":
        return data
    doc = json.loads(data)
    leaf = {"type": None, "context": None, "children_spec": []}
    node = {"type": "collections.namedtuple", "context": "nowhere.Point", "children_spec": [leaf]}
    doc["graph_module"]["module_call_graph"][0]["signature"]["out_spec"] = json.dumps([1, node])
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("edit", "says"),
    [(break_json, "not a torch.export archive"), (unknown_namedtuple, "nowhere.Point")],
    ids=["truncated-json", "unknown-namedtuple"],
)
def test_unloadable_program_is_a_usage_error(tmp_path, capsys, edit, says):
    path = tiny_program(tmp_path / "m.pt2")
    rewrite(path, edit)
    with pytest.raises(InputFileError, match=says):
        load_model(path)
    code = cli.main([str(path), "--no-benchmark"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"normexport: error: {path}") and says in lines[0]


# --- the user's modules in the current folder ---------------------------------------------

USER_MODULE = "normexport_test_user_net"

USER_CODE = """
from torch import nn


class UserNet(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.lin = nn.Linear(width, 2)

    def forward(self, x):
        return self.lin(x)
"""


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """The current folder holds the user's module and a model saved whole (``whole.pt``) and
    as a state_dict (``weights.pt``); no ``sys.path`` entry reaches it, as under the
    ``normexport`` script."""
    (tmp_path / f"{USER_MODULE}.py").write_text(USER_CODE)
    sys.path.insert(0, str(tmp_path))
    try:
        net = importlib.import_module(USER_MODULE).UserNet()
        torch.save(net, tmp_path / "whole.pt")  # pickling, too, imports the class's module
        torch.save(net.state_dict(), tmp_path / "weights.pt")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(USER_MODULE, None)
    monkeypatch.chdir(tmp_path)
    away = [p for p in sys.path if p and Path(p).resolve() != tmp_path.resolve()]
    monkeypatch.setattr(sys, "path", away)
    yield tmp_path
    sys.modules.pop(USER_MODULE, None)


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("whole.pt", {"trust_pickle": True}),
        ("weights.pt", {"model_class": f"{USER_MODULE}:UserNet", "model_kwargs": {"width": 4}}),
    ],
    ids=["pickled_module", "state_dict"],
)
def test_user_module_is_found_and_sys_path_is_left_as_it_was(user_folder, name, how):
    before = list(sys.path)
    loaded = load_model(name, **how)
    assert sys.path == before
    assert type(loaded.module).__name__ == "UserNet"
    assert loaded.module(torch.ones(1, 4)).shape == (1, 2)


def test_failed_load_leaves_sys_path_as_it_was(user_folder):
    before = list(sys.path)
    with pytest.raises(UsageError, match="cannot build it"):
        load_model("weights.pt", model_class=f"{USER_MODULE}:UserNet", model_kwargs={"x": 1})
    assert sys.path == before
    sys.modules.pop(USER_MODULE, None)
    (user_folder / f"{USER_MODULE}.py").unlink()
    importlib.invalidate_caches()
    with pytest.raises(InputFileError, match="which is not installed here"):
        load_model("whole.pt", trust_pickle=True)
    assert sys.path == before


def test_a_library_that_fails_to_import_is_named(user_folder):
    """A pickled model whose library is installed but fails to import here (torchvision whose
    C++ operators do not load beside this torch: a RuntimeError at import) is said so, with the
    library's name and its error (it was 'cannot unpickle it; is the file complete?')."""
    (user_folder / f"{USER_MODULE}.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    importlib.invalidate_caches()
    with pytest.raises(InputFileError, match=f"needs {USER_MODULE}, which fails to import here"):
        load_model("whole.pt", trust_pickle=True)


def test_a_module_that_is_not_there_is_a_library_to_install_or_code_to_find(user_folder):
    (user_folder / f"{USER_MODULE}.py").unlink()
    importlib.invalidate_caches()
    with pytest.raises(InputFileError, match=f"pip install {USER_MODULE}"):
        load_model("whole.pt", trust_pickle=True)
