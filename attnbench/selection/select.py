"""``attnbench.select()``: the backend and config to use for a workload on this device.

From what ``attnbench tune`` measured on this device, found in the one results location
(:mod:`attnbench.core.locations`): the dispatch map of the model and dtype, interpolated between its grid
points, else the nearest tuned entry of the results table. Outside the tuned region the device's
calibrated step-time models choose when ``attnbench calibrate`` wrote them
(:mod:`attnbench.selection.fitted`), else a roofline heuristic (:mod:`attnbench.selection.heuristic`). A
candidate that failed the correctness gate is never chosen, and a table tuned on another device is
refused::

    >>> choice = attnbench.select(model="llama-3.1-8b", batch=8, context="8k", dtype="bf16")
    >>> choice.backend, choice.config, choice.source
    ('flash', {'num_splits': 0}, 'tuned')
    >>> backend = choice.build()
    >>> print(choice.explain())

Serving code may call it per batch: a :class:`Selector` keeps everything it learnt in memory, so after
the first call in a process it reads no file, rebuilds no registry and allocates no cache; the
explanation (:meth:`Choice.explain`, :attr:`Choice.rejected`) is written only when read. Whether
``tune`` (or ``calibrate``) rewrote the device's files costs one ``os.stat`` of their folder per call
(see :class:`Selector`; ``recheck_s`` spaces the checks out); a rewritten file is read again.
:func:`select` uses a default selector,
whose caches are keyed by everything that decides an answer (the files' identity and modification
time, the results location, the registry, the device and its thread count), so nothing has to be reset
between uses; :meth:`Selector.clear` forgets everything at once.
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from dataclasses import fields
from pathlib import Path

import torch

from attnbench.core.backend import Resolution
from attnbench.core.device import fingerprint, fingerprint_id, load_profile, resolve_device
from attnbench.core.locations import RESULTS_ENV, check_table_file, readable_results
from attnbench.core.plugin_call import ask
from attnbench.core.registry import Registry, code_hash, load_registry
from attnbench.core.shapes import ModelShape, load_shape, parse_dtype
from attnbench.core.workload import Workload, bucket, parse_tokens
from attnbench.cost.fit import calibration_path, geometry_key
from attnbench.selection.choice import Choice, Rejected
from attnbench.selection.fitted import calibrated_ranking
from attnbench.selection.heuristic import HeuristicRanking, rank, runnable_reason
from attnbench.selection.tuned import Location, entry_choice, file_signature
from attnbench.tables.corpus import CORPUS_ENV, corpus_enabled, corpus_entry
from attnbench.tables.dispatch import dispatch_path, map_key
from attnbench.tables.table import hardware_id, table_path

__all__ = ["Choice", "Rejected", "Selector", "backend_for", "default_selector", "select"]

_PLUGIN_ENV = ("ATTNBENCH_PLUGINS", "ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD")
_LOCATION_ENV = (RESULTS_ENV, "XDG_DATA_HOME", "HOME")  # what decides the default results location
_CORPUS_ENV = (CORPUS_ENV,)  # whether the shipped corpus may stand in for this device's table
#: Workload is a plain frozen dataclass of these fields (its checks rerun only when this changes)
_FIELDS = ["shape", "context_lens", "dtype", "device"]
_PLAIN_WORKLOAD = [f.name for f in fields(Workload)] == _FIELDS and "__slots__" not in vars(Workload)


class Selector:
    """:func:`select` with memory: the registry, model shapes, device fingerprints, the tables and
    dispatch maps, the calibration, and each backend's :class:`~attnbench.core.backend.Resolution` per
    batch and context bucket are computed once and reused.

    A rewrite of the device's table, dispatch map or calibration is noticed by one ``os.stat`` of the
    folder that holds them per call (about a microsecond on a local disk): ``tune`` and ``calibrate``
    write atomically, a temporary file renamed into the folder, which changes the folder's
    modification time. When the folder changed, or was itself modified less than two seconds before
    the last check (a coarse file-system clock could give a change in the same tick the same time),
    the three files are ``os.stat``-ed and a changed one is read again. So a rewrite is seen by the
    next call, at one system call per call rather than three; a file edited in place without a
    rename is seen when the folder next changes (or after :meth:`clear`).

    Args:
        registry: the backends to choose from (default: the full registry, built on first use and
            again only when ``ATTNBENCH_PLUGINS`` / ``ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD`` change).
        recheck_s: check the folder at most this often, in seconds (default 0: every call); a rewrite
            is then seen up to ``recheck_s`` late.

    Thread-safe in the sense that matters for serving: concurrent calls may both fill a cache
    entry, never see a half-built one.
    """

    def __init__(self, *, registry: Registry | None = None, recheck_s: float = 0.0) -> None:
        self._registry = registry
        self.recheck_s = recheck_s
        self.clear()

    def clear(self) -> None:
        """Forget everything learnt (the next call reads and asks again)."""
        self._default_registry: tuple[tuple[object, ...], Registry] | None = None
        self._shapes: dict[object, tuple[ModelShape, str]] = {}
        self._devices: dict[tuple[str, int], tuple[dict, str, str]] = {}
        self._kinds: dict[tuple, tuple[torch.dtype, str, str]] = {}  # (dtype, device) as given → accepted
        self._paths: dict[tuple, Location] = {}  # results location as given → its files
        self._resolved: dict[
            tuple, tuple[list[tuple[str, Resolution, dict, str]], dict[str, Resolution], int]
        ] = {}
        self._heuristic: dict[tuple, HeuristicRanking | LookupError] = {}
        self._bandwidth: dict[str, float] = {}
        self._engine: dict[tuple, str | None] = {}
        self._engine_kernels: dict[tuple[int, str], bool] = {}
        self._warned: set[str] = set()
        self._env_keys: dict[tuple[str, ...], tuple] = {}
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
                per-user ``$XDG_DATA_HOME/attnbench``, see :mod:`attnbench.core.locations`); a folder given
                here that does not exist raises :class:`~attnbench.core.locations.ResultsLocationError`.
            table: a specific table file instead (it must exist; refused with
                :class:`~attnbench.tables.DeviceMismatchError` when tuned on another device).
            registry: the backends to choose from (default: the full registry).
            bandwidth: bytes/s for the heuristic's roofline (default: the device profile's, measured once).
            allow_lossy: a lossy KV cache (``Backend.lossy``, e.g. fp8 K/V) may be chosen — from the table
                when it was measured fastest, never by the heuristic; the choice then says it is lossy.

        Answers from memory after the first call (see :class:`Selector`).
        """
        reg = registry if registry is not None else self._registry_now()
        workload, shape_hash, dname, b, c = self._workload(workload, model, batch, context, dtype, device)
        fp, fp_id, hw = self._device(workload.device)
        location = self._locate(results_dir, table, fp, hw)
        files = location.load(fingerprint=fp, hardware_id=hw, recheck_s=self.recheck_s)
        index = files.index
        mkey = map_key(workload.shape.name, shape_hash, dname)
        failed_gate = index.gate_failures.get(dname, {})
        regkey = self._reg_key(reg)
        buckets = (bucket(b), bucket(c))
        resolved, by_name, rkey = self._resolutions(reg, regkey, workload, shape_hash, buckets)

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
            plan = files.templates.get(key)
            if plan is None:  # once per bucket: who may be chosen here, and why not the others
                refused = {label: why_not(c.backend, c.lossy) for label, c in dispatch.candidates.items()}
                eligible = frozenset(label for label, why in refused.items() if not why)
                name = index.table.path.name if index.table is not None else location.map.name
                plan = files.templates[key] = (refused, index.refusals(dispatch, refused), eligible, name)
            refused, rejected, eligible, name = plan
            choice = index.from_map(
                dispatch,
                workload,
                b,
                c,
                refused=refused,
                rejected=rejected,
                eligible=eligible,
                source_name=name,
            )
            if choice is not None:  # the gate's numbers live in the table entry of the bucket
                gkey = ("gate", choice.lookup.label, rkey)  # type: ignore[union-attr]  # a map answer has its lookup
                if gkey not in files.templates:
                    files.templates[gkey] = index.gate_of(workload, shape_hash, choice.backend, choice.config)
                choice.gate = files.templates[gkey]
        if choice is None:
            choice = self._from_entry(files, reg, rkey, workload, mkey, b, c, why_not, allow_lossy, by_name)
        if choice is not None and location.corpus is not None:
            choice.corpus = location.corpus.label
        note = ""
        # the measured map wins inside the tuned region; beyond it, the calibrated model
        if index.outside(mkey, b, c, buckets=buckets):
            calibration, note = files.calibration_now()
            if calibration is not None:
                ckey = ("calibrated", allow_lossy, rkey)
                ranking = files.templates.get(ckey)
                if ranking is None:  # once per bucket: each backend's fit; each call predicts its step
                    ranking = files.templates[ckey] = calibrated_ranking(
                        workload,
                        resolved,
                        calibration=calibration,
                        failed_gate=failed_gate,
                        skip=[] if allow_lossy else [n for n, r in by_name.items() if r.lossy],
                    )
                if ranking.fitted:
                    why_outside = index.beyond_at(mkey, workload.shape.name, dname, b, c)
                    choice = ranking.choice(workload, why_outside=why_outside)
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
            if not isinstance(workload, Workload):
                hint = (
                    f" (a model name: select(model={workload!r}, batch=…, context=…))"
                    if isinstance(workload, str)
                    else ""
                )
                raise TypeError(
                    f"select: workload = {workload!r} is a {type(workload).__name__}; accepted: a Workload, "
                    f"or model=, batch= and context= by keyword{hint}"
                )
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
        if type(model) is str:  # a preset seen before (a shape file is never kept under its bare name)
            hit = self._shapes.get(model)
            if hit is not None:
                return hit
        key: object = id(model) if isinstance(model, ModelShape) else model
        if isinstance(model, str) and (os.sep in model or model.endswith((".json", ".yaml", ".yml"))):
            key = (model, file_signature(Path(model)))  # a shape file: read again when it changes
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
        env = self._env(_PLUGIN_ENV)
        if self._default_registry is None or self._default_registry[0] != env:
            self._default_registry = (env, load_registry())
        return self._default_registry[1]

    def _env(self, names: tuple[str, ...]) -> tuple[object, ...]:
        """The values of ``names`` in the environment as a cache key (encoded: bytes on POSIX).

        ``os.environ.get`` of a name that is not set raises and catches a ``KeyError`` inside, which
        costs microseconds per call; CPython's ``os.environ`` keeps its encoded values in a dict
        (``_data``, written by every ``os.environ[...] =``), read here directly; ``os.environ.get``
        where there is none."""
        env = os.environ
        data = getattr(env, "_data", None)
        if type(data) is not dict:
            return tuple([env.get(n) for n in names])
        keys = self._env_keys.get(names)
        if keys is None:
            keys = self._env_keys[names] = tuple(env.encodekey(n) for n in names)
        return tuple([data.get(k) for k in keys])

    # -- the files -------------------------------------------------------------------------------
    def _locate(
        self, results_dir: str | Path | None, table: str | Path | None, fp: dict, hw: str
    ) -> Location:
        """The table, the dispatch map and the calibration file, and whether the table was named."""
        where: tuple = (results_dir, table)
        if results_dir is None and table is None:  # the location the environment gives
            where = self._env(_LOCATION_ENV)
        key = (where, hw, self._env(_CORPUS_ENV))
        hit = self._paths.get(key)
        if hit is not None and hit.local is not None and os.access(hit.local, os.F_OK):  # raises nothing
            hit = None  # this device has tuned since the corpus stood in: its own table now
        if hit is None:
            if table is not None:
                path = check_table_file(table)
                folder = Path(results_dir) if results_dir is not None else path.parent
            else:
                location = readable_results(results_dir)
                folder, path = location.path, table_path(location.path, fp)
            cal = calibration_path(folder, fp)
            entry = None if table is not None or path.exists() or not corpus_enabled() else corpus_entry(hw)
            if entry is not None:  # no table of this device here: the shipped corpus's (tables.corpus)
                hit = Location(entry.table, entry.map, cal, False, corpus=entry, local=path)
            else:
                hit = Location(path, dispatch_path(path), cal, table is not None)
            self._paths[key] = hit
        return hit

    # -- what the backends say -------------------------------------------------------------------
    def _resolutions(
        self, reg: Registry, regkey: int, workload: Workload, shape_hash: str, buckets: tuple[int, int]
    ) -> tuple[list[tuple[str, Resolution, dict, str]], dict[str, Resolution], int]:
        """``(name, resolution, default config, geometry key)`` per backend, asked once per bucket
        (as the plugin probes are cached: a backend's answer is taken as the bucket's), the
        resolutions by name, and a number no other resolutions get (what is learnt per bucket is
        keyed by it: an int hashes faster than the key of the bucket)."""
        key = (regkey, shape_hash, workload.shape.name, workload.dtype, workload.device, *buckets)
        hit = self._resolved.get(key)
        if hit is None:
            listed = []
            for e in reg:
                res = ask(e.cls, workload)
                geometry = geometry_key(e.cls, workload) if res.runnable else ""  # type: ignore[arg-type]  # reads class attributes only
                listed.append((e.name, res, e.cls.default_config(), geometry))
            if len(self._resolved) > 4096:  # and what was learnt from them
                self._resolved.clear()
                self._heuristic.clear()
                for location in self._paths.values():
                    if location.files is not None:
                        location.files.templates.clear()
            hit = self._resolved[key] = (listed, {n: r for n, r, _, _ in listed}, next(self._serial))
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
        return template.copy_for(workload, distance_octaves=distance)

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
        kind = (regkey, choice.backend)
        engine = self._engine_kernels.get(kind)
        if engine is None:  # whether the backend wraps an engine's kernel: asked once
            engine = self._engine_kernels[kind] = choice.backend in reg and callable(
                getattr(reg.entry(choice.backend).cls, "engine_setting", None)
            )
        if not engine:
            return None
        key = (regkey, choice.backend, repr(choice.config) if choice.config else "")
        if key in self._engine:
            return self._engine[key]
        try:
            setting = str(reg.get(choice.backend).engine_setting(choice.config))  # type: ignore[attr-defined]  # engine backends only; caught below
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


def backend_for(workload: Workload, results_dir: Path | None) -> tuple[str, str]:
    """``select()``'s backend and reason for ``workload`` — the chooser ``attnbench estimate`` hands
    to :func:`attnbench.cost.estimate.estimate` for a calibrated device."""
    choice = select(workload, results_dir=results_dir)
    return choice.backend, choice.reason
