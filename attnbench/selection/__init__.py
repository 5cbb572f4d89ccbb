"""Choosing a backend at run time: ``select()`` (:mod:`~attnbench.selection.select`), what it returns
(:mod:`~attnbench.selection.choice`), the tuned-map reader (:mod:`~attnbench.selection.tuned`), and the
fallbacks where nothing was tuned: the fitted cost model (:mod:`~attnbench.selection.fitted`) and the
roofline heuristic (:mod:`~attnbench.selection.heuristic`). ``attnbench.select`` is the function.
"""

from __future__ import annotations

from attnbench.selection.choice import Choice
from attnbench.selection.select import Selector, backend_for, select

__all__ = ["Choice", "Selector", "backend_for", "select"]
