"""Kernels for ``onnx.reference`` (the ONNX spec's numpy evaluator), on which
``benchmarks/precision.py`` runs each converter's float16 model as written (the CPU-independent
evidence), in place of its own where onnx 1.23's are wrong or missing."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def reference_ops() -> list[type]:
    """Kernels for ``onnx.reference`` (its ``new_ops``) in place of its own where onnx 1.23's
    are wrong or missing: see :func:`_reference_fixes` and :func:`_reference_norms`."""
    return [*_reference_fixes(), *_reference_norms()]


def _reference_fixes() -> list[type]:
    """Kernels for ``onnx.reference`` in place of its own where onnx 1.23's are wrong.

    - ``BatchNormalization`` in inference mode: the opset-9 kernel takes a ``momentum``
      attribute for training mode and normalizes with the batch's statistics; exporters
      (Paddle's among them) write ``momentum`` in inference models. A node with one output is
      in inference mode at every opset (ONNX spec, BatchNormalization-9, -14, -15):
      ``y = scale * (x - mean) / sqrt(var + epsilon) + B`` per channel (axis 1).
    - ``GatherElements``: its kernel gathers with ``np.choose``, which takes at most 64
      choices; along a longer axis it fails or, for 2-D data, gathers the wrong elements (a
      BERT export's token-type buffer, 512 long). ONNX spec, GatherElements-13:
      ``out[i][j] = data[index[i][j]][j]`` for axis 0, shaped as ``indices``; ``indices`` may
      be shorter than ``data`` on any axis.
    """
    from onnx.reference.op_run import OpRun

    class BatchNormalization(OpRun):
        op_domain = ""

        def _run(self, x, scale, bias, mean, var, epsilon=1e-5, **_):
            if len(self.onnx_node.output) > 1:
                raise NotImplementedError("BatchNormalization in training mode")
            shape = (1, -1) + (1,) * (x.ndim - 2)
            y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + epsilon)
            return ((y * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype),)

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=0):
            axis %= data.ndim
            window = tuple(
                slice(None) if a == axis else slice(0, n) for a, n in enumerate(indices.shape)
            )
            indices = np.where(indices < 0, indices + data.shape[axis], indices)
            return (np.take_along_axis(data[window], indices, axis=axis),)

    return [BatchNormalization, GatherElements]


def _reference_norms() -> list[type]:
    """``LayerNormalization``, ``RMSNormalization`` and ONNX Runtime's
    ``SimplifiedLayerNormalization`` (its RMSNorm, registered in the default domain) for
    ``onnx.reference``: onnx 1.23's kernels refuse ``stash_type`` 11 (float64), which the
    widened graph sets, and compute float16 input in float16 whatever ``stash_type`` says.
    As the ONNX spec's function bodies define them (LayerNormalization-17, RMSNormalization-23):
    statistics over the axes from ``axis`` on, in ``stash_type``; the normalized value cast back
    to the input's type, then ``* scale (+ B)`` in that type.
    """
    from onnx.reference.op_run import OpRun

    class LayerNormalization(OpRun):
        op_domain = ""

        def _run(self, x, scale, bias=None, axis=-1, epsilon=1e-5, stash_type=1):
            return (_normalized(x, scale, bias, axis, epsilon, stash_type, centred=True),)

    class RMSNormalization(OpRun):
        op_domain = ""

        def _run(self, x, scale, axis=-1, epsilon=1e-5, stash_type=1):
            return (_normalized(x, scale, None, axis, epsilon, stash_type, centred=False),)

    class SimplifiedLayerNormalization(RMSNormalization):
        pass

    return [LayerNormalization, RMSNormalization, SimplifiedLayerNormalization]


def _normalized(x, scale, bias, axis, epsilon, stash_type, centred) -> np.ndarray:
    """A LayerNorm (``centred``) or RMSNorm of ``x`` (see :func:`_reference_norms`)."""
    wide = x.astype(np.float64 if stash_type == ir.DataType.DOUBLE else np.float32)
    axes = tuple(range(axis % x.ndim, x.ndim))
    if centred:
        wide = wide - wide.mean(axis=axes, keepdims=True)
    y = (wide / np.sqrt(np.square(wide).mean(axis=axes, keepdims=True) + epsilon)).astype(x.dtype)
    y = y * scale
    return (y + bias if bias is not None else y).astype(x.dtype)
