"""Calibration by measurement: a small, identifiable model of decode-step time per (device, backend, dtype).

Within one geometry and dtype, a step's bytes and FLOPs are both proportional to batch × context, so
``t0 + bytes / bw + flops / peak`` cannot be told apart by data. What measured steps *can* tell apart::

    t = layers · (t0 + t_seq · batch) + kv_bytes / bw_eff

a fixed cost per layer (``t0``: launches, the per-call work), a cost per sequence and layer (``t_seq``:
per-row setup, softmax, small matmuls) and streaming (``bw_eff``: the bandwidth the backend actually
reaches — or its arithmetic per byte, for a backend that is compute-bound in bytes' proportion). It is
fitted by non-negative least squares on *relative* errors over at least :data:`MIN_POINTS` points
spanning at least :data:`MIN_SPAN` × in batch × context, and stored with its fit error.

Some backends read a byte more slowly once one sequence's K/V of a layer outgrows the caches (torch
SDPA on a CPU reads a KV head once per query head; past the last-level cache those reads go to
memory): their cost per byte grows with the log of that size past a knee. With at least
:data:`KNEE_MIN_POINTS` points over enough sizes, the fit also tries a knee at each geometric midpoint
between the sizes it has (``knee_bytes``) with a term ``kv_bytes · s_knee · log2(seq_bytes / knee)``
beyond it, and keeps the best one only when it cuts the rms error by :data:`KNEE_GAIN` × or more::

    t = layers · (t0 + t_seq · batch) + kv_bytes · (1 / bw_eff + s_knee · log2⁺(seq_bytes / knee_bytes))

where ``seq_bytes = kv_bytes / (layers · batch)`` (one sequence, one layer).

Fits are made for each (backend, dtype) over every geometry measured, and for each (backend, dtype,
geometry) with enough points of its own; a prediction uses the geometry's own fit when there is one.
The points come from what ``attnbench tune`` (the tuned table: each candidate's step time and GB/s)
and ``attnbench bench`` (its JSON) already measure; ``attnbench calibrate`` writes the file
``calibration-<device>.yaml`` beside the device's tuned table (schema: :class:`Calibration`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from attnbench.core.locations import results_location
from attnbench.core.traffic import backend_kv_bytes_per_token, kv_bytes_per_step
from attnbench.core.workload import Workload
from attnbench.tables.table import hardware_id, table_path
from attnbench.tables.table_schema import validate_entries

if TYPE_CHECKING:
    from attnbench.core.backend import Backend
    from attnbench.core.registry import Registry
    from attnbench.core.workload import Workload

__all__ = [
    "Calibration",
    "CalibrationError",
    "CalibrationPoint",
    "Fit",
    "calibration_path",
    "find_calibration",
    "fit_points",
    "geometry_key",
    "nonnegative_lstsq",
    "points_from_bench",
    "points_from_table",
]

FORMAT = 1
MIN_POINTS = 5
MIN_SPAN = 16.0
MODEL = "t = layers · (t0 + t_seq · batch) + kv_bytes · (1 / bw_eff + s_knee · log2⁺(seq_bytes / knee_bytes))"
#: a knee is tried only over this many points, with two sizes or more beyond it …
KNEE_MIN_POINTS = 8
#: … and kept only when it divides the fit's rms relative error by this much
KNEE_GAIN = 1.5


class CalibrationError(ValueError):
    """A calibration file or a fit that cannot be used; the message says which field or why."""


def geometry_key(backend: Backend, workload: Workload) -> str:
    """The attention geometry a backend sees, as a key: ``expanded:q32/kv8/d128+128``."""
    g = workload.geometry(backend.kv_form)
    return f"{backend.kv_form}:q{g.num_q_heads}/kv{g.num_kv_heads}/d{g.qk_head_dim}+{g.v_head_dim}"


@dataclass(frozen=True)
class CalibrationPoint:
    """One measured decode step: ``step_s`` for ``layers`` layers reading ``kv_bytes``."""

    backend: str
    dtype: str
    geometry: str
    batch: int
    context: int
    layers: int
    kv_bytes: float
    step_s: float
    source: str = ""

    @property
    def tokens(self) -> int:
        return self.batch * (self.context + 1)


@dataclass(frozen=True)
class Fit:
    """``t = layers · (t0_s + t_seq_s · batch) + kv_bytes · (s_per_byte + s_knee_per_byte ·
    log2⁺(seq_bytes / knee_bytes))`` for one (backend, dtype[, geometry]); no knee: ``knee_bytes`` 0."""

    backend: str
    dtype: str
    geometry: str | None  # None: fitted over every geometry measured
    t0_s: float
    t_seq_s: float
    s_per_byte: float
    points: int
    span: float  # max / min of batch × context over the points
    rms_rel_error: float
    max_rel_error: float
    s_knee_per_byte: float = 0.0  # seconds per byte per doubling of seq_bytes past the knee
    knee_bytes: float = 0.0  # one sequence's K/V in one layer where the knee starts (0: no knee)

    @property
    def bw_eff(self) -> float:
        """Effective streaming bandwidth in bytes/s (infinite when the fit found no streaming term)."""
        return 1.0 / self.s_per_byte if self.s_per_byte > 0 else float("inf")

    def predict_s(self, *, batch: int, kv_bytes: float, layers: int) -> float:
        """The step time of ``layers`` layers over ``batch`` sequences reading ``kv_bytes`` in all."""
        per_byte = self.s_per_byte
        if self.knee_bytes > 0 and layers > 0 and batch > 0:
            per_byte += self.s_knee_per_byte * _past_knee(kv_bytes / (layers * batch), self.knee_bytes)
        return layers * (self.t0_s + self.t_seq_s * batch) + kv_bytes * per_byte

    def describe(self) -> str:
        where = self.geometry or "all geometries"
        knee = ""
        if self.knee_bytes > 0:
            knee = (
                f", past {self.knee_bytes / 2**20:.3g} MiB per sequence and layer "
                f"+{1e12 * self.s_knee_per_byte:.3g} ps/byte per doubling"
            )
        return (
            f"{self.backend}/{self.dtype} ({where}): t0 {1e6 * self.t0_s:.3g} µs/layer, t_seq "
            f"{1e6 * self.t_seq_s:.3g} µs/seq/layer, bw_eff {self.bw_eff / 1e9:.3g} GB/s{knee}; fit error "
            f"{100 * self.rms_rel_error:.1f}% rms over {self.points} points ({self.span:.0f}× span)"
        )


def _past_knee(seq_bytes: float, knee: float) -> float:
    """``log2(seq_bytes / knee)`` beyond the knee, 0 before it."""
    return math.log2(seq_bytes / knee) if seq_bytes > knee else 0.0


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (exact for a few unknowns: every active set)."""
    best, best_res = np.zeros(a.shape[1]), float(np.sum(y**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(a.shape[1])
            full[list(cols)] = coef
            res = float(np.sum((a @ full - y) ** 2))
            if res < best_res:
                best, best_res = full, res
    return best


def fit_points(points: list[CalibrationPoint], *, geometry: str | None = None) -> Fit:
    """Fit :data:`MODEL` to ``points`` (one backend and dtype) by non-negative relative least squares.

    Raises :class:`CalibrationError` with fewer than :data:`MIN_POINTS` points or a span in batch ×
    context under :data:`MIN_SPAN` × (the terms would not be identifiable).
    """
    if not points:
        raise CalibrationError("no points to fit")
    names = {(p.backend, p.dtype) for p in points}
    if len(names) != 1:
        raise CalibrationError(f"one fit is for one backend and dtype; got {sorted(names)}")
    span = max(p.tokens for p in points) / min(p.tokens for p in points)
    if len(points) < MIN_POINTS or span < MIN_SPAN:
        raise CalibrationError(
            f"{len(points)} points spanning {span:.1f}× in batch × context: a fit needs ≥ {MIN_POINTS} "
            f"points spanning ≥ {MIN_SPAN:g}×"
        )
    t = np.array([p.step_s for p in points])
    coef, rel = _fit_knee(points, t, 0.0)
    knee = 0.0
    sizes = sorted({p.kv_bytes / (p.layers * p.batch) for p in points})
    if len(points) >= KNEE_MIN_POINTS:
        best = float(np.sqrt(np.mean(rel**2))) / KNEE_GAIN
        for lo, hi in itertools.pairwise(sizes[:-1]):  # two sizes or more beyond every knee tried
            at = math.sqrt(lo * hi)
            c, r = _fit_knee(points, t, at)
            rms = float(np.sqrt(np.mean(r**2)))
            if c[3] > 0 and rms < best:
                best, coef, rel, knee = rms, c, r, at
    backend, dtype = next(iter(names))
    return Fit(
        backend=backend,
        dtype=dtype,
        geometry=geometry,
        t0_s=float(coef[0]),
        t_seq_s=float(coef[1]),
        s_per_byte=float(coef[2]),
        points=len(points),
        span=float(span),
        rms_rel_error=float(np.sqrt(np.mean(rel**2))),
        max_rel_error=float(np.max(np.abs(rel))),
        s_knee_per_byte=float(coef[3]) if knee else 0.0,
        knee_bytes=knee,
    )


def _fit_knee(points: list[CalibrationPoint], t: np.ndarray, knee: float) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients (t0, t_seq, s, s_knee) with the knee at ``knee`` bytes (0: none), relative errors."""
    rows = []
    for p in points:
        past = _past_knee(p.kv_bytes / (p.layers * p.batch), knee) if knee else 0.0
        rows.append([p.layers, p.layers * p.batch, p.kv_bytes, p.kv_bytes * past])
    a = np.array(rows, dtype=float)
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)  # condition the columns, weight rows by 1 / t
    coef = nonnegative_lstsq(a / scale / t[:, None], np.ones_like(t)) / scale
    return coef, (a @ coef) / t - 1


# --------------------------------------------------------------------------------------------------
# the file
# --------------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """A device's calibration: the device's measured roofline figures, the fits, the points behind them.

    File schema (YAML, ``format: 1``): ``device`` (``name``, ``hardware_id``, ``fingerprint``,
    ``bandwidth`` bytes/s, ``memory_bytes``, ``flops`` by dtype), ``model`` (the formula), ``fits``
    (fields of :class:`Fit`), ``points`` (fields of :class:`CalibrationPoint`), ``skipped`` (groups
    that could not be fitted, with why), ``written_at``, ``command``.
    """

    device: dict[str, Any]
    fits: list[Fit]
    points: list[CalibrationPoint]
    skipped: list[str] = field(default_factory=list)
    written_at: str = ""
    command: str = ""
    path: Path | None = None

    @classmethod
    def fit(
        cls, points: Iterable[CalibrationPoint], *, device: Mapping[str, Any], command: str = ""
    ) -> Calibration:
        """Fit every (backend, dtype) over all its points, and every (backend, dtype, geometry) alone."""
        pts = list(points)
        fits: list[Fit] = []
        skipped: list[str] = []
        groups: dict[tuple[str, str], list[CalibrationPoint]] = {}
        for p in pts:
            groups.setdefault((p.backend, p.dtype), []).append(p)
        for (backend, dtype), group in sorted(groups.items()):
            geometries = sorted({p.geometry for p in group})
            subsets: list[tuple[str | None, list[CalibrationPoint]]] = [(None, group)]
            if len(geometries) > 1:
                subsets += [(g, [p for p in group if p.geometry == g]) for g in geometries]
            elif geometries:
                subsets = [(geometries[0], group)]
            for geometry, sel in subsets:
                try:
                    fits.append(fit_points(sel, geometry=geometry))
                except CalibrationError as err:
                    skipped.append(f"{backend}/{dtype} ({geometry or 'all geometries'}): {err}")
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return cls(dict(device), fits, pts, skipped, written_at=now, command=command)

    def lookup(self, backend: str, dtype: str, geometry: str) -> Fit | None:
        """The geometry's own fit, else the fit over all geometries of ``backend`` and ``dtype``."""
        mine = [f for f in self.fits if f.backend == backend and f.dtype == dtype]
        return next((f for f in mine if f.geometry == geometry), None) or next(
            (f for f in mine if f.geometry is None), None
        )

    def predict(
        self,
        backend: Backend,
        workload: Workload,
        *,
        layers: int | None = None,
        kv_bytes: float | None = None,
    ) -> tuple[float, Fit] | None:
        """Calibrated step time of ``backend`` on ``workload`` (``layers`` of it) and the fit used.

        ``kv_bytes`` defaults to the backend's own bytes per token × the tokens the step attends to.
        """

        fit = self.lookup(backend.name, workload.dtype_name, geometry_key(backend, workload))
        if fit is None:
            return None
        layers = layers or workload.shape.num_layers
        if kv_bytes is None:
            per_token = backend_kv_bytes_per_token(backend, workload) / workload.shape.num_layers * layers
            kv_bytes = kv_bytes_per_step(per_token, tokens=workload.total_tokens + workload.batch)
        return fit.predict_s(batch=workload.batch, kv_bytes=kv_bytes, layers=layers), fit

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kind": "attnbench calibration",
            "model": MODEL,
            "device": json.loads(json.dumps(self.device, default=str)),  # plain types for YAML
            "written_at": self.written_at,
            "command": self.command,
            "fits": [asdict(f) for f in self.fits],
            "skipped": list(self.skipped),
            "points": [asdict(p) for p in self.points],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "# attnbench calibration: written by `attnbench calibrate`; regenerate it, do not edit.\n"
        text += yaml.safe_dump(self.as_dict(), sort_keys=False, allow_unicode=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            tmp.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp.name, 0o666 & ~umask)  # as an ordinary file would be: follow the umask
        os.replace(tmp.name, path)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read and check a calibration file; :class:`CalibrationError` names what is wrong."""
        path = Path(path)
        if not path.exists():
            raise CalibrationError(
                f"calibration file {path} not found (write one with `attnbench calibrate`)"
            )
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise CalibrationError(f"calibration file {path.name} is not valid YAML ({err})") from None
        if not isinstance(data, dict) or data.get("kind") != "attnbench calibration":
            raise CalibrationError(f"{path.name} is not an attnbench calibration file (kind missing)")
        if data.get("format") != FORMAT:
            raise CalibrationError(f"{path.name}: format {data.get('format')!r}; accepted: {FORMAT}")
        device = data.get("device")
        if not isinstance(device, dict):
            raise CalibrationError(f"{path.name}: field 'device' must be a mapping")
        for key in ("bandwidth", "memory_bytes", "flops"):
            if key not in device:
                raise CalibrationError(f"{path.name}: field 'device.{key}' is missing")
        try:
            fits = [Fit(**f) for f in data.get("fits") or []]
            points = [CalibrationPoint(**p) for p in data.get("points") or []]
        except TypeError as err:
            want = ", ".join(x.name for x in fields(Fit))
            raise CalibrationError(
                f"{path.name}: a fit or point has wrong fields ({err}); fit fields: {want}"
            ) from None
        return cls(
            device, fits, points, list(data.get("skipped") or []), str(data.get("written_at", "")),
            str(data.get("command", "")), path,
        )  # fmt: skip


def calibration_path(results_dir: str | Path, fingerprint: Mapping[str, Any]) -> Path:
    """``<results_dir>/calibration-<kind>-<name>-<hardware id>.yaml``, beside the tuned table."""

    tuned = table_path(Path(results_dir), fingerprint)
    return tuned.with_name(tuned.name.replace("tuning-", "calibration-", 1))


def find_calibration(
    fingerprint: Mapping[str, Any], *, results_dir: str | Path | None = None
) -> Calibration | None:
    """This device's calibration file in ``results_dir`` (default: the tuned tables'), if written."""

    path = calibration_path(results_dir or results_location().path, fingerprint)
    return Calibration.load(path) if path.exists() else None


def device_entry(profile: Any, *, flops: Mapping[str, float], memory_bytes: float) -> dict[str, Any]:
    """The ``device`` section of a calibration file from a device profile."""

    return {
        "name": profile.name,
        "hardware_id": hardware_id(profile.fingerprint),
        "fingerprint": dict(profile.fingerprint),
        "bandwidth": float(profile.bandwidth),
        "bandwidth_measured_at": profile.measured_at,
        "memory_bytes": float(memory_bytes),
        "flops": {k: float(v) for k, v in flops.items()},
    }


# --------------------------------------------------------------------------------------------------
# points from what tune and bench already measured
# --------------------------------------------------------------------------------------------------
def _point(
    registry: Registry, *, backend: str, model: str, dtype: str, batch: int, context: int,
    kv_bytes: float, step_s: float, layers: int | None, source: str,
) -> CalibrationPoint | None:  # fmt: skip

    if backend not in registry or not step_s or not kv_bytes:
        return None
    b = registry.get(backend)
    workload = Workload.uniform(model, batch=batch, context=context, dtype=dtype)
    if layers is None:  # the tuned table records bytes and time, not layers: recover them from the bytes
        per_layer = backend_kv_bytes_per_token(b, workload) / workload.shape.num_layers
        layers = max(1, round(kv_bytes / (per_layer * batch * (context + 1))))
    return CalibrationPoint(
        backend=backend, dtype=dtype, geometry=geometry_key(b, workload), batch=batch, context=context,
        layers=int(layers), kv_bytes=float(kv_bytes), step_s=float(step_s), source=source,
    )  # fmt: skip


def points_from_table(path: str | Path, registry: Registry) -> list[CalibrationPoint]:
    """Every measured candidate of a tuned table (step time and GB/s give the bytes read)."""

    data = yaml.safe_load(Path(path).read_text()) or {}
    out = []
    for row, entry in validate_entries(data.get("entries") or {}).items():
        at = entry.measured_at
        for c in entry.candidates:
            if c.step_ms is None or c.gbps is None:
                continue
            step_s = c.step_ms / 1e3
            p = _point(
                registry, backend=c.backend, model=entry.model, dtype=entry.dtype,
                batch=int(at.get("batch", entry.batch_bucket)), context=int(at.get("context", entry.context_bucket)),
                kv_bytes=c.gbps * 1e9 * step_s, step_s=step_s, layers=None, source=f"tune:{row}",
            )  # fmt: skip
            if p is not None:
                out.append(p)
    return out


def points_from_bench(path: str | Path, registry: Registry) -> list[CalibrationPoint]:
    """Every timed row of a ``bench --save`` JSON (or a validation JSON with the same row fields)."""
    data = json.loads(Path(path).read_text())
    out = []
    for r in data.get("results") or data.get("rows") or []:
        step = (r.get("step") or {}).get("median_s") if isinstance(r.get("step"), dict) else None
        step = step or r.get("measured_s")
        if not step or r.get("status") not in ("timed", "measured"):
            continue
        model = r.get("model") or str(r.get("workload", "")).split(" ")[0]
        p = _point(
            registry, backend=r["backend"], model=model, dtype=r["dtype"], batch=int(r["batch"]),
            context=int(r["context"]), kv_bytes=r.get("kv_bytes") or r.get("kv_bytes_loop"), step_s=step,
            layers=r.get("num_layers") or r.get("layers"), source=f"bench:{Path(path).name}",
        )  # fmt: skip
        if p is not None:
            out.append(p)
    return out
