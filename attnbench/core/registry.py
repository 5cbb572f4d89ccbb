"""The backend registry: a pluggy PluginManager over built-ins and entry-point plugins.

Built-in backends are registered through the same ``attnbench_backends`` hook as plugins. Then the
entry points of group ``attnbench.backends`` are loaded one at a time, each guarded: a plugin that
fails to import, declares an unsupported plugin-API version, or breaks the contract is recorded in
:attr:`Registry.failures` with its error, and the others still work.

Environment:
    ``ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD=1`` — load no entry-point plugins (built-ins only). Any value
    other than empty, ``0``, ``false``, ``no`` or ``off`` (any case) disables autoloading, and it wins
    over ``ATTNBENCH_PLUGINS``.
    ``ATTNBENCH_PLUGINS=a,b`` — load only these plugins, each named by its entry-point name or its
    distribution name (``attnbench-flex`` and ``attnbench_flex`` are the same name). Plugins left out
    are listed in :attr:`Registry.skipped`; names that match no installed plugin are listed in
    :attr:`Registry.unmatched`, so a typo is visible rather than silently giving fewer backends. An
    empty value is the same as unset.

The plugin contract (checked per plugin, in this order; the first breach stops that plugin only):

1. ``import`` — the entry point loads (its module imports without raising). The module is imported
   in a child process first, with a deadline (``ATTNBENCH_PLUGIN_TIMEOUT``, 60 s): an import that
   hangs is recorded as a failure instead of hanging the caller; one that finished is remembered
   (under ``$ATTNBENCH_CACHE_DIR/plugin-imports``) until the plugin's version or top-level file changes;
2. ``api-version`` — the module declares ``ATTNBENCH_PLUGIN_API`` (an int) within
   :data:`SUPPORTED_PLUGIN_API`;
3. ``register`` — pluggy accepts its hooks, it implements ``attnbench_backends``, which returns a list
   of :class:`~attnbench.Backend` subclasses that are valid, instantiate without arguments, and whose
   names are not taken (by a built-in or an earlier plugin; plugins load in entry-point-name order).
   A backend class whose own ``plugin_api`` is outside the range is reported at stage ``api-version``.
   A plugin is all or nothing: if one of its backends breaks the contract, none is registered.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import pluggy

from attnbench import hookspecs
from attnbench.core.backend import PLUGIN_API_VERSION, Backend
from attnbench.core.child import run_child
from attnbench.core.device import cache_dir
from attnbench.core.version import __version__

__all__ = [
    "BUILTIN_MODULE",
    "DEFAULT_TIMEOUT_S",
    "ENTRY_POINT_GROUP",
    "SUPPORTED_PLUGIN_API",
    "BackendEntry",
    "PluginAPIError",
    "PluginFailure",
    "Registry",
    "RegistryError",
    "Source",
    "code_hash",
    "load_backend_class",
    "load_plugin",
    "load_registry",
    "plugin_timeout",
]

ENTRY_POINT_GROUP = "attnbench.backends"
#: The module whose ``attnbench_backends`` hook registers the built-in backends.
BUILTIN_MODULE = "attnbench.backends"
#: Plugin-API versions this core accepts (inclusive).
SUPPORTED_PLUGIN_API = (1, PLUGIN_API_VERSION)
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class RegistryError(LookupError):
    """Unknown backend name, or a contract broken by a built-in."""


class PluginAPIError(ValueError):
    """A backend class declares a ``plugin_api`` this attnbench does not support."""


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
        dist = f"{self.distribution} {self.version}".strip()
        return f"plugin {self.plugin!r} ({dist}) failed at {self.stage}: {self.error}"

    def as_dict(self) -> dict[str, str]:
        """The fields, ``detail`` under the name ``traceback``."""
        record = asdict(self)
        record["traceback"] = record.pop("detail")
        return record


@dataclass
class Registry:
    """Registered backends by name, plus what happened to each entry-point plugin.

    ``failures``: plugins that failed (with stage and error); ``skipped``: plugins left out by
    ``ATTNBENCH_PLUGINS``; ``unmatched``: names in ``ATTNBENCH_PLUGINS`` that match no installed plugin;
    ``autoload_disabled``: ``ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD`` was set, so no plugin was looked at.
    """

    manager: pluggy.PluginManager
    entries: dict[str, BackendEntry] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    autoload_disabled: bool = False

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
        if not impls:
            raise TypeError(
                "implements no attnbench_backends hook (a function named attnbench_backends marked "
                "with @attnbench.hookimpl in the entry point's module)"
            )
        new: list[BackendEntry] = []
        for impl in impls:
            result = impl.function()
            if not isinstance(result, (list, tuple)):
                raise TypeError(
                    f"attnbench_backends() returned {type(result).__name__}; expected a list of classes"
                )
            new += [_validate_backend(cls, source) for cls in result]
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
    api = getattr(cls, "plugin_api", None)
    if isinstance(api, bool) or not isinstance(api, int) or not lo <= api <= hi:
        raise PluginAPIError(
            f"backend {name!r} ({cls.__module__}.{cls.__qualname__}) declares plugin_api {cls.plugin_api!r}; "
            f"this attnbench {__version__} supports {_range_text()}"
        )
    if cls.kv_form not in ("expanded", "latent"):
        raise ValueError(f"backend {name!r}: kv_form {cls.kv_form!r} not in ('expanded', 'latent')")
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"backend {name!r} does not implement {missing}")
    try:
        cls()  # the registry and the CLI instantiate backends freely: it must be cheap and never raise
    except Exception as err:
        raise TypeError(f"backend {name!r}: {cls.__qualname__}() raised {type(err).__name__}: {err}") from err
    return BackendEntry(name, cls, source)


def _normalize(name: str) -> str:
    """Distribution-name normalisation (PEP 503): ``Attnbench_Flex`` == ``attnbench-flex``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _plugin_names(ep: EntryPoint) -> set[str]:
    names = {_normalize(ep.name)}
    if ep.dist is not None:
        names.add(_normalize(ep.dist.name))
    return names


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


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
        # the built-ins are a plugin like any other, one layer up: loaded by name, as entry points are
        builtin_backends = importlib.import_module(BUILTIN_MODULE)
        pm.register(builtin_backends, name="builtin")
        reg._add_from(builtin_backends, Source("builtin", "builtin"))  # a broken built-in is a bug: raise
    if _flag(env.get("ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD")):
        reg.autoload_disabled = True
        return reg
    allow = [s.strip() for s in env.get("ATTNBENCH_PLUGINS", "").split(",") if s.strip()]
    eps = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    if allow:
        wanted = {_normalize(a) for a in allow}
        reg.unmatched = [a for a in allow if not any(_normalize(a) in _plugin_names(ep) for ep in eps)]
    for ep in eps:
        if allow and not wanted & _plugin_names(ep):
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
        if stage == "import":
            msg = f"importing {ep.value!r} raised {msg}"
        reg.failures.append(PluginFailure(ep.name, dist, version, stage, msg, detail))

    hang = _import_hangs(ep)
    if hang:
        fail("import", hang)
        return
    try:
        plugin = ep.load()
    except BaseException as err:  # a plugin's import may raise anything, SystemExit included
        if isinstance(err, KeyboardInterrupt):
            raise
        fail("import", err)
        return
    api = getattr(plugin, "ATTNBENCH_PLUGIN_API", None)
    lo, hi = SUPPORTED_PLUGIN_API
    if api is None or isinstance(api, bool) or not isinstance(api, int) or not lo <= api <= hi:
        what = (
            "does not declare ATTNBENCH_PLUGIN_API"
            if api is None
            else f"declares ATTNBENCH_PLUGIN_API = {api!r}"
        )
        fail(
            "api-version",
            f"{source} {what}, but this attnbench {__version__} supports {_range_text()}: "
            f"install a release of {dist} written for that API, or an attnbench that supports its API",
        )
        return
    registered = False
    try:
        reg.manager.register(plugin, name=f"plugin:{ep.name}")
        registered = True
        reg._add_from(plugin, source)
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        if registered:
            reg.manager.unregister(plugin)
        fail("api-version" if isinstance(err, PluginAPIError) else "register", err)


def _import_key(ep: EntryPoint) -> str:
    """What decides whether an earlier bounded import still holds: the entry point, its distribution's
    name and version, and the size and mtime of the module's top-level file (found without importing)."""

    top = ep.value.partition(":")[0].split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
        origin = spec.origin if spec is not None else None
        st = os.stat(origin) if origin and os.path.exists(origin) else None
    except (ImportError, ValueError, OSError):
        st = None
    parts = [ep.value, ep.dist.name if ep.dist else "", ep.dist.version if ep.dist else ""]
    parts += [str(st.st_size), str(st.st_mtime_ns)] if st else ["?"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


#: Seconds a plugin backend has to answer, or its module to import (``$ATTNBENCH_PLUGIN_TIMEOUT`` overrides).
DEFAULT_TIMEOUT_S = 60.0


def plugin_timeout() -> float:
    """Seconds a plugin backend has to answer: ``$ATTNBENCH_PLUGIN_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`."""
    try:
        return float(os.environ.get("ATTNBENCH_PLUGIN_TIMEOUT") or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _import_hangs(ep: EntryPoint) -> str:
    """Import the plugin's module in a child process first, with a deadline (a thread cannot bound an
    import that hangs holding the GIL); ``""`` when it finishes (remembered, keyed by
    :func:`_import_key`), else why it was skipped. Errors are left for the real import to report."""

    marker = cache_dir() / "plugin-imports" / f"{_import_key(ep)}.ok"
    if marker.exists():
        return ""
    module = ep.value.partition(":")[0].strip()
    timeout = plugin_timeout()
    run = run_child(
        ["-c", f"import importlib; importlib.import_module({module!r})"],
        timeout=timeout,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    if run.timed_out:
        return (
            f"importing {ep.value!r} did not finish within {timeout:g} s (it hangs); skipped "
            "(ATTNBENCH_PLUGIN_TIMEOUT sets the limit)"
        )
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass  # an unwritable cache only costs time
    return ""


def _range_text() -> str:
    lo, hi = SUPPORTED_PLUGIN_API
    return f"{lo}..{hi}"


def load_backend_class(ref: str) -> type[Backend]:
    """``"pkg.module:Class"`` → the class; a plain name is looked up in the default registry."""
    if ":" not in ref:
        return load_registry().entry(ref).cls
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise TypeError(f"{ref!r} is not an attnbench.Backend subclass")
    return obj


def code_hash(classes: Iterable[type[Backend]]) -> str:
    """Short hash of the source files that define ``classes`` — each one's module and its
    :attr:`~attnbench.core.backend.Backend.code_files` (a backend's code changed → new hash)."""
    h = hashlib.sha256()
    for cls in sorted(set(classes), key=lambda c: c.name):
        try:
            source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]  # None: TypeError below
        except (OSError, TypeError):
            source = f"{cls.__module__}:{cls.__qualname__}"
        h.update(cls.name.encode() + b"\0" + source.encode() + b"\0")
        for path in getattr(cls, "code_files", ()):  # by file name: the same tree hashes alike anywhere
            name = Path(path).name.encode()
            try:
                h.update(name + b"\0" + Path(path).read_bytes() + b"\0")
            except OSError:
                h.update(name + b"\0missing\0")
    return h.hexdigest()[:12]
