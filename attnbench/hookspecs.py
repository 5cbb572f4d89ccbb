"""The plugin hooks of attnbench — the one module a plugin author needs to read.

A plugin is a module (or object) with functions marked ``@attnbench.hookimpl``. Built-in backends
are registered through these same hooks, so a plugin's backend is a first-class citizen.

A plugin module also declares the plugin-API version it was written for::

    # my_plugin.py
    import attnbench

    ATTNBENCH_PLUGIN_API = 1

    @attnbench.hookimpl
    def attnbench_backends():
        from my_plugin.backend import MyBackend  # heavy imports inside the hook, not at module level

        return [MyBackend]

and is published under the entry-point group ``attnbench.backends``::

    [project.entry-points."attnbench.backends"]
    my_backend = "my_plugin"

``ATTNBENCH_PLUGIN_API`` must lie in :data:`attnbench.core.registry.SUPPORTED_PLUGIN_API`; a plugin that
declares another version, or none, is refused with a message naming the plugin, its distribution and
version, and the supported range. The loading rules (one plugin at a time, each guarded, the stages
``import`` / ``api-version`` / ``register``, ``ATTNBENCH_PLUGINS`` and
``ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD``) are in :mod:`attnbench.core.registry`; a walk-through from an empty
folder is ``docs/writing-a-backend.md``, and ``attnbench.testing.BackendConformance`` is the suite a
plugin's own tests run.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "attnbench"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def attnbench_backends() -> list[type]:
    """Return the backend classes this plugin provides.

    Each is a subclass of :class:`attnbench.Backend` with a unique ``name``. The registry calls
    this hook once per plugin, guarded: if it raises or returns something that breaks the contract
    (not a Backend subclass, a name already taken, a ``plugin_api`` outside the supported range),
    the plugin is recorded as broken with that error and shown by ``attnbench backends``; the
    other plugins and the built-ins keep working. Keep it cheap: import heavy dependencies inside
    the backend's methods, not here.
    """
    raise NotImplementedError  # spec only
