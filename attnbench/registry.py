"""The backend registry: a pluggy PluginManager over built-ins and entry-point plugins.

Built-in backends are registered through the same ``attnbench_backends`` hook as plugins. Then the
entry points of group ``attnbench.backends`` are loaded one at a time, each guarded: a plugin that
fails to import, declares an unsupported plugin-API version, or breaks the contract is recorded in
:attr:`Registry.failures` with its error, and the others still work.

Environment:
    ``ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD=1`` — load no entry-point plugins (built-ins only).
    ``ATTNBENCH_PLUGINS=a,b`` — load only these plugins (entry-point or distribution names).
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from attnbench import hookspecs
from attnbench.backend import PLUGIN_API_VERSION, Backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "SUPPORTED_PLUGIN_API",
    "BackendEntry",
    "PluginFailure",
    "Registry",
    "RegistryError",
    "load_registry",
]

ENTRY_POINT_GROUP = "attnbench.backends"
#: Plugin-API versions this core accepts (inclusive).
SUPPORTED_PLUGIN_API = (1, PLUGIN_API_VERSION)
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class RegistryError(LookupError):
    """Unknown backend name, or a contract broken by a built-in."""


@dataclass(frozen=True)
class Source:
    """Where a backend comes from."""

    kind: str  # "builtin" or "plugin"
    plugin: str  # entry-point name, or "builtin"
    distribution: str = "attnbench"
    version: str = ""

    def __str__(self) -> str:
        if self.kind == "builtin":
            return "built-in"
        dist = f"{self.distribution} {self.version}".strip()
        return f"plugin {self.plugin!r} ({dist})"


@dataclass(frozen=True)
class BackendEntry:
    name: str
    cls: type[Backend]
    source: Source

    def create(self) -> Backend:
        return self.cls()


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded or registered, with the error that stopped it."""

    plugin: str
    distribution: str
    version: str
    stage: str  # "import", "api-version", "register"
    error: str
    detail: str = ""

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} ({self.distribution} {self.version}) failed at {self.stage}: {self.error}"


@dataclass
class Registry:
    """Registered backends by name, plus plugins that failed and plugins that were skipped."""

    manager: pluggy.PluginManager
    entries: dict[str, BackendEntry] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return list(self.entries)

    def __iter__(self) -> Iterator[BackendEntry]:
        return iter(self.entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def entry(self, name: str) -> BackendEntry:
        if name not in self.entries:
            raise RegistryError(f"unknown backend {name!r}; registered: {', '.join(self.entries) or 'none'}")
        return self.entries[name]

    def get(self, name: str) -> Backend:
        """A fresh instance of the backend called ``name``."""
        return self.entry(name).create()

    def _add_from(self, plugin: object, source: Source) -> None:
        """Call one plugin's hook and validate what it returns; raise on any contract breach."""
        impls = [
            impl for impl in self.manager.hook.attnbench_backends.get_hookimpls() if impl.plugin is plugin
        ]
        new: list[BackendEntry] = []
        for impl in impls:
            result = impl.function()
            if not isinstance(result, (list, tuple)):
                raise TypeError(f"attnbench_backends() returned {type(result).__name__}; expected a list of classes")
            for cls in result:
                new.append(_validate_backend(cls, source))
        seen: dict[str, BackendEntry] = {}
        for e in new:
            other = self.entries.get(e.name) or seen.get(e.name)
            if other is not None:
                raise RegistryError(
                    f"backend name {e.name!r} from {e.source} is already registered by {other.source}"
                )
            seen[e.name] = e
        self.entries.update(seen)


def _validate_backend(cls: Any, source: Source) -> BackendEntry:
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{cls!r} is not a subclass of attnbench.Backend")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{cls.__qualname__}.name = {name!r}: must match [a-z][a-z0-9_]*")
    lo, hi = SUPPORTED_PLUGIN_API
    if not lo <= cls.plugin_api <= hi:
        raise ValueError(
            f"backend {name!r} declares plugin_api {cls.plugin_api}; this attnbench supports {lo}..{hi}"
        )
    if cls.kv_form not in ("expanded", "latent"):
        raise ValueError(f"backend {name!r}: kv_form {cls.kv_form!r} not in ('expanded', 'latent')")
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"backend {name!r} does not implement {missing}")
    return BackendEntry(name, cls, source)


def _allowed(ep: EntryPoint, allow: set[str] | None) -> bool:
    if allow is None:
        return True
    dist = ep.dist.name if ep.dist else ""
    return ep.name in allow or dist in allow


def load_registry(*, env: Mapping[str, str] | None = None, builtins: bool = True) -> Registry:
    """Build a registry: built-ins first, then entry-point plugins (each guarded).

    ``env`` defaults to ``os.environ`` (read for the two ``ATTNBENCH_*`` switches). No module-level
    state: each call builds a fresh registry.
    """
    env = os.environ if env is None else env
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    reg = Registry(manager=pm)
    if builtins:
        from attnbench import backends as builtin_backends

        pm.register(builtin_backends, name="builtin")
        reg._add_from(builtin_backends, Source("builtin", "builtin"))  # a broken built-in is a bug: raise
    if env.get("ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD", "").strip() not in ("", "0", "false", "no"):
        return reg
    allow_text = env.get("ATTNBENCH_PLUGINS")
    allow = {s.strip() for s in allow_text.split(",") if s.strip()} if allow_text is not None else None
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if not _allowed(ep, allow):
            reg.skipped.append(ep.name)
            continue
        load_plugin(reg, ep)
    return reg


def load_plugin(reg: Registry, ep: EntryPoint) -> None:
    """Load one entry point into ``reg``; any failure is recorded, never raised."""
    dist = ep.dist.name if ep.dist else "unknown"
    version = ep.dist.version if ep.dist else ""
    source = Source("plugin", ep.name, dist, version)

    def fail(stage: str, err: BaseException | str) -> None:
        detail = traceback.format_exc() if isinstance(err, BaseException) else ""
        msg = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else err
        reg.failures.append(PluginFailure(ep.name, dist, version, stage, msg, detail))

    try:
        plugin = ep.load()
    except BaseException as err:  # a plugin's import may raise anything, SystemExit included
        if isinstance(err, KeyboardInterrupt):
            raise
        fail("import", err)
        return
    api = getattr(plugin, "ATTNBENCH_PLUGIN_API", None)
    lo, hi = SUPPORTED_PLUGIN_API
    if not isinstance(api, int) or not lo <= api <= hi:
        fail(
            "api-version",
            f"declares ATTNBENCH_PLUGIN_API = {api!r}; this attnbench {_core_version()} supports {lo}..{hi}",
        )
        return
    try:
        reg.manager.register(plugin, name=f"plugin:{ep.name}")
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        fail("register", err)
        return
    try:
        reg._add_from(plugin, source)
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        reg.manager.unregister(plugin)
        fail("register", err)


def _core_version() -> str:
    from attnbench import __version__

    return __version__
