"""The cost model above the byte counts of :mod:`attnbench.core.traffic`: the per-device fit of measured
step times (:mod:`~attnbench.cost.fit`), GPU datasheet presets (:mod:`~attnbench.cost.gpuspec`), the
TTFT + N·ITL estimator (:mod:`~attnbench.cost.estimate`), and the prediction of a real model's
generation checked against end-to-end runs (:mod:`~attnbench.cost.generation`).
"""
