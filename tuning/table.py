"""Results tables: one human-readable YAML file per device, holding the winner of every tuned key.

A table is written atomically (a temporary file, then ``os.replace``) under a lock, and merged with
what the file already holds, so several ``attnbench tune`` runs on one machine add to one table. A
file that cannot be read as a table is moved aside (``*.corrupt-<time>.yaml``) with a message, never
overwritten. A table tuned on another device is refused; a different torch/triton/attnbench version or
backend code hash only warns, since the ranking usually survives but the numbers may not.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from attnbench.device import DeviceProfile
from attnbench.tuning.study import KeyResult, TrialRecord
from attnbench.tuning.table_schema import CandidateResult, TableEntry, TableError, validate_entries

__all__ = [
    "FORMAT",
    "SWITCH_MARGIN",
    "CandidateResult",
    "DeviceMismatchError",
    "ResultsTable",
    "TableEntry",
    "TableError",
    "TableReadError",
    "hardware_id",
    "summarize",
    "table_path",
    "validate_entries",
    "versions",
]

#: Format 2 adds ``end_of_table: true`` as the last key, so a truncated file is recognised.
FORMAT = 2
_READS = (1, 2)
#: A tuned winner replaces the default backend only when the default is this much slower (5 %).
SWITCH_MARGIN = 0.05
_VERSION_KEYS = ("torch", "triton", "python", "cuda", "driver")


class DeviceMismatchError(TableError):
    pass


class TableReadError(TableError):
    """The file exists but cannot be read (e.g. no permission): never moved aside."""


def hardware_id(fingerprint: Mapping[str, Any]) -> str:
    """Id of the device without library versions (a new torch keeps the table, with a warning)."""
    hw = {k: v for k, v in fingerprint.items() if k not in _VERSION_KEYS}
    return hashlib.sha256(json.dumps(hw, sort_keys=True).encode()).hexdigest()[:12]


def table_path(results_dir: Path, fingerprint: Mapping[str, Any]) -> Path:
    name = re.sub(r"[^a-z0-9]+", "-", str(fingerprint.get("name", "device")).lower()).strip("-")[:48]
    return (
        Path(results_dir) / f"tuning-{fingerprint.get('kind', 'cpu')}-{name}-{hardware_id(fingerprint)}.yaml"
    )


def versions() -> dict[str, str]:
    import torch

    from attnbench import __version__
    from attnbench.device import _triton_version

    return {"attnbench": __version__, "torch": str(torch.__version__), "triton": str(_triton_version())}


# --------------------------------------------------------------------------------------------------
# a study's outcome as a table entry
# --------------------------------------------------------------------------------------------------
def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 4)


def _gate_summary(check: dict[str, Any] | None) -> dict[str, Any] | None:
    """The gate's numbers a table keeps: worst error, calibration error, their ratio, the bound."""
    if not check:
        return None

    def few(d: dict[str, Any] | None) -> dict[str, Any] | None:
        keys = ("max_abs", "rel_l2", "cosine")
        return {k: float(f"{d[k]:.4g}") for k in keys if isinstance(d.get(k), (int, float))} if d else None

    out = {
        "error": few(check.get("error")),
        "calibration": few(check.get("calibration")),
        "multiple": check.get("multiple"),
        "ratios": {k: float(f"{v:.3g}") for k, v in (check.get("ratios") or {}).items()},
        "retrieval": check.get("retrieval"),
        "workload": check.get("workload"),
    }
    if check.get("stored_error"):
        out["stored_error"] = few(check.get("stored_error"))
    return {k: v for k, v in out.items() if v is not None}


def _cand(r: TrialRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": r.candidate.backend, "config": dict(r.candidate.config)}
    gate = _gate_summary(r.attrs.get("check"))
    if gate:
        out["gate"] = gate
    if r.attrs.get("lossy") or (r.attrs.get("check") or {}).get("lossy"):
        out["lossy"] = r.attrs.get("lossy") or r.attrs["check"]["lossy"]
    if r.ok:
        m = r.attrs
        out |= {"step_ms": _ms(r.value)}
        if m.get("gbps") is not None:
            out["gbps"] = round(m["gbps"], 3)
        if m.get("pct_of_bandwidth") is not None:
            out["pct_of_bandwidth"] = round(m["pct_of_bandwidth"], 2)
        if m.get("implementation"):
            out["implementation"] = m["implementation"]
    else:
        out |= {"failed": r.kind, "reason": r.reason}
        err = (r.attrs.get("check") or {}).get("error")
        if err:
            out["error"] = {k: err[k] for k in ("max_abs", "rel_l2", "cosine", "nonfinite") if k in err}
    return out


def summarize(
    result: KeyResult, *, profile: DeviceProfile, margin: float = SWITCH_MARGIN, command: str = ""
) -> dict:
    """The table entry for one tuned key: winner, runner-up, margin, default, every candidate."""
    plan = result.plan
    ok = sorted((r for r in result.records if r.ok), key=lambda r: r.value or math.inf)
    default = plan.space.default_candidate() if plan.space.default_backend else None
    default_rec = next(
        (r for r in result.records if default and r.candidate.ident() == default.ident()), None
    )
    winner, decision = None, "no candidate passed the correctness gate"
    if ok:
        best = ok[0]
        winner, decision = best, "fastest correct candidate"
        if default_rec is not None and default_rec.ok and default_rec is not best:
            gain = default_rec.value / best.value - 1  # type: ignore[operator]
            if gain < margin:
                winner = default_rec
                decision = (
                    f"kept the default {default_rec.candidate.label()}: the fastest, {best.candidate.label()}, "
                    f"is only {gain:.1%} faster (switch margin {margin:.0%})"
                )
            else:
                decision = (
                    f"fastest correct candidate; {gain:.1%} faster than the default (margin {margin:.0%})"
                )
        elif default_rec is not None and not default_rec.ok:
            decision = f"fastest correct candidate; the default failed ({default_rec.kind})"
    runner = next((r for r in ok if r is not winner), None)
    entry: dict[str, Any] = {
        "model": plan.key.model,
        "shape_hash": plan.key.shape_hash,
        "dtype": plan.key.dtype,
        "batch_bucket": plan.key.batch_bucket,
        "context_bucket": plan.key.context_bucket,
        "measured_at": {"batch": plan.workload.batch, "context": plan.workload.context},
        "winner": _cand(winner) if winner else None,
        "decision": decision,
        "runner_up": _cand(runner) if runner else None,
        "margin": round(runner.value / winner.value - 1, 4) if runner and winner else None,  # type: ignore[operator]
        "default": _cand(default_rec)
        if default_rec
        else ({"backend": default.backend, "missing": True} if default else None),
        "switch_margin": margin,
        "candidates": [_cand(r) for r in sorted(result.records, key=lambda r: (not r.ok, r.value or 0))],
        "excluded": [e.as_dict() for e in plan.space.excluded],
        "complete": result.complete,
        "study": plan.study_name,
        "trials": len(result.records),
        "search": "grid" if plan.exhaustive else "tpe",
        "space_size": plan.space.size(),
        "device_fingerprint_id": profile.id,
        "code_hash": plan.code_hash,
        "versions": versions(),
        "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    if command:
        entry["command"] = command
    return TableEntry.from_dict(entry, where=plan.key.row).as_dict()  # the schema holds for what we write


# --------------------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------------------
@dataclass
class ResultsTable:
    """A loaded table. ``warnings`` says what differs from this machine's software."""

    path: Path
    device: dict[str, Any]
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # validated: TableEntry.as_dict()
    meta: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def typed(self) -> dict[str, TableEntry]:
        """The entries as :class:`TableEntry` objects."""
        return validate_entries(self.entries)

    @classmethod
    def load(cls, path: Path, *, fingerprint: Mapping[str, Any] | None = None) -> ResultsTable:
        """Read ``path``; refuse it when ``fingerprint`` (this device) is another device.

        A missing file is an empty table. Raises :class:`TableError` for an unreadable file and
        :class:`DeviceMismatchError` for another device's table.
        """
        path = Path(path)
        if not path.exists():
            return cls(path, {"fingerprint": dict(fingerprint or {})})
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as err:
            raise TableReadError(f"cannot read results table {path}: {err.strerror or err}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise TableError(
                f"results table {path.name} is not valid YAML ({str(err).splitlines()[0]})"
            ) from None
        problem = _malformed(data)
        if problem:
            raise TableError(f"results table {path.name} is not an attnbench table: {problem}")
        try:
            entries = {row: e.as_dict() for row, e in validate_entries(data.get("entries") or {}).items()}
        except TableError as err:
            raise TableError(f"results table {path.name} is not a valid table: {err}") from None
        table = cls(path, data["device"], entries, data.get("meta") or {})
        if fingerprint is not None:
            here, there = hardware_id(fingerprint), table.device.get("hardware_id")
            if here != there:
                raise DeviceMismatchError(
                    f"results table {path.name} was tuned on {table.device.get('fingerprint', {}).get('name')!r} "
                    f"(hardware id {there}); this device is {fingerprint.get('name')!r} (hardware id {here}). "
                    "Refusing to use another device's table: run `attnbench tune` here."
                )
            now = versions()
            for row, entry in table.entries.items():
                old = entry.get("versions") or {}
                diff = [f"{k} {old.get(k)} → {v}" for k, v in now.items() if old.get(k) != v]
                if diff:
                    table.warnings.append(
                        f"{row}: tuned under other versions ({', '.join(diff)}); consider re-tuning"
                    )
        return table

    def save(self, entries: Mapping[str, dict[str, Any]], *, profile: DeviceProfile) -> list[str]:
        """Merge ``entries`` into the file atomically; returns messages (e.g. a corrupt file moved aside)."""
        messages: list[str] = []
        entries = {row: e.as_dict() for row, e in validate_entries(entries).items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path):
                self._save_locked(entries, profile=profile, messages=messages)
        except OSError as err:
            raise TableError(
                f"cannot write results table {self.path}: {err.strerror or err}; "
                "pass --results DIR (a folder you can write, with free space)"
            ) from None
        return messages

    def _save_locked(
        self, entries: Mapping[str, dict[str, Any]], *, profile: DeviceProfile, messages: list[str]
    ) -> None:
        try:
            current = ResultsTable.load(self.path, fingerprint=profile.fingerprint)
        except (DeviceMismatchError, TableReadError):
            raise
        except TableError as err:
            aside = self.path.with_name(f"{self.path.stem}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}.yaml")
            os.replace(self.path, aside)
            messages.append(f"{err}; moved it aside to {aside.name} and started a new table")
            current = ResultsTable(self.path, {})
        merged = dict(current.entries) | dict(entries)
        self.entries = dict(sorted(merged.items()))
        self.device = {
            "hardware_id": hardware_id(profile.fingerprint),
            "fingerprint": profile.fingerprint,
            "fingerprint_id": profile.id,
            "bandwidth_gbps": round(profile.bandwidth / 1e9, 3),
            "bandwidth_measured_at": profile.measured_at,
        }
        self.meta = {
            "written_by": "attnbench tune",
            "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **versions(),
            "note": "timings from a shared machine: see load_avg per entry",
        }
        body = {
            "format": FORMAT,
            "device": self.device,
            "meta": self.meta,
            "entries": self.entries,
            "end_of_table": True,
        }
        body = json.loads(json.dumps(body, default=str))  # plain types only (e.g. TorchVersion → str)
        text = "# attnbench tuning table: written by `attnbench tune`; regenerate it, do not edit numbers.\n"
        text += yaml.safe_dump(body, sort_keys=False, allow_unicode=True, width=110)
        _write_atomically(self.path, text)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, with the mode the umask gives
    a new file (``mkstemp`` would give 0600); the temporary file never outlives a failure."""
    umask = _umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask)
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


def _malformed(data: Any) -> str:
    if not isinstance(data, dict):
        return f"expected a mapping at the top, got {type(data).__name__}"
    if data.get("format") not in _READS:
        return f"format {data.get('format')!r}; this attnbench reads formats {', '.join(map(str, _READS))}"
    if data["format"] >= 2 and data.get("end_of_table") is not True:
        return "no 'end_of_table: true' at the end: the file was cut short (truncated)"
    if not isinstance(data.get("device"), dict) or "hardware_id" not in data["device"]:
        return "field 'device.hardware_id' is missing"
    if not isinstance(data.get("entries") or {}, dict):
        return "field 'entries' is not a mapping"
    return ""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
