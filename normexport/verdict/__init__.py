"""The verdict: parity against the oracle, the oracle itself, the hidden-state probe, and
the rollback of rewrites that ONNX Runtime rejects or that change the function."""
