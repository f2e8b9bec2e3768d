"""``normexport bench MODEL``: latency of every optimizer's variant of one model, swept over
batch (and sequence) sizes, on one execution provider, with PyTorch eager beside them.

The parts: :mod:`~normexport.bench.command` (the command line),
:mod:`~normexport.bench.bench_options` (what to time), :mod:`~normexport.bench.measure`
(building and timing the variants:
:func:`~normexport.bench.measure.bench_model`), :mod:`~normexport.bench.floor` (the
elementwise floor), :mod:`~normexport.bench.results` (what was measured, typed; its
``to_dict()`` is the JSON) and :mod:`~normexport.bench.render` (tables and chart).

What is timed, and how (see :mod:`normexport.runtime.latency` for the statistics):

- the variants of :data:`normexport.tuning.variants.VARIANTS`, each in its own ORT session on the
  provider :func:`normexport.runtime.resolve_provider` picked (a CPU run is never labelled
  CUDA; ``auto`` without CUDA prints one line saying so);
- with ``--cpu`` (the default on CUDA), the raw export and normexport's model once more on
  ORT's CPU provider (``ort_raw@cpu``, ``normexport@cpu``), in the same interleaved rounds;
- PyTorch eager on the same device, ``torch.inference_mode``, followed by
  ``torch.cuda.synchronize()`` on CUDA so that the clock stops when the result is ready;
- ``--io-binding`` (the default on CUDA): inputs copied to the device once and outputs kept
  there (:class:`normexport.runtime.latency.BoundRun`), so host-device copies are not timed;
  ``--cuda-graph`` adds CUDA graph capture and replay (one session per input shape);
- all of them in one process, interleaved in rotated order, after a warm-up; per variant the
  median, p90, min-max and a 95% bootstrap interval of the median; ratios to normexport and to
  eager are medians of per-round ratios, with their own bootstrap interval;
- what ORT really ran: each variant's norm ops after ORT's session optimizations (ORT_ENABLE_ALL
  turns Add + LayerNormalization into SkipLayerNormalization on its own, for one);
- each variant's output is compared with the reference (eager, else the raw export) at every
  point, so that a fast but inexact optimizer shows as such;
- the floor: the first fused norm (:data:`fusion.registry.FUSED_NORM_OPS`) of normexport's
  model, alone, against one elementwise op (Relu: one read, one write) over the same tensor on
  the same provider: how far the norm is from the memory-bound limit.

A variant that fails to build or to run at some shape is recorded with its error; the rest of
the comparison goes on.
"""
