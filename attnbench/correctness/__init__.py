"""The correctness gate: the float64 reference (:mod:`~attnbench.correctness.reference`), needle probes
(:mod:`~attnbench.correctness.needles`), the calibrated gate and the plausibility bound of a timed run
(:mod:`~attnbench.correctness.gate`), the ahead-of-time compile check of the Triton family
(:mod:`~attnbench.correctness.aot`).
"""
