"""Kernels shared by backends: the split-KV Triton decode family (:mod:`~attnbench.kernels.triton_decode`,
its helpers in :mod:`~attnbench.kernels.triton_utils`), the paged layout and the split plan
(:mod:`~attnbench.kernels.paged`, :mod:`~attnbench.kernels.split_kv`), the fp8 quantiser and cache
(:mod:`~attnbench.kernels.fp8_cache`). Imports only :mod:`attnbench.core`.
"""
