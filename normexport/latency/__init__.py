"""Latency, measured and judged: :mod:`~normexport.latency.measure` times models interleaved in
one process (the rounds, the sessions, the bootstrap statistics) and
:mod:`~normexport.latency.verdict` decides from those timings whether the published model is
slower than the raw one (the latency verdict). The main job's latency stage
(:mod:`normexport.pipeline.timing`), autotune, ``bench`` and the benchmarks time with them; how:
docs/benchmarks.md#how-a-timing-is-made."""
