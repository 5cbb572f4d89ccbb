"""Measuring: end-to-end generation of real models through each path (:mod:`attnbench.measure.e2e`).

The timers, the synthetic model, the decode loop and ``bench`` move here with the package redesign.
"""
