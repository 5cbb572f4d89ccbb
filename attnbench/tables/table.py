"""Results tables: one human-readable YAML file per device, holding the winner of every tuned key.

A table is written atomically (a temporary file, then ``os.replace``) under a lock, and merged with
what the file already holds, so several ``attnbench tune`` runs on one machine add to one table. A
file that cannot be read as a table is moved aside (``*.corrupt-<time>.yaml``) with a message, never
overwritten. A table tuned on another device is refused; a different torch/triton/attnbench version or
backend code hash only warns, since the ranking usually survives but the numbers may not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import yaml

from attnbench.core.device import DeviceProfile, triton_version
from attnbench.core.version import __version__
from attnbench.tables.files import load_yaml
from attnbench.tables.files import locked as _locked
from attnbench.tables.files import write_atomically as _write_atomically
from attnbench.tables.margin import SWITCH_MARGIN
from attnbench.tables.table_schema import CandidateResult, TableEntry, TableError, validate_entries

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
    "table_path",
    "validate_entries",
    "versions",
]

#: Format 2 adds ``end_of_table: true`` as the last key, so a truncated file is recognised.
FORMAT = 2
_READS = (1, 2)
_VERSION_KEYS = ("torch", "triton", "python", "cuda", "driver")


def versions() -> dict[str, str]:
    """The versions a table row records: attnbench's, torch's and Triton's."""

    return {"attnbench": __version__, "torch": str(torch.__version__), "triton": str(triton_version())}


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
            data = load_yaml(path.read_text())
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
