"""attnbench-flex: a FlexAttention decode backend, registered with attnbench through an entry point.

attnbench loads this module through the ``attnbench.backends`` entry-point group (see this
distribution's ``pyproject.toml``), checks :data:`ATTNBENCH_PLUGIN_API`, then calls the
``attnbench_backends`` hook. The backend module is imported only when the hook runs.
"""

from __future__ import annotations

import attnbench

__version__ = "0.1.0"

#: The attnbench plugin-API version this plugin was written for.
ATTNBENCH_PLUGIN_API = 1


@attnbench.hookimpl
def attnbench_backends() -> list[type[attnbench.Backend]]:
    from attnbench_flex.backend import FlexBackend

    return [FlexBackend]
