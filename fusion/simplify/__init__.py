"""Exact simplifications of the index arithmetic the exporters write, run by the clean-up
(:func:`fusion.cleanup.cleanup`): :func:`simplify` on the graph as it is (opset 13 and above),
:func:`with_shapes` once the values carry the shapes inference gives
(:class:`fusion.FillShapes`).

Each rewrite, its conditions and its sources: see docs/fusions/cleanup.md.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion.simplify.batched import bias_before_split, unmerge_batched_matmuls
from fusion.simplify.index import (
    composed_axes,
    flat_index_grids,
    merge_unsqueezes,
    slice_index_grids,
)
from fusion.simplify.neutral import (
    drop_neutral_expands,
    drop_neutral_ops,
    drop_same_type_casts,
    drop_whole_slices,
    explicit_softmax_axis,
    fold_known_sizes,
)
from fusion.simplify.split import split_slices
from fusion.simplify.views import unify_reshape_symbols

__all__ = ["composed_axes", "simplify", "with_shapes"]


def simplify(graph: ir.Graph, final: bool = False) -> int:
    """Apply :func:`.index.merge_unsqueezes`, :func:`.index.slice_index_grids`,
    :func:`.neutral.drop_neutral_ops`, :func:`.neutral.explicit_softmax_axis` (and with
    ``final``, :func:`.split.split_slices`) to
    ``graph``, the main graph of a model of opset 13 or above, in place; return how many
    rewrites were made."""
    done = merge_unsqueezes(graph) + slice_index_grids(graph) + drop_neutral_ops(graph)
    done += explicit_softmax_axis(graph)
    return done + (split_slices(graph) if final else 0)


def with_shapes(graph: ir.Graph) -> int:
    """Name the sizes Reshapes' -1 stand for after their inputs' where proven
    (:func:`.views.unify_reshape_symbols`), then apply :func:`.index.merge_unsqueezes` (again:
    it needs ranks),
    :func:`.neutral.fold_known_sizes`, :func:`.neutral.drop_whole_slices`,
    :func:`.neutral.drop_neutral_expands`, :func:`.neutral.drop_same_type_casts` and
    :func:`.index.flat_index_grids`, :func:`.batched.unmerge_batched_matmuls` and
    :func:`.batched.bias_before_split` to ``graph`` in
    place, once its values carry the shapes inference gives (:class:`fusion.FillShapes`);
    return how many rewrites were made (exact wherever those shapes are:
    docs/fusions/cleanup.md)."""
    unify_reshape_symbols(graph)  # names only: not a rewrite of the graph
    done = merge_unsqueezes(graph) + fold_known_sizes(graph) + drop_whole_slices(graph)
    done += drop_neutral_expands(graph) + drop_same_type_casts(graph)
    done += flat_index_grids(graph) + unmerge_batched_matmuls(graph)
    return done + bias_before_split(graph)
