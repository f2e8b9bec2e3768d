"""One table-driven end-to-end test over the zoo: save as a user would, run the main job.

Each zoo model is saved in its demo format (pickle, state_dict, TorchScript, .pt2, .onnx),
run through :func:`normexport.pipeline.run` without timing, and must pass parity and meet what
:data:`models.demo.EXPECTED` says of it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import models
from models.demo import EXPECTED, save_model_file
from normexport import pipeline
from normexport.io import files

pytestmark = pytest.mark.slow  # runs the pipeline end to end on real models


@pytest.mark.parametrize("name", list(models.ZOO))
def test_zoo_model_end_to_end(name, tmp_path):
    zoo = models.load(name)
    path, flags = save_model_file(zoo, tmp_path)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **zoo.inputs)
    opts = pipeline.Options(model=path, inputs=inputs, benchmark=False)
    if "--trust-pickle" in flags:
        opts = dataclasses.replace(opts, trust_pickle=True)
    if "--model-class" in flags:
        opts = dataclasses.replace(opts, model_class=flags[flags.index("--model-class") + 1])
    report = pipeline.run(opts).to_dict()

    failures = report["parity"]["failures"]
    assert report["parity"]["passed"], failures[:3]
    # every rewrite is exact: no output beyond float32 noise, no export difference, no rollback
    assert not report["parity"]["warnings"], report["parity"]["warnings"][:3]
    assert not report["parity"]["export_failures"] and report["rollback"] is None
    for description, holds in EXPECTED[name]:
        assert holds(report), f"{name}: {description}: {report['fusions']} {report['norm_ops']}"
    assert files.default_output(path).exists()


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
