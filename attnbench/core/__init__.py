"""The core layer: what every other part of attnbench builds on.

Model shapes and presets (:mod:`~attnbench.core.shapes`), the workload and its buckets
(:mod:`~attnbench.core.workload`), the backend protocol (:mod:`~attnbench.core.backend`, with
:mod:`~attnbench.core.resolution` and the contiguous-cache base :mod:`~attnbench.core.kvcache`), causal
prompt attention (:mod:`~attnbench.core.prefill`), the bytes and FLOPs of a decode step
(:mod:`~attnbench.core.traffic`, the one owner), the registry (:mod:`~attnbench.core.registry`) and
bounded calls into plugin code (:mod:`~attnbench.core.plugin_call`), the device profile and the clock
(:mod:`~attnbench.core.device`, :mod:`~attnbench.core.timing`), the per-user locations
(:mod:`~attnbench.core.locations`). Nothing here imports another attnbench layer
(docs/architecture.md; CI checks it with import-linter).
"""
