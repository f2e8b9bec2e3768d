"""Compute only the rows the outputs read: :class:`PruneRows` moves each constant selection of
rows up through the ops that compute row by row, so that they compute the selected rows only.

Which ops it moves through (:mod:`.rules`), where it stops, and why the output is the same: see
docs/fusions/prune_rows.md.
"""

from fusion.prune_rows.fusion_pass import PruneRows

__all__ = ["PruneRows"]
