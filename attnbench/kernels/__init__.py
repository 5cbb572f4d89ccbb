"""Kernels shared by backends: the split-KV Triton decode family (:mod:`~attnbench.kernels.triton_decode`,
its helpers in :mod:`~attnbench.kernels.triton_utils`), the paged layout and the split plan
(:mod:`~attnbench.kernels.paged`, :mod:`~attnbench.kernels.split_kv`), the fp8 quantiser and cache
(:mod:`~attnbench.kernels.fp8_cache`). Imports only :mod:`attnbench.core`.
"""

from __future__ import annotations

from attnbench.kernels.fp8_cache import (
    FP16_BIAS,
    GRANULARITIES,
    FP8KVCache,
    NonFiniteKVError,
    dequantize,
    fp8_bits_to_fp16,
    quantize,
)
from attnbench.kernels.paged import PagedKVCache, PagedStepPlan, cdiv
from attnbench.kernels.split_kv import SplitKVPlan, attach_split_kv, decode_split_kv, plan_split_kv
from attnbench.kernels.triton_decode import (
    MERGE_WARPS,
    DecodeSpec,
    decode_constexprs,
    merge_constexprs,
    pow2,
    split_kv_decode_kernel,
    split_merge_kernel,
)
from attnbench.kernels.triton_utils import AotResult, TritonMode, aot_compile_many, triton_mode

__all__ = [
    "FP16_BIAS",
    "GRANULARITIES",
    "MERGE_WARPS",
    "AotResult",
    "DecodeSpec",
    "FP8KVCache",
    "NonFiniteKVError",
    "PagedKVCache",
    "PagedStepPlan",
    "SplitKVPlan",
    "TritonMode",
    "aot_compile_many",
    "attach_split_kv",
    "cdiv",
    "decode_constexprs",
    "decode_split_kv",
    "dequantize",
    "fp8_bits_to_fp16",
    "merge_constexprs",
    "plan_split_kv",
    "pow2",
    "quantize",
    "split_kv_decode_kernel",
    "split_merge_kernel",
    "triton_mode",
]
