"""Fake plugin distributions for the registry, plugin and fault tests.

A fake plugin is a module plus a ``*.dist-info`` (``METADATA`` and ``entry_points.txt``) in a directory
put on the path: that is all ``importlib.metadata`` needs to find an entry point, so no pip is involved.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

_PLUGIN = """
import attnbench
from attnbench.backends.naive import NaiveBackend

ATTNBENCH_PLUGIN_API = {api}
{preamble}

class {cls}(NaiveBackend):
    name = "{name}"
{body}

@attnbench.hookimpl
def attnbench_backends():
    return [{cls}]
"""


def plugin_source(cls: str, name: str, *, api: int = 1, body: str = "", preamble: str = "") -> str:
    """A plugin module declaring plugin API ``api`` whose hook returns one backend: class ``cls``, naive
    attention under the name ``name``. ``body``: more lines of the class; ``preamble``: module lines
    that run before the class is defined."""
    return _PLUGIN.format(
        api=api,
        preamble=textwrap.dedent(preamble),
        cls=cls,
        name=name,
        body=textwrap.indent(textwrap.dedent(body), "    "),
    )


def write_fake_dist(site: Path, *, entry: str, dist: str, version: str, module: str, source: str) -> None:
    """A minimal installed distribution in ``site``: ``module.py`` and ``<dist>-<version>.dist-info``
    whose entry point ``entry`` (group ``attnbench.backends``) names the module."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[attnbench.backends]\n{entry} = {module}\n")


def pythonpath(*paths: Path) -> str:
    """``PYTHONPATH`` for a subprocess: ``paths`` first, then this process's own ``PYTHONPATH``."""
    return os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])


def plugin_env(site: Path, *, allow: str) -> dict[str, str]:
    """This process's environment for a subprocess that loads only the plugins ``allow`` from ``site``
    (autoloading on, whatever the test run set)."""
    env = {**os.environ, "PYTHONPATH": pythonpath(site), "ATTNBENCH_PLUGINS": allow}
    env.pop("ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD", None)
    return env
