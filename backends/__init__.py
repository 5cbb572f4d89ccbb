"""Built-in backends, registered through the same hook as third-party plugins.

One file per backend. To add one: write ``backends/<name>.py`` with a :class:`attnbench.Backend`
subclass, add its one line to :data:`BUILTIN` below, and give it a conformance test file
(``tests/backends/test_<name>.py`` with a ``BackendConformance`` subclass); docs/writing-a-backend.md.
"""

from __future__ import annotations

import importlib

from attnbench.hookspecs import hookimpl

ATTNBENCH_PLUGIN_API = 1

#: ``module:class`` of every built-in backend, in the order ``attnbench backends`` lists them.
BUILTIN = (
    "naive:NaiveBackend",
    "flash:FlashBackend",
    "mla:MLABackend",
    "fp8:FP8Backend",
    "triton_paged:TritonPagedBackend",
    "cpu_decode:CpuDecodeBackend",
    "cpu_decode_fp8:CpuDecodeFp8Backend",
    "cpu_decode_mla:CpuDecodeMLABackend",
)


@hookimpl
def attnbench_backends() -> list[type]:
    modules = (entry.partition(":") for entry in BUILTIN)
    return [getattr(importlib.import_module(f"{__name__}.{mod}"), cls) for mod, _, cls in modules]
