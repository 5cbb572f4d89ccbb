"""The cost model: what a step or a whole generation should take on a device.

:mod:`attnbench.cost.generation` predicts a real model's TTFT and ITL per path; the byte and FLOP
counts, the attention-step fit, the GPU specs and the estimator move here with the package redesign.
"""
