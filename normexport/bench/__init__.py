"""``normexport bench MODEL``: latency of every optimizer's variant of one model, swept over
batch (and sequence) sizes, on one execution provider, with PyTorch eager beside them. What is
timed and how: docs/benchmarks.md#what-bench-times-and-how.

The parts: :mod:`~normexport.bench.command` (the command line),
:mod:`~normexport.bench.bench_options` (what to time), :mod:`~normexport.bench.fixed` (swept
axes the model fixes), :mod:`~normexport.bench.variants` (the variants each optimizer makes,
and the one-op models of the forms benchmark and the floor), :mod:`~normexport.bench.measure`
(building and timing the variants: :func:`~normexport.bench.measure.bench_model`),
:mod:`~normexport.bench.floor` (the elementwise floor), :mod:`~normexport.bench.results` (what
was measured, typed; its ``to_dict()`` is the JSON) and :mod:`~normexport.bench.render` (tables
and chart).
"""
