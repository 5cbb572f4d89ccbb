"""Writing files safely: atomically (temporary file, fsync, rename) with the umask's mode, under a lock;
reading the tables' YAML quickly."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

__all__ = ["load_yaml", "locked", "write_atomically"]

#: libyaml's parser where PyYAML was built with it (about ten times faster on a tuned table, which the
#: first ``select()`` reads), else PyYAML's own; both build the same objects with the safe constructor
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, through libyaml where present; raises :class:`yaml.YAMLError` alike."""
    return yaml.load(text, Loader=_LOADER)


def write_atomically(path: Path, text: str | bytes, *, mode: int | None = None) -> None:
    """Write ``text`` (or bytes) to ``path`` through a temporary file beside it, with ``mode``, by
    default the mode the umask gives a new file (``mkstemp`` would give 0600); the temporary file
    never outlives a failure."""
    mode = 0o666 & ~_umask() if mode is None else mode
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` would, racing other threads)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("Umask:")).split()[1], 8)
    return 0o022


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
