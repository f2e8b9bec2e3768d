"""One table-driven end-to-end test over the zoo: save as a user would, run the main job.

Each zoo model is saved in its demo format (pickle, state_dict, TorchScript, .pt2, .onnx),
run through :func:`normexport.pipeline.run` on the CPU provider without timing, as ``make demo``
runs it, and must pass parity, meet what :data:`models.demo.EXPECTED` says of it, and publish
no node that the raw export would not have unless a rewrite made it (issue 52, as
``tests/normexport/test_published_ops.py`` checks it on small modules).
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest
import torch

import models
from fusion.base import Op
from models.demo import EXPECTED, demo_options, save_model_file
from normexport import pipeline
from normexport.io import files
from tests.support.graphs import excess_ops

pytestmark = pytest.mark.slow  # runs the pipeline end to end on real models


#: What a rewrite writes beside the ops its kind declares, per zoo model: GroupQueryAttention
#: takes the query's batch and length as inputs, read by Gathers of its shape
#: (fusion/fuse_gqa/build.py, ``sizes``).
WRITTEN = {"llama-tiny": (Op("Gather"),)}


def _raw_export(zoo: models.ZooModel, saved: Path, path: Path) -> ir.Model:
    """What ``torch.onnx.export`` with its defaults makes of the file ``make demo`` saved (the
    module it holds; llama-tiny's ``torch.export`` program; crepe-full's TorchScript archive,
    which only the TorchScript exporter takes), or the ONNX file as it ships."""
    if zoo.module is None:
        return ir.load(zoo.onnx_path)
    args = tuple(torch.from_numpy(a) for a in zoo.inputs.values())
    if saved.suffix == ".pt2":
        torch.onnx.export(torch.export.load(saved), args, path)
    elif zoo.name == "crepe-full":
        torch.onnx.export(torch.jit.load(saved), args, path, dynamo=False)
    else:
        torch.onnx.export(zoo.module, args, path)
    return ir.load(path)


@pytest.mark.parametrize("name", list(models.ZOO))
def test_zoo_model_end_to_end(name, tmp_path):
    zoo = models.load(name)
    (tmp_path / "demo").mkdir()
    opts = demo_options(zoo, tmp_path / "demo", provider="cpu", output=None)
    result = pipeline.run(opts)
    report = result.to_dict()

    failures = report["parity"]["failures"]
    assert report["parity"]["passed"], failures[:3]
    # every rewrite is exact: no output beyond float32 noise, no export difference, no rollback
    assert not report["parity"]["warnings"], report["parity"]["warnings"][:3]
    assert not report["parity"]["export_failures"] and report["rollback"] is None
    for description, holds in EXPECTED[name]:
        assert holds(report), f"{name}: {description}: {report['fusions']} {report['norm_ops']}"
    published = files.default_output(Path(opts.model))
    assert published.exists()
    raw = _raw_export(zoo, Path(opts.model), tmp_path / "raw.onnx")
    excess = excess_ops(raw, ir.load(published), result.fusions.counts, WRITTEN.get(name, ()))
    assert excess == {}


def test_a_torch_that_cannot_keep_the_axes_symbolic_saves_the_example_shapes(
    tmp_path, monkeypatch, capsys
):
    """``make demo`` saves llama-tiny with symbolic batch and sequence; a torch whose
    torch.export cannot (2.10 with transformers 5.24) gets the example's shapes, said once."""
    import torch

    real = torch.export.export

    def export(module, args, *rest, dynamic_shapes=None, **kwargs):
        if dynamic_shapes is not None:
            raise RuntimeError("Constraints violated (sequence)!")
        return real(module, args, *rest, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    path, _ = save_model_file(models.load("llama-tiny"), tmp_path)
    program = torch.export.load(path)
    shapes = [tuple(v.meta["val"].shape) for v in program.graph.nodes if v.op == "placeholder"]
    assert all(isinstance(d, int) for shape in shapes for d in shape), shapes
    assert "saved with the example's shapes" in capsys.readouterr().err
