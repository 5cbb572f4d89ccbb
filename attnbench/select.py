"""``attnbench.select()``: the backend and config to use for a workload on this device.

From what ``attnbench tune`` measured on this device, found in the one results location
(:mod:`attnbench.locations`): the dispatch map of the model and dtype, interpolated between its grid
points, else the nearest tuned entry of the results table. Outside the tuned region the device's
calibrated step-time models choose when ``attnbench calibrate`` wrote them
(:mod:`attnbench.calibrated`), else a roofline heuristic (:mod:`attnbench.select_heuristic`). A
candidate that failed the correctness gate is never chosen, and a table tuned on another device is
refused::

    >>> choice = attnbench.select(model="llama-3.1-8b", batch=8, context="8k", dtype="bf16")
    >>> choice.backend, choice.config, choice.source
    ('flash', {'num_splits': 0}, 'tuned')
    >>> backend = choice.build()
    >>> print(choice.explain())

Serving code may call it per batch: a :class:`Selector` keeps everything it learnt in memory, so after
the first call in a process it reads no file, rebuilds no registry and allocates no cache. It only
``os.stat``-s the device's table and dispatch map (every call by default, ``recheck_s`` spaces the
checks out) and reads them again when ``tune`` rewrote them. :func:`select` uses a default selector,
whose caches are keyed by everything that decides an answer (the files' identity and modification
time, the results location, the registry, the device and its thread count), so nothing has to be reset
between uses; :meth:`Selector.clear` forgets everything at once.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
import weakref
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from attnbench.backend import Resolution
from attnbench.calibrated import calibrated_choice
from attnbench.calibration import Calibration, CalibrationError, calibration_path, geometry_key
from attnbench.choice import Choice, Rejected
from attnbench.device import fingerprint, fingerprint_id, load_profile, resolve_device
from attnbench.locations import RESULTS_ENV, check_table_file, readable_results
from attnbench.probe import ask
from attnbench.registry import Registry, load_registry
from attnbench.select_heuristic import HeuristicRanking, rank, runnable_reason
from attnbench.select_tuned import TunedIndex, entry_choice
from attnbench.shapes import ModelShape, load_shape, parse_dtype
from attnbench.tuning.dispatch import dispatch_path, load_maps, map_key
from attnbench.tuning.space import code_hash
from attnbench.tuning.table import DeviceMismatchError, ResultsTable, TableError, hardware_id, table_path
from attnbench.workload import Workload, bucket, parse_tokens

__all__ = ["Choice", "Rejected", "Selector", "default_selector", "select"]

_PLUGIN_ENV = ("ATTNBENCH_PLUGINS", "ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD")
_Signature = tuple[int, int, int] | None  # (inode, size, mtime ns) of a file, None when missing
#: Workload is a plain frozen dataclass of these fields (its checks rerun only when this changes)
_FIELDS = ["shape", "context_lens", "dtype", "device"]
_PLAIN_WORKLOAD = [f.name for f in fields(Workload)] == _FIELDS and "__slots__" not in vars(Workload)


def _signature(path: Path, *, was: _Signature = None) -> _Signature:
    if was is None and not os.access(path, os.F_OK):  # still missing: no exception raised per call
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class _Files:
    """One device's tuned files in one results folder, as last read."""

    signature: tuple[_Signature, _Signature]
    checked_at: float
    index: TunedIndex
    notes: list[str]
    templates: dict  # cached per-entry choices (invalidated with the files)


class Selector:
    """:func:`select` with memory: the registry, model shapes, device fingerprints, the tables and
    dispatch maps, the calibration, and each backend's :class:`~attnbench.backend.Resolution` per
    batch and context bucket are computed once and reused.

    Args:
        registry: the backends to choose from (default: the full registry, built on first use and
            again only when ``ATTNBENCH_PLUGINS`` / ``ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD`` change).
        recheck_s: how often to ``os.stat`` the table and dispatch map for a rewrite (default 0:
            every call, about a microsecond each on a local disk).

    Thread-safe in the sense that matters for serving: concurrent calls may both fill a cache
    entry, never see a half-built one.
    """

    def __init__(self, *, registry: Registry | None = None, recheck_s: float = 0.0) -> None:
        self._registry = registry
        self.recheck_s = recheck_s
        self.clear()

    def clear(self) -> None:
        """Forget everything learnt (the next call reads and asks again)."""
        self._default_registry: tuple[tuple[str | None, ...], Registry] | None = None
        self._shapes: dict[object, tuple[ModelShape, str]] = {}
        self._devices: dict[tuple[str, int], tuple[dict, str, str]] = {}
        self._kinds: dict[tuple, tuple[torch.dtype, str, str]] = {}  # (dtype, device) as given → accepted
        self._paths: dict[tuple, Any] = {}  # results location → files; folder → calibration file
        self._files: dict[Path, _Files] = {}
        self._calibrations: dict[Path, tuple[_Signature, Calibration | None, str]] = {}
        self._resolved: dict[tuple, list[tuple[str, Resolution, dict, str]]] = {}
        self._heuristic: dict[tuple, HeuristicRanking | LookupError] = {}
        self._bandwidth: dict[str, float] = {}
        self._engine: dict[tuple, str | None] = {}
        self._warned: set[str] = set()
        self._registries: dict[int, tuple[weakref.ref[Registry], int]] = {}
        self._serial = itertools.count()

    def _reg_key(self, reg: Registry) -> int:
        """A number for ``reg`` that no later registry reuses (an ``id`` may be, once it is freed)."""
        hit = self._registries.get(id(reg))
        if hit is None or hit[0]() is not reg:
            hit = self._registries[id(reg)] = (weakref.ref(reg), next(self._serial))
        return hit[1]

    # -- what is asked ---------------------------------------------------------------------------
    def select(
        self,
        workload: Workload | None = None,
        *,
        model: str | ModelShape | None = None,
        batch: int | None = None,
        context: int | str | None = None,
        dtype: str | torch.dtype = "bf16",
        device: str = "auto",
        results_dir: str | Path | None = None,
        table: str | Path | None = None,
        registry: Registry | None = None,
        bandwidth: float | None = None,
        allow_lossy: bool = False,
    ) -> Choice:
        """The backend and config to use for ``workload`` (or ``model`` + ``batch`` + ``context`` + ``dtype``).

        Args:
            device: ``"auto"`` (CUDA when available, else CPU; the default), ``"cuda"`` or ``"cpu"``.
            results_dir: where the tuned tables live (default: ``$ATTNBENCH_RESULTS_DIR``, else the
                per-user ``$XDG_DATA_HOME/attnbench``, see :mod:`attnbench.locations`); a folder given
                here that does not exist raises :class:`~attnbench.locations.ResultsLocationError`.
            table: a specific table file instead (it must exist; refused with
                :class:`~attnbench.tuning.DeviceMismatchError` when tuned on another device).
            registry: the backends to choose from (default: the full registry).
            bandwidth: bytes/s for the heuristic's roofline (default: the device profile's, measured once).
            allow_lossy: a lossy KV cache (``Backend.lossy``, e.g. fp8 K/V) may be chosen — from the table
                when it was measured fastest, never by the heuristic; the choice then says it is lossy.

        Answers from memory after the first call (see :class:`Selector`).
        """
        reg = registry if registry is not None else self._registry_now()
        workload, shape_hash, dname, b, c = self._workload(workload, model, batch, context, dtype, device)
        fp, fp_id, hw = self._device(workload.device)
        table_file, map_file, folder, explicit = self._locate(results_dir, table, fp, hw)
        files = self._load(table_file, map_file, fp, hw, folder=folder, explicit=explicit)
        index = files.index
        mkey = map_key(workload.shape.name, shape_hash, dname)
        failed_gate = index.gate_failures.get(dname, {})
        regkey = self._reg_key(reg)
        resolved, by_name, rkey = self._resolutions(reg, regkey, workload, shape_hash, (bucket(b), bucket(c)))

        def why_not(backend: str, lossy: str) -> str:
            res = by_name.get(backend)
            if res is None:
                return f"not registered now (registered: {', '.join(reg.names())})"
            why = runnable_reason(res) or failed_gate.get(backend, "")
            if not why and lossy and not allow_lossy:
                why = f"lossy ({lossy}): chosen only with allow_lossy=True (--allow-lossy)"
            return why

        choice = None
        dispatch = index.maps.get(mkey)
        if dispatch is not None:
            key = ("map", mkey, allow_lossy, rkey)
            hit = files.templates.get(key)
            if hit is None:
                refused = {label: why_not(c.backend, c.lossy) for label, c in dispatch.candidates.items()}
                hit = files.templates[key] = (refused, index.refusals(dispatch, refused))
            name = index.table.path.name if index.table is not None else map_file.name
            choice = index.from_map(
                dispatch, workload, b, c, refused=hit[0], rejected=hit[1], source_name=name
            )
            if choice is not None:  # the gate's numbers live in the table entry of the bucket
                gkey = ("gate", choice.lookup.label, rkey)  # type: ignore[union-attr]
                if gkey not in files.templates:
                    files.templates[gkey] = index.gate_of(workload, shape_hash, choice.backend, choice.config)
                choice.gate = files.templates[gkey]
        if choice is None:
            choice = self._from_entry(files, reg, rkey, workload, mkey, b, c, why_not, allow_lossy, by_name)
        note = ""
        # the measured map wins inside the tuned region; beyond it, the calibrated model
        if index.outside(mkey, b, c):
            calibration, note = self._calibration(folder, fp, hw)
            if calibration is not None:
                calibrated = calibrated_choice(
                    workload,
                    resolved,
                    calibration=calibration,
                    failed_gate=failed_gate,
                    why_outside=index.beyond_at(mkey, workload.shape.name, dname, b, c),
                    skip=[] if allow_lossy else [n for n, r in by_name.items() if r.lossy],
                )
                choice = calibrated or choice
        if choice is None:
            choice = self._heuristic_choice(rkey, workload, resolved, failed_gate, fp_id, bandwidth)
        if note:
            choice.warnings.insert(0, note)
        if files.notes:
            choice.warnings = files.notes + choice.warnings
        choice.registry = reg
        choice.engine_setting = self._engine_setting(reg, regkey, choice)
        for w in choice.warnings:
            if w not in self._warned:  # said once per selector, not once per batch
                self._warned.add(w)
                warnings.warn(w, stacklevel=3)
        return choice

    # -- the workload and the device -------------------------------------------------------------
    def _workload(
        self,
        workload: Workload | None,
        model: str | ModelShape | None,
        batch: int | None,
        context: int | str | None,
        dtype: str | torch.dtype,
        device: str,
    ) -> tuple[Workload, str, str, int, int]:
        """The workload, its shape hash, its dtype's name, its batch and its (longest) context."""
        if workload is not None:
            shape, shape_hash = self._shape(workload.shape)
            return workload, shape_hash, workload.dtype_name, workload.batch, workload.context
        if model is None or batch is None or context is None:
            missing = [n for n, v in (("model", model), ("batch", batch), ("context", context)) if v is None]
            raise ValueError(
                f"select: give a workload, or model, batch and context (missing: {', '.join(missing)})"
            )
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"workload: field 'batch' = {batch!r} must be an integer > 0")
        ctx = context if type(context) is int and context > 0 else parse_tokens(context)
        shape, shape_hash = self._shape(model)
        kind = self._kinds.get((dtype, device)) if isinstance(dtype, (str, torch.dtype)) else None
        if kind is None:  # the first time: Workload validates the dtype and the device
            dev = resolve_device(device) if device == "auto" else device
            first = Workload(shape, (ctx,) * batch, parse_dtype(dtype), dev)
            self._kinds[(dtype, device)] = (first.dtype, first.device, first.dtype_name)
            return first, shape_hash, first.dtype_name, batch, ctx
        # later: dtype and device accepted before, lengths one int > 0: Workload's checks cannot fail
        dt, dev, dname = kind
        if not _PLAIN_WORKLOAD:  # Workload grew a field: build it the ordinary way
            return Workload(shape, (ctx,) * batch, dt, dev), shape_hash, dname, batch, ctx
        made = object.__new__(Workload)  # a frozen dataclass without slots: its fields live in __dict__
        made.__dict__.update(shape=shape, context_lens=(ctx,) * batch, dtype=dt, device=dev)
        return made, shape_hash, dname, batch, ctx

    def _shape(self, model: str | ModelShape) -> tuple[ModelShape, str]:
        key: object = id(model) if isinstance(model, ModelShape) else model
        if isinstance(model, str) and (os.sep in model or model.endswith((".json", ".yaml", ".yml"))):
            key = (model, _signature(Path(model)))  # a shape file: read again when it changes
        hit = self._shapes.get(key)
        if hit is None or (isinstance(model, ModelShape) and hit[0] is not model):
            shape = model if isinstance(model, ModelShape) else load_shape(model)
            if len(self._shapes) > 256:
                self._shapes.clear()
            hit = self._shapes[key] = (shape, shape.fingerprint())
        return hit

    def _device(self, device: str) -> tuple[dict, str, str]:
        threads = torch.get_num_threads()  # part of a CPU fingerprint: a new count is another device
        hit = self._devices.get((device, threads))
        if hit is None:
            fp = fingerprint(device)
            hit = self._devices[(device, threads)] = (fp, fingerprint_id(fp), hardware_id(fp))
        return hit

    def _registry_now(self) -> Registry:
        if self._registry is not None:
            return self._registry
        env = tuple(os.environ.get(k) for k in _PLUGIN_ENV)
        if self._default_registry is None or self._default_registry[0] != env:
            self._default_registry = (env, load_registry())
        return self._default_registry[1]

    # -- the files -------------------------------------------------------------------------------
    def _locate(
        self, results_dir: str | Path | None, table: str | Path | None, fp: dict, hw: str
    ) -> tuple[Path, Path, Path, bool]:
        where: tuple = (results_dir, table)
        if results_dir is None and table is None:  # the location the environment gives
            env, xdg = os.environ.get(RESULTS_ENV), None
            if not env:
                xdg = os.environ.get("XDG_DATA_HOME") or ("~", os.environ.get("HOME"))
            where = (env, xdg)
        key = (where, hw)
        hit = self._paths.get(key)
        if hit is None:
            if table is not None:
                path = check_table_file(table)
                folder = Path(results_dir) if results_dir is not None else path.parent
            else:
                location = readable_results(results_dir)
                folder, path = location.path, table_path(location.path, fp)
            hit = self._paths[key] = (path, dispatch_path(path), folder, table is not None)
        return hit

    def _load(
        self, table_file: Path, map_file: Path, fp: dict, hw: str, *, folder: Path, explicit: bool
    ) -> _Files:
        files = self._files.get(table_file)
        now = time.monotonic() if self.recheck_s else 0.0
        if files is not None and self.recheck_s and now - files.checked_at < self.recheck_s:
            return files
        was = files.signature if files else (None, None)  # files seen before are stat-ed directly
        signature = (_signature(table_file, was=was[0]), _signature(map_file, was=was[1]))
        if files is not None and files.signature == signature:
            files.checked_at = now
            return files
        if explicit and signature[0] is None:
            check_table_file(table_file)  # removed since: one clear line
        notes: list[str] = []
        try:
            loaded: ResultsTable | None = ResultsTable.load(table_file, fingerprint=fp)
        except DeviceMismatchError:
            raise  # another device's table: refused, never used
        except TableError as err:
            if explicit:
                raise
            notes.append(f"{err}; ignoring it (re-run `attnbench tune` to rewrite it)")
            loaded = None
        try:
            maps = load_maps(map_file, hardware_id=hw)
        except ValueError as err:
            if "another device" in str(err):
                raise DeviceMismatchError(f"{err}; refusing another device's map") from None
            notes.append(f"{err}; ignoring it (re-run `attnbench tune` to rewrite it)")
            maps = {}
        files = _Files(signature, now, TunedIndex.build(loaded, maps), notes, {})
        self._files[table_file] = files
        return files

    def _calibration(self, folder: Path, fp: dict, hw: str) -> tuple[Calibration | None, str]:
        path = self._paths.get((folder, hw))  # type: ignore[assignment]
        if path is None:
            path = self._paths[(folder, hw)] = calibration_path(folder, fp)  # type: ignore[assignment]
        hit = self._calibrations.get(path)
        sig = _signature(path, was=hit[0] if hit else None)
        if hit is None or hit[0] != sig:
            cal, note = None, ""
            if sig is not None:
                try:
                    cal = Calibration.load(path)
                except CalibrationError as err:
                    note = f"{err}; ignoring it (re-run `attnbench calibrate`)"
            hit = self._calibrations[path] = (sig, cal, note)
        return hit[1], hit[2]

    # -- what the backends say -------------------------------------------------------------------
    def _resolutions(
        self, reg: Registry, regkey: int, workload: Workload, shape_hash: str, buckets: tuple[int, int]
    ) -> tuple[list[tuple[str, Resolution, dict, str]], dict[str, Resolution], tuple]:
        """``(name, resolution, default config, geometry key)`` per backend, asked once per bucket
        (as the plugin probes are cached: a backend's answer is taken as the bucket's), the
        resolutions by name, and the key they are cached under."""
        key = (regkey, shape_hash, workload.shape.name, workload.dtype, workload.device, *buckets)
        hit = self._resolved.get(key)
        if hit is None:
            listed = []
            for e in reg:
                res = ask(e.cls, workload)
                geometry = geometry_key(e.cls, workload) if res.runnable else ""  # type: ignore[arg-type]
                listed.append((e.name, res, e.cls.default_config(), geometry))
            if len(self._resolved) > 4096:
                self._resolved.clear()
            hit = self._resolved[key] = (listed, {n: r for n, r, _, _ in listed}, key)
        return hit

    def _from_entry(
        self, files, reg, rkey, workload, mkey, batch, context, why_not, allow_lossy, by_name
    ) -> Choice | None:
        near = files.index.nearest_at(mkey, batch, context)
        if near is None:
            return None
        row, distance = near
        key = ("entry", row.row, allow_lossy, rkey)
        template = files.templates.get(key)
        if template is None:
            table = files.index.table
            assert table is not None
            template = entry_choice(
                row,
                workload,
                why_not=why_not,
                lossy_of=lambda b: by_name[b].lossy if b in by_name else "",
                table_warnings=table.warnings,
                table_name=table.path.name,
            )
            if template is not None:
                classes = [reg.entry(c.backend).cls for c in row.entry.candidates if c.backend in reg]
                now = code_hash(classes) if classes else ""
                if classes and row.entry.code_hash and now != row.entry.code_hash:
                    template.warnings.append(
                        f"{row.row}: backend code changed since tuning (code hash {row.entry.code_hash} "
                        f"→ {now}); consider re-tuning"
                    )
            files.templates[key] = template
        if template is None:
            return None
        return replace(
            template,
            workload=workload,
            distance_octaves=distance,
            rejected=list(template.rejected),
            measured=list(template.measured),
            warnings=list(template.warnings),
        )

    def _heuristic_choice(self, rkey, workload, resolved, failed_gate, fp_id, bandwidth) -> Choice:
        key = (rkey, tuple(sorted(failed_gate.items())))
        ranking = self._heuristic.get(key)
        if ranking is None:
            try:
                ranking = rank(
                    ((n, r, c) for n, r, c, _ in resolved),
                    failed_gate=failed_gate,
                    describe=workload.describe(),
                )
            except LookupError as err:
                ranking = err
            self._heuristic[key] = ranking
        if isinstance(ranking, LookupError):
            raise LookupError(str(ranking))
        if bandwidth is None:
            bandwidth = self._bandwidth.get(fp_id)
            if bandwidth is None:
                bandwidth = self._bandwidth[fp_id] = load_profile(workload.device).bandwidth
        return ranking.choice(workload, bandwidth=bandwidth)

    def _engine_setting(self, reg: Registry, regkey: int, choice: Choice) -> str | None:
        """The engine settings that run the chosen kernel in its engine (``None``: not an engine's
        kernel). A backend that wraps an engine's kernel declares ``engine_setting(config) -> str``
        (the plugin checks the names against the installed engine); see docs/engines.md."""
        key = (regkey, choice.backend, repr(choice.config) if choice.config else "")
        if key in self._engine:
            return self._engine[key]
        setting = None
        if choice.backend in reg:
            method = getattr(reg.entry(choice.backend).cls, "engine_setting", None)
            if callable(method):
                try:
                    setting = str(reg.get(choice.backend).engine_setting(choice.config))  # type: ignore[attr-defined]
                except Exception as err:  # e.g. the installed engine lacks the name: say so, keep the choice
                    choice.warnings.append(
                        f"{choice.backend}: cannot name its engine setting ({type(err).__name__}: {err})"
                    )
                    return None
        self._engine[key] = setting
        return setting


#: The selector :func:`select` uses (``default_selector.clear()`` forgets what it learnt).
default_selector = Selector()


#: The backend and config to use for a workload: :meth:`Selector.select` of :data:`default_selector`.
select = default_selector.select
