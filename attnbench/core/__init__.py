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

from __future__ import annotations

from attnbench.core.backend import (
    DEFAULT_ERROR_MULTIPLE,
    DEFAULT_TOLERANCES,
    PLUGIN_API_VERSION,
    Backend,
    ConfigError,
    KVCache,
    StepPlan,
    Tolerance,
    base_plan,
)
from attnbench.core.child import Child, die_with_parent, run_child
from attnbench.core.device import (
    AUTO,
    DeviceProfile,
    ReadMeter,
    available_memory,
    cache_dir,
    empty_huge,
    fingerprint,
    fingerprint_id,
    keep_huge_buffers,
    last_level_cache_bytes,
    load_profile,
    make_room,
    measure_bandwidth,
    resolve_device,
    triton_version,
)
from attnbench.core.kvcache import ContiguousBackend, ContiguousKVCache
from attnbench.core.locations import (
    RESULTS_ENV,
    ResultsLocation,
    check_table_file,
    readable_results,
    results_location,
    writable_results,
)
from attnbench.core.plugin_call import ask, ask_many
from attnbench.core.registry import Registry, RegistryError, code_hash, load_backend_class, load_registry
from attnbench.core.resolution import Resolution, Tunable
from attnbench.core.shapes import (
    AttentionGeometry,
    KVForm,
    ModelShape,
    ShapeError,
    dtype_bytes,
    dtype_name,
    list_presets,
    load_shape,
    parse_dtype,
)
from attnbench.core.timing import TIMING_MODES, Timing, measure, synchronize, timing_mode
from attnbench.core.traffic import (
    Roofline,
    attention_flops,
    backend_kv_bytes_per_token,
    decode_cost,
    decode_roofline,
    kv_bytes_per_step,
    roofline,
    shape_kv_bytes_per_token,
    step_fixed_s,
)
from attnbench.core.version import __version__
from attnbench.core.workload import (
    Workload,
    bucket,
    parse_int_list,
    parse_tokens,
    workload_from_dict,
    workload_to_dict,
)

__all__ = [
    "AUTO",
    "DEFAULT_ERROR_MULTIPLE",
    "DEFAULT_TOLERANCES",
    "PLUGIN_API_VERSION",
    "RESULTS_ENV",
    "TIMING_MODES",
    "AttentionGeometry",
    "Backend",
    "Child",
    "ConfigError",
    "ContiguousBackend",
    "ContiguousKVCache",
    "DeviceProfile",
    "KVCache",
    "KVForm",
    "ModelShape",
    "ReadMeter",
    "Registry",
    "RegistryError",
    "Resolution",
    "ResultsLocation",
    "Roofline",
    "ShapeError",
    "StepPlan",
    "Timing",
    "Tolerance",
    "Tunable",
    "Workload",
    "__version__",
    "ask",
    "ask_many",
    "attention_flops",
    "available_memory",
    "backend_kv_bytes_per_token",
    "base_plan",
    "bucket",
    "cache_dir",
    "check_table_file",
    "code_hash",
    "decode_cost",
    "decode_roofline",
    "die_with_parent",
    "dtype_bytes",
    "dtype_name",
    "empty_huge",
    "fingerprint",
    "fingerprint_id",
    "keep_huge_buffers",
    "kv_bytes_per_step",
    "last_level_cache_bytes",
    "list_presets",
    "load_backend_class",
    "load_profile",
    "load_registry",
    "load_shape",
    "make_room",
    "measure",
    "measure_bandwidth",
    "parse_dtype",
    "parse_int_list",
    "parse_tokens",
    "readable_results",
    "resolve_device",
    "results_location",
    "roofline",
    "run_child",
    "shape_kv_bytes_per_token",
    "step_fixed_s",
    "synchronize",
    "timing_mode",
    "triton_version",
    "workload_from_dict",
    "workload_to_dict",
    "writable_results",
]
