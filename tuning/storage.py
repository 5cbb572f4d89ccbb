"""Study storage: the embedded journal file (repaired when torn) or an Optuna RDB URL (PostgreSQL).

Journal: Optuna's ``JournalFileBackend`` appends one JSON line per operation under its lock file. A
write cut short (disk full, power loss) leaves a partial last line; the next append would glue a whole
line onto it and every later read would fail. :func:`repair_journal` therefore checks the file before
Optuna opens it and, under the journal's own lock, sets every unreadable piece aside (a
``studies.journal.torn-<time>`` file beside it) and keeps every whole line, including one glued onto a
torn fragment, so finished trials survive.

RDB: the URL goes to :class:`optuna.storages.RDBStorage` with heartbeats on. Creating the schema on
an empty PostgreSQL database is done under a PostgreSQL advisory lock, so a fleet can start at once
(other databases retry once the race is lost). A missing driver, an unreachable server or a folder
that does not exist is one :class:`StorageError` line naming the URL and what would work.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import JournalStorage
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
from optuna.storages.journal._file import get_lock_file
from optuna.trial import TrialState
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, ProgrammingError

from attnbench.tables.files import write_atomically

__all__ = [
    "JOURNAL_NAME",
    "StorageError",
    "close_abandoned",
    "heartbeat",
    "heartbeats_enabled",
    "open_storage",
    "redact",
    "repair_journal",
]

#: File name of the embedded study storage under the results directory.
JOURNAL_NAME = "studies.journal"
#: An arbitrary, fixed key for ``pg_advisory_lock`` while the schema is created.
_SCHEMA_LOCK = 0x617474_6E62  # "attnb"
_DRIVERS = {
    "postgresql": ("psycopg", "pip install 'attnbench[postgres]' (psycopg 3)"),
    "postgresql+psycopg": ("psycopg", "pip install 'attnbench[postgres]' (psycopg 3)"),
    "postgresql+psycopg2": ("psycopg2", "pip install psycopg2-binary, or use postgresql:// with psycopg 3"),
    "mysql": ("MySQLdb", "pip install mysqlclient, or use mysql+pymysql:// with PyMySQL"),
    "mysql+pymysql": ("pymysql", "pip install pymysql"),
}


class StorageError(ValueError):
    """A study storage that cannot be opened; the message is one line naming the URL or file."""


def redact(url: str) -> str:
    """``url`` without its password, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


# --------------------------------------------------------------------------------------------------
# the journal
# --------------------------------------------------------------------------------------------------
def _split_glued(line: bytes) -> tuple[bytes, bytes]:
    """``(torn prefix, whole JSON line)`` when ``line`` is a fragment with a whole record glued on."""
    start = line.find(b"{", 1)
    while start != -1:
        try:
            json.loads(line[start:])
        except ValueError:
            start = line.find(b"{", start + 1)
            continue
        return line[:start], line[start:]
    return line, b""


def _scan(data: bytes) -> tuple[bytes, bytes]:
    """``(kept, torn)``: every readable line of ``data``, and what was set aside."""
    kept: list[bytes] = []
    torn: list[bytes] = []
    for raw in data.splitlines(keepends=True):
        line = raw.rstrip(b"\r\n")
        if not raw.endswith(b"\n"):  # the last line, cut short
            torn.append(raw)
            continue
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError:
            prefix, whole = _split_glued(line)
            torn.append(prefix + b"\n")
            if whole:
                kept.append(whole + b"\n")
            continue
        kept.append(raw)
    return b"".join(kept), b"".join(torn)


def repair_journal(path: Path) -> str:
    """Set aside the torn parts of the journal at ``path``; return a message, or ``""`` if it was whole.

    Checked without the lock first (cheap); repaired under the journal's lock, so no other process
    appends meanwhile. The repaired file keeps the original's mode.
    """
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return ""
    if not _scan(path.read_bytes())[1]:
        return ""

    with get_lock_file(JournalFileSymlinkLock(str(path))):
        data = path.read_bytes()
        kept, torn = _scan(data)
        if not torn:
            return ""
        aside = path.with_name(f"{path.name}.torn-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        aside.write_bytes(torn)
        write_atomically(path, kept, mode=path.stat().st_mode & 0o7777)
    lines = kept.count(b"\n")
    return (
        f"study journal {path.name} had a torn write ({len(torn)} bytes, e.g. from a full disk); set it "
        f"aside in {aside.name} and kept the {lines} whole lines (finished trials are kept)"
    )


# --------------------------------------------------------------------------------------------------
# opening a storage
# --------------------------------------------------------------------------------------------------
def open_storage(
    url: str | None,
    *,
    results_dir: Path,
    heartbeat_s: int = 10,
    grace_s: int | None = None,
    messages: list[str] | None = None,
) -> Any:
    """``None`` → the embedded journal file under ``results_dir``; otherwise any Optuna RDB URL.

    RDB storages record a heartbeat every ``heartbeat_s`` seconds for each running trial (see
    :func:`heartbeat`); a trial silent for ``grace_s`` (default 3 × ``heartbeat_s``) is failed
    without a verdict and its candidate runs again. Messages (a repaired journal) are appended to
    ``messages``. Raises :class:`StorageError` with one line.
    """
    if url is None:
        results_dir = Path(results_dir)
        try:
            results_dir.mkdir(parents=True, exist_ok=True)
            path = results_dir / JOURNAL_NAME
            note = repair_journal(path)
            if note and messages is not None:
                messages.append(note)
            return JournalStorage(JournalFileBackend(str(path)))
        except OSError as err:
            raise StorageError(
                f"cannot use the study journal in {results_dir}: {err.strerror or err}; "
                "pass --results DIR (a folder you can write) or --storage URL"
            ) from None
    if "://" not in url:
        raise StorageError(
            f"--storage {url!r} is not a database URL; accepted: e.g. postgresql://user@host/db, sqlite:///f.db"
        )
    scheme = url.split("://", 1)[0].lower()
    driver = _DRIVERS.get(scheme)
    if driver is not None:
        try:
            __import__(driver[0])
        except ImportError:
            raise StorageError(
                f"--storage {redact(url)}: the database driver {driver[0]!r} is not installed; {driver[1]}"
            ) from None
    if scheme.startswith("sqlite"):
        target = url.split(":///", 1)[-1]
        if target and target != ":memory:" and not Path(target).parent.resolve().is_dir():
            raise StorageError(
                f"--storage {url}: folder {str(Path(target).parent)!r} does not exist; create it or name "
                "a file in an existing folder"
            )
    try:
        with _schema_lock(url):
            return _rdb(url, heartbeat_s=heartbeat_s, grace_s=grace_s)
    except StorageError:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StorageError(f"--storage {redact(url)}: cannot open the database: {first}") from None


def _rdb(url: str, *, heartbeat_s: int, grace_s: int | None) -> Any:

    for attempt in range(5):
        try:
            with warnings.catch_warnings():  # heartbeat_interval is "experimental"; it is what we need
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url,
                    heartbeat_interval=heartbeat_s,
                    grace_period=grace_s or 3 * heartbeat_s,
                    engine_kwargs={"pool_pre_ping": True},
                )
        except (IntegrityError, ProgrammingError):  # lost a schema-creation race (not PostgreSQL)
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _schema_lock(url: str) -> Iterator[None]:
    """On PostgreSQL, hold an advisory lock while Optuna creates or checks its tables."""
    if not url.lower().startswith("postgresql"):
        yield
        return

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _SCHEMA_LOCK})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": _SCHEMA_LOCK})
                conn.commit()
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------------
# heartbeats
# --------------------------------------------------------------------------------------------------
def heartbeats_enabled(storage: Any) -> bool:

    return is_heartbeat_enabled(storage)


@contextlib.contextmanager
def heartbeat(storage: Any, trial_id: int) -> Iterator[None]:
    """Record ``trial_id``'s heartbeat from a thread while the block runs (a no-op for the journal).

    Optuna records heartbeats only inside ``study.optimize``; the tuner uses ask/tell, so it runs the
    same loop itself. A failed heartbeat (database briefly away) is retried at the next beat.
    """
    if not heartbeats_enabled(storage):
        yield
        return
    stop = threading.Event()
    interval = storage.get_heartbeat_interval()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    storage.record_heartbeat(trial_id)  # the first beat before the candidate starts
    thread = threading.Thread(target=beat, name=f"attnbench-heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fail_stale(study: optuna.Study) -> int:
    """Fail trials whose heartbeat stopped (their tuner died, on any machine); return how many."""
    storage = study._storage
    if not heartbeats_enabled(storage):
        return 0
    before = sum(1 for _ in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    after = sum(1 for _ in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)))
    return max(0, before - after)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def close_abandoned(study: optuna.Study, storage: Any, *, timeout_s: float, host: str) -> None:
    """Trials whose tuner is gone: by heartbeat on RDB storages; by PID on this host for the journal.

    A trial silent far past the timeout is closed either way (e.g. killed before its first beat).
    """
    if heartbeats_enabled(storage):
        fail_stale(study)
    now = time.time()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        a = t.user_attrs
        started = t.datetime_start.timestamp() if t.datetime_start else now
        if a.get("pid") == os.getpid() and a.get("host") == host:
            continue
        by_pid = not heartbeats_enabled(storage) and a.get("host") == host
        dead = (by_pid and not _alive(int(a.get("pid", 0)))) or now - started > 3 * timeout_s + 600
        if dead:
            storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            storage.set_trial_user_attr(t._trial_id, "reason", "abandoned: its process is gone")
            study.tell(t.number, state=TrialState.FAIL)
