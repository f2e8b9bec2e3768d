"""The overflow probe for models whose inputs are token ids: hidden states fed at the embedding.

The half-precision overflow probe (:func:`normexport.precision.overflow_set`) scales a model's
float inputs; a language model has none, and no choice of token ids drives its hidden states
into the hundreds (they are rows of the embedding table). So the probe goes one step in: each
*embedding lookup* (a ``Gather`` of a float initializer, the table, by a graph input of integer
ids) is cut off, its output becomes a graph input, and that input is fed hidden states with
outliers, as transformer hidden states carry them (the first norm after the embedding squares
them). The same cut is made in the half-precision model and in the raw model, whose float64
copy is the probe's oracle (:func:`normexport.verdict.oracle.onnx_float64`), so both compute the
same function of the hidden states. Value names survive normexport's passes and the float16
converter, so the lookups found in the raw model name the cut in both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from normexport import runtime
from normexport.precision import OVERFLOW_PROBE, cast_feeds, rounded_feeds, with_outliers
from normexport.verdict.blocks import cut
from normexport.verdict.oracle import onnx_float64
from normexport.verdict.parity import HALF_MAX_REL_L2, ParityResult, Recorded, check_parity


@dataclasses.dataclass(frozen=True)
class Lookup:
    """One embedding lookup of a model.

    Attributes:
        value: the lookup's output value (a graph input of the cut model).
        indices: the graph input of token ids it reads.
        row_shape: the table's shape past its first axis (a row: ``(hidden,)``).
        dtype: the table's numpy dtype.
    """

    value: str
    indices: str
    row_shape: tuple[int, ...]
    dtype: np.dtype


def embedding_lookups(model: ir.Model) -> list[Lookup]:
    """Every ``Gather`` (axis 0) of a float initializer of rank 2 or more by an integer graph
    input, in graph order."""
    found = []
    for node in model.graph:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx"):
            continue
        table, ids = node.inputs[0], node.inputs[1]
        axis = node.attributes.get_int("axis", 0)
        if (
            axis == 0
            and table is not None
            and table.const_value is not None
            and table.dtype is not None
            and table.dtype.is_floating_point()
            and len(table.const_value.shape) >= 2
            and ids is not None
            and ids.is_graph_input()
            and ids.dtype is not None
            and ids.dtype.is_integer()
        ):
            row = tuple(int(d) for d in table.const_value.shape[1:])
            found.append(Lookup(node.outputs[0].name, ids.name, row, table.dtype.numpy()))
    return found


def _cut_run(model: ir.Model, src: Path, provider: str) -> Recorded:
    """``model``, a cut of the model at ``src`` (:func:`normexport.verdict.blocks.cut`), run
    as written by a session opened on demand on its graph alone, its weights read from
    ``src``'s own external data file (nothing is copied); ``close()`` frees the session."""
    graph = ir.to_proto(model).SerializeToString()  # the graph: its tensors stay on file
    session = runtime.OnDemand(graph, provider, external_data_folder=src.parent)
    return Recorded(lambda feeds: _run(session.open(), feeds), session.close)


def hidden_states(
    lookups: Sequence[Lookup], example: Mapping[str, np.ndarray], seed: int = 2
) -> dict[str, np.ndarray]:
    """Feeds for the cut model: each lookup's output of shape ``ids.shape + row_shape`` in the
    table's dtype, standard normal with outliers (:func:`normexport.precision.with_outliers`);
    every other input of ``example`` as it is.

    Raises:
        KeyError: ``example`` has no feed for a lookup's ids.
    """
    rng = np.random.default_rng(seed)
    feeds = dict(example)
    for lookup in lookups:
        state = with_outliers(rng, example[lookup.indices].shape + lookup.row_shape)
        feeds[lookup.value] = state.astype(lookup.dtype)
    return feeds


def compare(
    raw_path: Path,
    half_path: Path,
    example: Mapping[str, np.ndarray],
    work: Path,
    *,
    provider: str,
    precision: str,
    atol: float,
    rtol: float,
) -> ParityResult | None:
    """The half-precision model at ``half_path`` on the hidden-state overflow probe (input set
    :data:`normexport.precision.OVERFLOW_PROBE`), against the raw model at ``raw_path`` cut the
    same way, in float64 (where no float64 copy passes its self-check: the cut raw model as
    written, and the notes say why); None where the raw model has no embedding lookup.

    Args:
        raw_path, half_path: the raw model (the raw export, or the input file) and the
            half-precision model, their external data beside them.
        example: the example feeds (token ids and the other inputs).
        work: a scratch folder (created) for the cut models and the oracle.
        provider: runs the cut models (``cpu`` or ``cuda``).
        precision: the half model's ``--precision`` (``fp16``, ``bf16``): the parity bound and
            the input rounding.
        atol, rtol: the user's tolerances.
    """
    lookups = embedding_lookups(ir.load(raw_path))
    if not lookups:
        return None
    work.mkdir(exist_ok=True)
    values = [lookup.value for lookup in lookups]
    raw_cut = cut(raw_path, values)
    raw = _cut_run(raw_cut, raw_path, provider)
    read = {v.name for v in raw_cut.graph.inputs}
    feeds = {k: v for k, v in hidden_states(lookups, example).items() if k in read}
    where = ", ".join(repr(v) for v in values)
    what = f"the raw model cut at its embedding lookups ({where})"
    found = onnx_float64(raw_cut, raw, feeds, work, what)  # widens raw_cut
    round_inputs = Recorded(functools.partial(rounded_feeds, precision=precision))
    oracle = Recorded(found.run, found.close) if found.run else raw
    oracle.record([feeds, round_inputs(feeds)])  # one model at a time, each freed
    raw.record([feeds])
    half_cut = cut(half_path, values)
    half = _cut_run(half_cut, half_path, provider)
    notes = [f"{OVERFLOW_PROBE}: hidden states with outliers fed at {where}, against {what}"]
    return check_parity(  # the half session is freed with ``half``, on return
        half,
        oracle,
        {OVERFLOW_PROBE: feeds},
        [v.name for v in half_cut.graph.outputs],
        reference_kind="onnx",
        atol=atol,
        rtol=rtol,
        raw=raw if found.run else None,
        oracle_kind=found.kind or "onnx",
        notes=[*notes, *found.notes],
        max_rel_l2=HALF_MAX_REL_L2[precision],
        round_inputs=round_inputs,
    )


def _run(session, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``session`` (ONNX Runtime) on the feeds it reads, each float cast to the type it
    declares."""
    wanted = {i.name for i in session.get_inputs()}
    read = {k: v for k, v in feeds.items() if k in wanted}
    return runtime.run(session, cast_feeds(session, read), kept=True)
