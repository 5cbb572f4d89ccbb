"""Integrations that run attnbench's backends inside other libraries' models.

- :mod:`attnbench.integrations.transformers` — any Hugging Face decoder generates through a chosen
  backend (its attention function and its ``Cache``). Imported on demand: transformers is optional.
"""

from __future__ import annotations

__all__: list[str] = []
