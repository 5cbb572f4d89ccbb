"""The plugin hooks of attnbench — the one module a plugin author needs to read.

A plugin is a module (or object) with functions marked ``@attnbench.hookimpl``. Built-in backends
are registered through these same hooks, so a plugin's backend is a first-class citizen.

A plugin module also declares the plugin-API version it was written for::

    # my_plugin.py
    import attnbench
    from my_plugin.backend import MyBackend

    ATTNBENCH_PLUGIN_API = 1

    @attnbench.hookimpl
    def attnbench_backends():
        return [MyBackend]

and is published under the entry-point group ``attnbench.backends``::

    [project.entry-points."attnbench.backends"]
    my_backend = "my_plugin"
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
