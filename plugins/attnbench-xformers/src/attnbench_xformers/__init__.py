"""attnbench-xformers: xformers' memory-efficient attention as an attnbench decode backend.

Found by attnbench through the ``attnbench.backends`` entry point. Importing this module does not
import xformers: where xformers is missing or cannot run, the backend is still registered and
``attnbench backends`` shows the reason.
"""

from __future__ import annotations

import attnbench

__version__ = "0.1.0"

#: The attnbench plugin-API version this plugin was written for.
ATTNBENCH_PLUGIN_API = 1


@attnbench.hookimpl
def attnbench_backends() -> list[type[attnbench.Backend]]:
    from attnbench_xformers.backend import XformersBackend

    return [XformersBackend]
