"""Where attnbench keeps what it measured: the one results location, shared by every reader and writer.

``attnbench tune``, ``attnbench calibrate``, ``attnbench select`` and :func:`attnbench.select` all find
the tuned tables (``tuning-<device>.yaml``), the study journal and the calibration files in one folder:

1. the folder given explicitly (``--results DIR`` on the command line, ``results_dir=`` in Python), else
2. ``$ATTNBENCH_RESULTS_DIR``, else
3. the per-user default ``$XDG_DATA_HOME/attnbench`` — ``~/.local/share/attnbench`` when
   ``XDG_DATA_HOME`` is unset (the XDG base-directory rule for user data). Tuned tables are data, not
   a cache: they take hours to measure again, so they do not live under ``~/.cache`` (which holds the
   device profile and the plugin probes, ``$ATTNBENCH_CACHE_DIR``, and may be cleared at any time).

Serving code therefore finds what ``tune`` wrote wherever it runs from. A folder given explicitly (or by
the variable) that does not exist is an error when reading (never a silent fallback to the heuristic);
``tune`` creates it. A folder holding :data:`REFERENCE_MARKER` (the repository's ``results/``, whose
files are committed reference runs) is written only when asked explicitly (``--update-reference``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "REFERENCE_MARKER",
    "RESULTS_ENV",
    "ResultsLocation",
    "ResultsLocationError",
    "check_table_file",
    "default_results_dir",
    "readable_results",
    "results_location",
    "writable_results",
]

#: The environment variable that moves the results location.
RESULTS_ENV = "ATTNBENCH_RESULTS_DIR"
#: A file of this name marks a folder of committed reference runs (the repository's ``results/``).
REFERENCE_MARKER = "REFERENCE.md"

Origin = Literal["option", "env", "default"]


class ResultsLocationError(ValueError):
    """A results folder or table that does not exist, is not a folder, or may not be written."""


@dataclass(frozen=True)
class ResultsLocation:
    """The results folder and where it came from (``option``, ``env`` or the per-user ``default``)."""

    path: Path
    origin: Origin

    def describe(self) -> str:
        """``/home/u/.local/share/attnbench (the per-user default; --results or $ATTNBENCH_RESULTS_DIR moves it)``."""
        why = {
            "option": "given with --results",
            "env": f"from ${RESULTS_ENV}",
            "default": f"the per-user default; --results or ${RESULTS_ENV} moves it",
        }[self.origin]
        return f"{self.path} ({why})"


def default_results_dir() -> Path:
    """The per-user default: ``$XDG_DATA_HOME/attnbench``, else ``~/.local/share/attnbench``."""
    data_home = os.environ.get("XDG_DATA_HOME")
    base = Path(data_home) if data_home and os.path.isabs(data_home) else Path.home() / ".local" / "share"
    return base / "attnbench"


def results_location(explicit: str | os.PathLike[str] | None = None) -> ResultsLocation:
    """The results folder: ``explicit``, else ``$ATTNBENCH_RESULTS_DIR``, else the per-user default."""
    if explicit is not None and str(explicit) != "":
        return ResultsLocation(Path(explicit).expanduser(), "option")
    env = os.environ.get(RESULTS_ENV)
    if env:
        return ResultsLocation(Path(env).expanduser(), "env")
    return ResultsLocation(default_results_dir(), "default")


def _name(location: ResultsLocation, option: str) -> str:
    return f"${RESULTS_ENV}" if location.origin == "env" else option


def readable_results(
    explicit: str | os.PathLike[str] | None = None, *, option: str = "--results"
) -> ResultsLocation:
    """The results folder to read from. A folder given explicitly or by ``$ATTNBENCH_RESULTS_DIR``
    must exist (raises :class:`ResultsLocationError` naming the option, the value and what is
    accepted); the per-user default may be missing (nothing tuned yet)."""
    location = results_location(explicit)
    if location.origin != "default" and not location.path.is_dir():
        what = "is not a folder" if location.path.exists() else "does not exist"
        raise ResultsLocationError(
            f"{_name(location, option)} {str(location.path)!r} {what}; accepted: an existing folder "
            f"holding tuned tables (the one `attnbench tune` printed), or neither {option} nor "
            f"${RESULTS_ENV} for the per-user default {default_results_dir()}"
        )
    return location


def writable_results(
    explicit: str | os.PathLike[str] | None = None,
    *,
    update_reference: bool = False,
    option: str = "--results",
) -> ResultsLocation:
    """The results folder to write to (created by the writer when missing). A folder of committed
    reference runs (it holds :data:`REFERENCE_MARKER`) is refused unless ``update_reference``."""
    location = results_location(explicit)
    if location.path.exists() and not location.path.is_dir():
        raise ResultsLocationError(
            f"{_name(location, option)} {str(location.path)!r} is not a folder; accepted: a folder "
            "(created if missing)"
        )
    if not update_reference and (location.path / REFERENCE_MARKER).is_file():
        raise ResultsLocationError(
            f"{_name(location, option)} {str(location.path)!r} holds committed reference runs "
            f"({REFERENCE_MARKER}); accepted: another folder, or --update-reference to rewrite them "
            f"on purpose (the per-user default is {default_results_dir()})"
        )
    return location


def check_table_file(path: str | os.PathLike[str], *, option: str = "--table") -> Path:
    """``path`` as a table file that exists; :class:`ResultsLocationError` naming ``option`` if not."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        hint = f" (for a folder use --results {str(p)!r})" if p.is_dir() else ""
        raise ResultsLocationError(
            f"{option} {str(p)!r} {what}; accepted: a tuning-<device>.yaml file written by "
            f"`attnbench tune`{hint}"
        )
    return p
