"""attnbench — pick the fastest correct attention backend for LLM decoding by measuring it."""

from __future__ import annotations

from attnbench.core import (
    PLUGIN_API_VERSION,
    Backend,
    ConfigError,
    KVCache,
    ModelShape,
    Registry,
    RegistryError,
    ShapeError,
    StepPlan,
    Tolerance,
    Tunable,
    Workload,
    __version__,
    load_registry,
    load_shape,
)
from attnbench.correctness.gate import CheckResult, check
from attnbench.hookspecs import hookimpl
from attnbench.selection.select import Choice, select

__all__ = [
    "PLUGIN_API_VERSION",
    "Backend",
    "CheckResult",
    "Choice",
    "ConfigError",
    "KVCache",
    "ModelShape",
    "Registry",
    "RegistryError",
    "ShapeError",
    "StepPlan",
    "Tolerance",
    "Tunable",
    "Workload",
    "__version__",
    "check",
    "hookimpl",
    "load_registry",
    "load_shape",
    "select",
]
