"""normexport: PyTorch -> ONNX with BatchNorm folded and LayerNorm / RMSNorm fused, parity
proven against PyTorch and latency measured on ONNX Runtime.

Python API (the CLI's twin)::

    from normexport.pipeline import Options, run

    report = run(Options(model=Path("model.pt"), input_shape=["1,3,224,224"], trust_pickle=True))
"""

__version__ = "0.1.0"
