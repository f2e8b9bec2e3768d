"""Parity block by block, for a model whose whole-model parity does not fit in memory (the
plan that decides: :mod:`normexport.runtime.plan`). :class:`Chains` runs the references (the
float64 oracle and the raw model) one block at a time, cut by :mod:`normexport.verdict.blocks`,
and judges each candidate (the optimized model, or a rollback build) cut at the same
boundaries: the chains' final outputs by :func:`normexport.verdict.parity.check_parity`, every
value a block hands on by :class:`normexport.verdict.result.BlockVerdict`. What runs fed what,
and why: docs/memory.md#parity-block-by-block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx_ir as ir

from normexport import progress, runtime
from normexport.precision import cast_feeds
from normexport.runtime.memory import give_back
from normexport.verdict.blocks import Block, blocks, boundaries, cut
from normexport.verdict.oracle import onnx_float64
from normexport.verdict.parity import Recorded, check_parity, compare
from normexport.verdict.result import BlockVerdict, ParityResult

Run = Callable[[Mapping[str, np.ndarray]], Sequence[np.ndarray]]
#: Opens a model given as its serialized graph (its tensors read from the external data file
#: in the folder given) as the candidate runs; returns how to run it and its output names.
Opener = Callable[[bytes, Path], tuple[Run, Sequence[str]]]
#: Values of one input set's run: value name -> array, keyed by the feeds' identity.
Store = dict[int, dict[str, np.ndarray]]


class Chains:
    """The references of a model run block by block (docs/memory.md#parity-block-by-block).

    Args:
        raw_path: the raw model (the input file), its external data beside it.
        max_bytes: the most bytes a block holds: its weights (on file) and the values it
            computes from them alone (:func:`normexport.verdict.blocks.boundaries`).
        work: a scratch folder for the float64 blocks.
        provider: runs the raw model's blocks (the oracle runs on the CPU).

    Raises:
        ValueError: a graph output is not computed by a node (a graph input or an initializer
            passed through): the chains hand on computed values only.
    """

    def __init__(self, raw_path: Path, max_bytes: int, work: Path, provider: str):
        self.raw_path, self.work, self.provider = raw_path, work, provider
        model = ir.load(raw_path)  # the graph; its tensors stay on file
        self.cuts = boundaries(model, max_bytes)
        self.blocks = blocks(model, self.cuts)
        self.outputs = [v.name for v in model.graph.outputs]
        if any(v.producer() is None for v in model.graph.outputs):
            raise ValueError(f"{raw_path}: a graph output is not computed by any node")
        self.oracle: Store = {}
        self.raw: Store = {}
        self.raw_local: Store = {}
        self._kept: list[Mapping] = []  # every feeds mapping seen: no other takes its identity
        self.fallbacks: list[str] = []  # per block whose oracle is the block as written, why
        self.float32: list = []  # the oracle's float32 islands, every block's
        self.oracle_note = ""

    def record(self, sets: Sequence[Mapping], oracle_sets: Sequence[Mapping]) -> None:
        """Run the references block by block: the raw model on ``sets`` it has not seen
        (chained, and fed the oracle's values), the oracle on ``sets`` and ``oracle_sets``
        (inputs rounded or moved by one ulp) it has not seen."""
        raw_new = [f for f in sets if id(f) not in self.raw]
        oracle_new = [f for f in (*sets, *oracle_sets) if id(f) not in self.oracle]
        oracle_new = list({id(f): f for f in oracle_new}.values())
        if not raw_new and not oracle_new:
            return
        self._kept += [*raw_new, *oracle_new]
        for store in (self.raw, self.raw_local):
            store.update({id(f): {} for f in raw_new})
        self.oracle.update({id(f): {} for f in oracle_new})
        seconds = 0.0
        for block in self.blocks:
            progress.step(f"the references, block {block.index + 1} of {len(self.blocks)}")
            start = time.perf_counter()
            self._record_block(block, sets, raw_new, oracle_new)
            seconds += time.perf_counter() - start
            give_back()
        kind = "in float64" if not self.fallbacks else "in float64 where it could be built"
        self.oracle_note = (
            f"the oracle is the input graph {kind}, run block by block: {len(self.blocks)} "
            f"blocks, {seconds / max(len(oracle_new), 1):.1f} s per input set"
        )

    def _record_block(self, block: Block, sets, raw_new, oracle_new) -> None:
        """One block of the references, on the new sets: the raw model's (chained, and fed
        the oracle's values), then the oracle's, self-checked on the example set."""
        types = _types(block, sets[0], self.raw)
        model = cut(self.raw_path, block.inputs, block.outputs, types)
        session = runtime.OnDemand(
            _graph(model), self.provider, external_data_folder=self.raw_path.parent
        )
        raw = Recorded(lambda feeds: _run(session.open(), feeds), session.close)
        for feeds in raw_new:
            _keep(block, raw(_fed(block, feeds, self.raw)), self.raw[id(feeds)])
            _keep(block, raw(_fed(block, feeds, self.oracle)), self.raw_local[id(feeds)])
        example = _fed(block, sets[0], self.oracle)
        if oracle_new:
            raw(example)  # the oracle's self-check compares with it
        raw.close()
        if not oracle_new:
            return
        what = f"block {block.index + 1} of the input graph"
        found = onnx_float64(model, raw, example, self.work, what)
        if found.run is None:
            self.fallbacks.append(f"{what}: {'; '.join(found.notes)}; as written instead")
        oracle = Recorded(found.run, found.close) if found.run else raw
        for feeds in oracle_new:
            _keep(block, oracle(_fed(block, feeds, self.oracle)), self.oracle[id(feeds)])
        oracle.close()
        self.float32 += found.float32
        self.fallbacks += [f"{what}: {n}" for n in found.notes if n.startswith("on an input set")]

    def final(self, store: Store) -> Run:
        """The final outputs of a chain recorded in ``store``, by the feeds' identity."""
        return lambda feeds: [store[id(feeds)][name] for name in self.outputs]

    def judge(
        self, path: Path, opener: Opener, sets: Mapping[str, Mapping], **rule
    ) -> ParityResult:
        """The verdict on the model at ``path``, opened block by block by ``opener``, each
        block fed its own chain and the oracle's values (docs/memory.md#parity-block-by-block).
        ``rule``: :func:`check_parity`'s keywords but ``output_names`` (tolerances, the
        references as :meth:`final` runs, the rule's bound)."""
        found = blocks(ir.load(path), self.cuts)
        chain: Store = {id(f): {} for f in sets.values()}
        local: Store = {id(f): {} for f in sets.values()}
        verdicts = []
        for block in found:
            progress.step(f"block {block.index + 1} of {len(found)}")
            start = time.perf_counter()
            types = _types(block, next(iter(sets.values())), chain)
            model = cut(path, block.inputs, block.outputs, types)
            run, _ = opener(_graph(model), path.parent)
            for feeds in sets.values():
                own = _fed(block, feeds, chain)
                _keep(block, run(own), chain[id(feeds)])
                _keep(block, run(_like(own, _fed(block, feeds, self.oracle))), local[id(feeds)])
            del run
            give_back()
            seconds = time.perf_counter() - start
            verdicts.append(self._block_verdict(block, seconds, sets, chain, local, rule))
        result = check_parity(self.final(chain), sets=sets, output_names=self.outputs, **rule)
        result.blocks = verdicts
        return result

    def _block_verdict(
        self, block, seconds: float, sets: Mapping, chain: Store, local: Store, rule: dict
    ) -> BlockVerdict:
        """One block's verdict: each float value it hands on, fed the oracle's values (noise:
        the raw block fed alike, where the block is one of the reference's) and chained
        (noise: the raw model's chain)."""
        judged = {"rtol": rule["rtol"], "max_rel_l2": rule.get("max_rel_l2")}
        ours = {name for b in self.blocks for name in b.outputs}  # some left out of a cut
        atol, same = rule["atol"], block.spans == 1 and set(block.outputs) <= ours
        found: dict[str, dict] = {"local": {}, "chained": {}}
        for set_name, feeds in sets.items():
            key = id(feeds)
            for how, got, noise in (
                ("local", local[key], self.raw_local[key] if same else {}),
                ("chained", chain[key], self.raw[key]),
            ):
                found[how][set_name] = [
                    compare(n, got[n], self.oracle[key][n], atol, raw=noise.get(n), **judged)
                    for n in block.outputs
                    if _is_float(self.oracle[key][n])
                ]
        described = {**vars(block), "inputs": list(block.inputs), "outputs": list(block.outputs)}
        return BlockVerdict(described, seconds, found["local"], found["chained"])


def chained(path: Path, max_bytes: int, provider: str) -> Run | None:
    """The model at ``path`` as written, run block by block on ``provider``: each block (cut
    as :class:`Chains` cuts it, holding at most ``max_bytes``) fed the previous blocks'
    values, its session freed before the next opens; the run returns the graph outputs. For a
    model whose whole run does not fit: the raw model's first run, which checks that it runs
    on the example inputs (:mod:`normexport.pipeline.raw_model`). None where the model cannot
    be cut (a graph output is not computed by a node)."""
    model = ir.load(path)  # the graph; its tensors stay on file
    if any(v.producer() is None for v in model.graph.outputs):
        return None
    outputs = [v.name for v in model.graph.outputs]
    found = blocks(model, boundaries(model, max_bytes))

    def run(feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        store: Store = {id(feeds): {}}
        for block in found:
            progress.step(f"the input file, block {block.index + 1} of {len(found)}")
            graph = _graph(cut(path, block.inputs, block.outputs, _types(block, feeds, store)))
            session = runtime.check_session(graph, provider, external_data_folder=path.parent)
            _keep(block, _run(session, _fed(block, feeds, store)), store[id(feeds)])
            del session
            give_back()
        return [store[id(feeds)][name] for name in outputs]

    return run


def _is_float(array: np.ndarray) -> bool:
    return np.asarray(array).dtype.kind == "f"


def _graph(model: ir.Model) -> bytes:
    """The serialized graph of a cut model: its tensors stay in the model's external data."""
    return ir.to_proto(model).SerializeToString()


def _fed(block: Block, feeds: Mapping, store: Store) -> dict[str, np.ndarray]:
    """The block's inputs: the values ``store`` recorded for ``feeds``, else the feeds."""
    values = store[id(feeds)]
    return {n: values[n] if n in values else feeds[n] for n in block.inputs}


def _types(block: Block, feeds: Mapping, store: Store) -> dict[str, ir.DataType]:
    """The element types of the block's inputs, as the previous blocks computed them."""
    values = store[id(feeds)]
    return {n: ir.DataType.from_numpy(values[n].dtype) for n in block.inputs if n in values}


def _like(own: dict[str, np.ndarray], oracle: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The oracle's values (float64) in the types of the candidate's own (``own``)."""
    return {
        n: v.astype(own[n].dtype, copy=False) if v.dtype.kind == "f" else v
        for n, v in oracle.items()
    }


def _keep(block: Block, outputs: Sequence[np.ndarray], into: dict) -> None:
    """Record the block's outputs into ``into`` by name, each an array that owns its memory:
    they outlive the block's session, and an ONNX Runtime output is a view into the session's
    memory arena that keeps the whole arena alive (a float16 block's float32 casts of its
    weights among it: one such arena per block, kept, took a 2 GiB container's run past its
    limit by the sixth block)."""
    owned = [o if o.flags.owndata else np.array(o, copy=True) for o in map(np.asarray, outputs)]
    into.update(zip(block.outputs, owned, strict=True))


def _run(session, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``session`` on ``feeds``, each float cast to the type it declares; outputs kept (copies:
    the session is freed before they are read)."""
    return runtime.run(session, cast_feeds(session, feeds), quiet=True, kept=True)
