"""Helpers shared by the LayerNorm and RMSNorm pass tests: probes, tolerances, export."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

from tests.support import exported
from tests.support.graphs import cpu_session, mismatch

SHAPE = (2, 3, 16)


def probes(shape=SHAPE, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random rows and the inputs that make eps matter."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    found = {
        "random": x,
        "constant rows": torch.full(shape, 3.0) + torch.arange(shape[-2]).view(-1, 1),
        "zeros": torch.zeros(shape),
        "1e-4 scale": x * 1e-4,
        "1e3 scale": x * 1e3,
    }
    return {name: t.to(dtype) for name, t in found.items()}


def assert_matches(out: np.ndarray, ref: np.ndarray, what: str, rtol: float = 1e-3) -> None:
    """No NaN/Inf where torch has none; max abs err <= 1e-4 + rtol * max |ref|."""
    why = mismatch(out, ref, atol=1e-4, rtol=rtol)
    assert why is None, f"{what}: {why}"


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters()), torch.float32)


def check_against_torch(
    module: torch.nn.Module, model: ir.Model, dtype: torch.dtype | None = None, **kwargs
) -> None:
    """ORT on ``model`` matches ``module`` in eager mode on every probe (inputs of ``dtype``,
    by default the module's)."""
    session = cpu_session(model)
    for name, x in probes(dtype=dtype or module_dtype(module)).items():
        with torch.no_grad():
            ref = module(x).float().numpy()
        out = session.run(None, {"x": x.numpy()})[0].astype(np.float32)
        assert_matches(out, ref, name, **kwargs)


def export(
    module: torch.nn.Module, exporter: str, opset: int, dtype: torch.dtype | None = None
) -> ir.Model:
    """Export ``module`` on the random probe (of ``dtype``, by default the module's)."""
    x = probes(dtype=dtype or module_dtype(module))["random"]
    model = exported.export(module, (x,), opset=opset, input_names=["x"], exporter=exporter)
    assert model.opset_imports[""] == opset
    return model


def op_types(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def assert_within_float16_ulp(fused: ir.Model, unfused: ir.Model) -> None:
    """On every float16 probe the fused model is within one float16 ulp of the unfused one."""
    fused_session, unfused_session = cpu_session(fused), cpu_session(unfused)
    for name, x in probes(dtype=torch.float16).items():
        expected = unfused_session.run(None, {"x": x.numpy()})[0].astype(np.float32)
        got = fused_session.run(None, {"x": x.numpy()})[0].astype(np.float32)
        ulp = 2.0**-10 * 2.0 ** np.floor(np.log2(np.maximum(np.abs(expected), 2.0**-14)))
        assert (np.abs(got - expected) <= ulp).all(), f"{name}: more than 1 float16 ulp apart"
