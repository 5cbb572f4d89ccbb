"""attnbench — pick the fastest correct attention backend for LLM decoding by measuring it."""

from __future__ import annotations

from attnbench.backend import PLUGIN_API_VERSION, Backend, ConfigError, KVCache, StepPlan, Tolerance, Tunable
from attnbench.gate import CheckResult, check
from attnbench.hookspecs import hookimpl
from attnbench.registry import Registry, RegistryError, load_registry
from attnbench.select import Choice, select
from attnbench.shapes import ModelShape, ShapeError, load_shape
from attnbench.workload import Workload

__version__ = "0.1.0"

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
