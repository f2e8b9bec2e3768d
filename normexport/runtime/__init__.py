"""ONNX Runtime sessions: the one place in normexport where they are made.

Providers are always named explicitly. onnxruntime-gpu lists CUDAExecutionProvider in
``get_available_providers()`` even where the CUDA libraries are missing, and then quietly falls
back to CPU; so a session asked for CUDA is checked with ``sess.get_providers()`` and refused
if CUDA did not load, rather than ever calling a CPU number a CUDA number.
"""

from __future__ import annotations

from normexport.runtime.running import message, run, run_timeout
from normexport.runtime.sessions import (
    AS_WRITTEN,
    CPU,
    CUDA,
    PROVIDERS,
    OnDemand,
    ProviderUnavailable,
    check_session,
    deployed_session,
    load_check,
    make_session,
    max_opset,
    resolve_provider,
)

__all__ = [
    "AS_WRITTEN",
    "CPU",
    "CUDA",
    "PROVIDERS",
    "OnDemand",
    "ProviderUnavailable",
    "check_session",
    "deployed_session",
    "load_check",
    "make_session",
    "max_opset",
    "message",
    "resolve_provider",
    "run",
    "run_timeout",
]
