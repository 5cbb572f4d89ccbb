"""The correctness gate: the float64 reference (:mod:`~attnbench.correctness.reference`), needle probes
(:mod:`~attnbench.correctness.needles`), the calibrated gate and the plausibility bound of a timed run
(:mod:`~attnbench.correctness.gate`), the ahead-of-time compile check of the Triton family
(:mod:`~attnbench.correctness.aot`).
"""

from __future__ import annotations

from attnbench.correctness.aot import (
    TL_DTYPE,
    merge_specialization,
    resident_programs,
    specialization,
    spill_bytes,
)
from attnbench.correctness.gate import (
    CheckResult,
    Judge,
    angle,
    check,
    gate_seed,
    prepare_case,
    random_step_inputs,
    within,
)
from attnbench.correctness.reference import compare, reference_decode, reference_pair, reference_prefill
from attnbench.correctness.timed import (
    CHECK_BUDGET_BYTES,
    CaseShelf,
    CheckFailed,
    Implausible,
    check_workload,
    error_multiple_for,
    plausibility,
)

__all__ = [
    "CHECK_BUDGET_BYTES",
    "TL_DTYPE",
    "CaseShelf",
    "CheckFailed",
    "CheckResult",
    "Implausible",
    "Judge",
    "angle",
    "check",
    "check_workload",
    "compare",
    "error_multiple_for",
    "gate_seed",
    "merge_specialization",
    "plausibility",
    "prepare_case",
    "random_step_inputs",
    "reference_decode",
    "reference_pair",
    "reference_prefill",
    "resident_programs",
    "specialization",
    "spill_bytes",
    "within",
]
