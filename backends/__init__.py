"""Built-in backends, registered through the same hook as third-party plugins.

One file per backend. To add one: write ``backends/<name>.py`` with a :class:`attnbench.Backend`
subclass and add it to the list below.
"""

from __future__ import annotations

from attnbench.hookspecs import hookimpl

ATTNBENCH_PLUGIN_API = 1


@hookimpl
def attnbench_backends() -> list[type]:
    from attnbench.backends.cpu_decode import CpuDecodeBackend
    from attnbench.backends.flash import FlashBackend
    from attnbench.backends.fp8 import FP8Backend
    from attnbench.backends.mla import MLABackend
    from attnbench.backends.naive import NaiveBackend
    from attnbench.backends.triton_paged import TritonPagedBackend

    return [NaiveBackend, FlashBackend, MLABackend, FP8Backend, TritonPagedBackend, CpuDecodeBackend]
