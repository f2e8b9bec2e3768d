"""Compute only the rows the outputs read.

A classifier that reads one token of its last hidden state (the class token of a ViT, BERT's
pooler, an attention pooling's query) computes its last block for every token. Where a
constant selection of rows (``Gather`` of a constant index, ``Slice`` of a constant range)
reads the output of an op that computes each row from the same row of its inputs (elementwise
ops, MatMul / Gemm rows, norms over the trailing axes, GELU, the views that keep the axis, and
the query side of an attention), the selection moves above that op, which then computes the
selected rows only; it stops at anything that reads other rows (an attention's keys and values,
a norm or convolution over the axis, a Reshape that merges it) and at a value read whole
elsewhere. The kept rows are computed by the same kernels on the same values: the outputs are
the same, up to the reordering of a kernel's sums over a shorter axis. The rules:
:mod:`.rules`; docs/fusions.md, "Rows nobody reads".
"""

from fusion.prune_rows.fusion_pass import PruneRows

__all__ = ["PruneRows"]
