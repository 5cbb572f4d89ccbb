"""attnbench-vllm: vLLM's CPU attention kernels as attnbench backends, registered through an entry point.

attnbench loads this module through the ``attnbench.backends`` entry-point group (see this
distribution's ``pyproject.toml``), checks :data:`ATTNBENCH_PLUGIN_API`, then calls the
``attnbench_backends`` hook. Neither this module nor the hook imports vLLM: the backends import it
the first time they are asked whether they can run, and say why not when it is missing.
"""

from __future__ import annotations

import attnbench

__version__ = "0.1.0"

#: The attnbench plugin-API version this plugin was written for.
ATTNBENCH_PLUGIN_API = 1


@attnbench.hookimpl
def attnbench_backends() -> list[type[attnbench.Backend]]:
    from attnbench_vllm.backend import VllmCpuBackend, VllmCpuFP8Backend

    return [VllmCpuBackend, VllmCpuFP8Backend]
