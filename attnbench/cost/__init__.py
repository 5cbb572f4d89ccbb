"""The cost model above the byte counts of :mod:`attnbench.core.traffic`: the per-device fit of measured
step times (:mod:`~attnbench.cost.fit`), GPU datasheet presets (:mod:`~attnbench.cost.gpuspec`), the
TTFT + N·ITL estimator (:mod:`~attnbench.cost.estimate`), and the prediction of a real model's
generation checked against end-to-end runs (:mod:`~attnbench.cost.generation`).
"""

from __future__ import annotations

from attnbench.cost.estimate import KV_DTYPES, WEIGHT_DTYPES, Estimate, MoERouting, estimate
from attnbench.cost.fit import (
    Calibration,
    CalibrationError,
    CalibrationPoint,
    Fit,
    calibration_path,
    device_entry,
    find_calibration,
    geometry_key,
    points_from_bench,
    points_from_table,
)
from attnbench.cost.gpuspec import (
    device_memory_bytes,
    list_gpus,
    load_gpu,
    matmul_peak,
    measured_flops,
    measured_gpu,
)

__all__ = [
    "KV_DTYPES",
    "WEIGHT_DTYPES",
    "Calibration",
    "CalibrationError",
    "CalibrationPoint",
    "Estimate",
    "Fit",
    "MoERouting",
    "calibration_path",
    "device_entry",
    "device_memory_bytes",
    "estimate",
    "find_calibration",
    "geometry_key",
    "list_gpus",
    "load_gpu",
    "matmul_peak",
    "measured_flops",
    "measured_gpu",
    "points_from_bench",
    "points_from_table",
]
