"""The cost model: what a step or a whole generation should take on a device.

:mod:`attnbench.cost.generation` predicts a real model's TTFT and ITL per path from measurements of
this device (:func:`calibrate_generation`, then :func:`predict_generation`); the byte and FLOP
counts, the attention-step fit, the GPU specs and the estimator move here with the package redesign.
"""

from __future__ import annotations

from attnbench.cost.generation import (
    GenerationCalibration,
    GenerationPrediction,
    ModelCost,
    calibrate_generation,
    predict_generation,
)

__all__ = [
    "GenerationCalibration",
    "GenerationPrediction",
    "ModelCost",
    "calibrate_generation",
    "predict_generation",
]
