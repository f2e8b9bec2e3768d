"""normexport.io.quiet: what each context manager changes while it runs, and that it puts it
back; the process's streams are swapped only where a library prints with no switch."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest

from normexport.io.quiet import quiet, swallow_prints


def test_quiet_raises_loggers_and_leaves_the_streams_alone(capsys):
    logger = logging.getLogger("normexport_test_quiet")
    logger.setLevel(logging.INFO)
    streams = (sys.stdout, sys.stderr)
    with quiet("normexport_test_quiet"):
        assert (sys.stdout, sys.stderr) == streams
        assert logger.level == logging.ERROR
        warnings.warn("ignored inside the block", UserWarning, stacklevel=1)
        print("printed")
    assert logger.level == logging.INFO
    assert capsys.readouterr() == ("printed\n", "")


def test_swallow_prints_swallows_the_named_streams_only(capsys):
    streams = (sys.stdout, sys.stderr)
    with swallow_prints("stderr"):
        print("to stdout")
        print("to stderr", file=sys.stderr)
    assert (sys.stdout, sys.stderr) == streams
    assert capsys.readouterr() == ("to stdout\n", "")
    with pytest.raises(ValueError, match="stdin"), swallow_prints("stdin"):
        pass


@pytest.mark.slow
def test_failed_dynamo_export_prints_nothing(capsys):
    """A branch on a tensor's value fails the dynamo exporter: torch.export prints the partial
    graph to sys.stderr, torch.onnx its progress to stdout unless verbose=False; the user sees
    neither, and the TorchScript exporter takes over."""
    import torch
    from torch import nn

    from normexport.io.export import export_module

    class Branchy(nn.Module):
        def forward(self, x):
            return x + 1 if x.sum() > 0 else x - 1

    exported = export_module(Branchy(), (torch.ones(2, 3),))
    assert exported.exporter == "torchscript" and exported.fallback_reason
    assert capsys.readouterr() == ("", "")
