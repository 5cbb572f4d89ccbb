"""Measuring: the attention-only synthetic model (:mod:`~attnbench.measure.synthetic`), the decode
loop (:mod:`~attnbench.measure.decode`), the CUDA-graph step timer (:mod:`~attnbench.measure.graph_step`),
one measured and checked decode run (:mod:`~attnbench.measure.bench`), and real models' end-to-end
generation through each path (:mod:`~attnbench.measure.e2e`).
"""
