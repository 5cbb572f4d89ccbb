"""The core layer: what every other part of attnbench builds on (see docs/architecture.md).

Today it holds :mod:`attnbench.core.prefill`, the causal prompt attention every backend's
``prefill`` runs by default; the shapes, workload, backend protocol and registry move here with the
package redesign.
"""

from __future__ import annotations

from attnbench.core.prefill import PREFILL_BUDGET_BYTES, prefill_attention, sdpa_flash_error

__all__ = ["PREFILL_BUDGET_BYTES", "prefill_attention", "sdpa_flash_error"]
