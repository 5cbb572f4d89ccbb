"""Measuring: the attention-only synthetic model (:mod:`~attnbench.measure.synthetic`) and how many
layers it makes and times (:mod:`~attnbench.measure.layers`), the decode
loop (:mod:`~attnbench.measure.decode`), the CUDA-graph step timer (:mod:`~attnbench.measure.graph_step`),
one measured and checked decode run (:mod:`~attnbench.measure.bench`; its timed run and the shelf that
keeps a filled model between runs: :mod:`~attnbench.measure.timed_run`), and real models' end-to-end
generation through each path (:mod:`~attnbench.measure.e2e`).
"""

from __future__ import annotations

from attnbench.measure.bench import (
    CheckFailed,
    Implausible,
    check_workload,
    gate_candidate,
    measure_decode,
    plausibility,
)
from attnbench.measure.decode import generate
from attnbench.measure.graph_step import GraphedDecodeStep
from attnbench.measure.layers import materialised_layers, timed_layers
from attnbench.measure.synthetic import SyntheticModel
from attnbench.measure.timed_run import ModelShelf, Pruned, TimedRun, check_timed_step, llc_evictor, timed_run

__all__ = [
    "CheckFailed",
    "GraphedDecodeStep",
    "Implausible",
    "ModelShelf",
    "Pruned",
    "SyntheticModel",
    "TimedRun",
    "check_timed_step",
    "check_workload",
    "gate_candidate",
    "generate",
    "llc_evictor",
    "materialised_layers",
    "measure_decode",
    "plausibility",
    "timed_layers",
    "timed_run",
]
