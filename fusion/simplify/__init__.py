"""Exact simplifications of the index arithmetic the exporters write, run by the clean-up
(:func:`fusion.cleanup.cleanup`). A decoder's attention mask is made of it: on ONNX Runtime's
CPU provider each small node costs a kernel launch, which a decode step of a small model feels
(``benchmarks/results/decoders_cpu.json``).

* :func:`.index.merge_unsqueezes`: ``Unsqueeze(Unsqueeze(x, a), b)`` as one Unsqueeze of the
  composed axes (Operators.md, Unsqueeze-13: the axes count in the output's rank).
* :func:`.index.slice_index_grids`: torch's advanced indexing ``x[i_0, .., i_k-1]`` by aranges
  ``i_j = arange(n_j)`` placed on increasing axes of a grid by Unsqueeze or ``view``
  (transformers' mask reads ``attention_mask[batch_arange, kv_arange]``), as torchlib's
  ``aten_index`` writes it
  (``GatherND(x, Concat(Unsqueeze(Expand(i_j, Shape(Max(i_0, ..))), -1), axis=-1))``), is the
  block ``x[:n_0, .., :n_k-1]`` with unit axes inserted: a Slice and an Unsqueeze. Where an
  ``n_j`` is larger than ``x``'s axis, GatherND fails (index out of bounds) and the Slice
  clamps; everywhere else the two are the same elements.
* :func:`.neutral.drop_neutral_ops`: ``And(x, True)``, ``Or(x, False)``, ``Mul(x, 1)``,
  ``Div(x, 1)``, ``x - 0``, ``x + -0`` as ``x``, and ``x + 0`` where ``x`` is never ``-0``
  (transformers' mask starts from ``ones & causal``; its rotary tables are scaled by
  ``attention_scaling``, 1 but for YaRN and the like; ConvTasNet sums its skips from ``0.0``).
* :func:`.neutral.explicit_softmax_axis`: a Softmax's default ``axis`` (-1) written out
  (tf2onnx leaves it out; attention patterns name it).
* :func:`.split.split_slices`: Slices of one tensor that tile an axis (Phi-3's ``qkv_proj``
  read as the query, key and value) as one Split. Run after the fusion passes only: their
  matchers read the Slices (the rotary embedding's halves, a packed projection).

All need opset 13 or above (Unsqueeze's axes and Split's sizes as inputs).

Once the values carry the shapes inference gives them (:class:`fusion.FillShapes`),
:func:`with_shapes` also folds the sizes of those shapes that are numbers
(:func:`.neutral.fold_known_sizes`), drops the Slices that provably keep a whole tensor
(:func:`.neutral.drop_whole_slices`), the Expands that change nothing
(:func:`.neutral.drop_neutral_expands`) and the Casts to the type a value has
(:func:`.neutral.drop_same_type_casts`), reads torch's TorchScript indexing of a 2-D tensor
by whole aranges as the tensor (:func:`.index.flat_index_grids`): the TorchScript exporter's
shape arithmetic, and a batched MatMul between views that merge its batch axes as the MatMul
of their sources (:func:`.batched.unmerge_batched_matmuls`: tf2onnx's Einsum).
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
    return how many rewrites were made. Exact wherever those shapes are (the named symbols of
    the model's inputs are taken as their values, as everywhere in the passes)."""
    unify_reshape_symbols(graph)  # names only: not a rewrite of the graph
    done = merge_unsqueezes(graph) + fold_known_sizes(graph) + drop_whole_slices(graph)
    done += drop_neutral_expands(graph) + drop_same_type_casts(graph)
    done += flat_index_grids(graph) + unmerge_batched_matmuls(graph)
    return done + bias_before_split(graph)
