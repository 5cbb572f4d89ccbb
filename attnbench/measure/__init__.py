"""Measuring: the attention-only synthetic model (:mod:`~attnbench.measure.synthetic`), the decode
loop (:mod:`~attnbench.measure.decode`), the CUDA-graph step timer (:mod:`~attnbench.measure.graph_step`),
one measured and checked decode run (:mod:`~attnbench.measure.bench`), and real models' end-to-end
generation through each path (:mod:`~attnbench.measure.e2e`).
"""

from __future__ import annotations

from attnbench.measure.bench import (
    CheckFailed,
    Implausible,
    ModelShelf,
    check_workload,
    measure_decode,
    plausibility,
)
from attnbench.measure.decode import generate
from attnbench.measure.graph_step import GraphedDecodeStep
from attnbench.measure.synthetic import SyntheticModel

__all__ = [
    "CheckFailed",
    "GraphedDecodeStep",
    "Implausible",
    "ModelShelf",
    "SyntheticModel",
    "check_workload",
    "generate",
    "measure_decode",
    "plausibility",
]
