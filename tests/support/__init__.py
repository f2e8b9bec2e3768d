"""What the tests share: graphs built node by node and run on ONNX Runtime (``graphs``; norms,
attention and re-parameterizable blocks in ``norm_graphs``, ``attention_graphs`` and
``reparam_graphs``), PyTorch exports (``exported``; a BERT layer in ``encoders``, decoders in
``decoder_testing``, norms against PyTorch in ``norm_testing``) and FoldBatchNorm's run
(``folding``). Imported as ``tests.support.<module>``: the repository root is on pytest's
``pythonpath`` (pyproject.toml)."""
