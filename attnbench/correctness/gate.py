"""The correctness gate: a backend's decode output against float64 attention on the same inputs.

:func:`check` fills a cache to the workload's full (ragged) context with fresh random K/V and needle
probes, runs decode steps, and holds every output to a multiple of the error of a calibration
reference that rounds as carefully as the dtype allows (docs/correctness.md). The result is numbers,
not a boolean; NaN never passes. A candidate that fails is never timed or selected."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnbench.core.backend import DEFAULT_ERROR_MULTIPLE, Backend, Resolution, Tolerance
from attnbench.core.shapes import AttentionGeometry, KVForm
from attnbench.core.workload import Workload
from attnbench.correctness.needles import GateInputs, Probe, build_gate_inputs
from attnbench.correctness.reference import ErrorStats, compare, reference_pair

__all__ = [
    "CheckResult",
    "GateCase",
    "Judge",
    "angle",
    "calibrated_tolerance",
    "check",
    "gate_seed",
    "prepare_case",
    "random_step_inputs",
    "within",
]


#: Absolute floors of the calibrated bounds, in units of the dtype's machine epsilon: ``max_abs``
#: gets half an ulp at the reference's largest value, ``rel_l2`` and the angle ``√(2(1 − cos))`` an
#: eighth of an epsilon. They matter only where the calibration error itself is near zero.
FLOOR_EPS = {"max_abs": 0.5, "rel_l2": 0.125, "angle": 0.125}

#: The accumulation allowance, in units of float32's epsilon × √(tokens): any float32 sum over ``n``
#: tokens may differ from another equally careful order by about ``√n · eps32`` of its size. It is
#: what lets a third order (split-K, other tile sizes) through in float32, where the order is the
#: error; in bf16/fp16 it is far below one output ulp.
ACCUMULATION_EPS = {"max_abs": 0.25, "rel_l2": 0.125, "angle": 0.125}


def within(stats: ErrorStats, tol: Tolerance) -> list[str]:
    """Which bounds ``stats`` breaks (empty list: all met)."""
    if stats.nonfinite:
        return [f"{stats.nonfinite} of {stats.numel} output values are NaN or inf"]
    failures = []
    if not stats.max_abs <= tol.max_abs:
        failures.append(f"max_abs {stats.max_abs:.3g} > {tol.max_abs:.3g}")
    if not stats.rel_l2 <= tol.rel_l2:
        failures.append(f"rel_l2 {stats.rel_l2:.3g} > {tol.rel_l2:.3g}")
    if not stats.cosine >= tol.min_cosine:
        failures.append(f"cosine {stats.cosine:.9f} < {tol.min_cosine:.9f}")
    return failures


def angle(cosine: float) -> float:
    """The chord between two unit vectors with this cosine, ``√(2(1 − cos))``: linear in the error."""
    return math.sqrt(max(0.0, 2.0 * (1.0 - cosine)))


def calibrated_tolerance(
    calibration: ErrorStats, *, multiple: float, dtype: torch.dtype, ref_max: float, tokens: int = 1
) -> Tolerance:
    """``multiple`` × the calibration reference's error, per metric, plus the floors: the dtype's
    (:data:`FLOOR_EPS`) and float32 accumulation's over ``tokens`` (:data:`ACCUMULATION_EPS`)."""
    eps, acc = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps * math.sqrt(max(tokens, 1))
    top = max(ref_max, 1e-30)
    max_abs = (
        multiple * calibration.max_abs
        + (FLOOR_EPS["max_abs"] * eps + ACCUMULATION_EPS["max_abs"] * acc) * top
    )
    rel_l2 = multiple * calibration.rel_l2 + FLOOR_EPS["rel_l2"] * eps + ACCUMULATION_EPS["rel_l2"] * acc
    chord = multiple * angle(calibration.cosine) + FLOOR_EPS["angle"] * eps + ACCUMULATION_EPS["angle"] * acc
    return Tolerance(max_abs=max_abs, rel_l2=rel_l2, min_cosine=1.0 - chord * chord / 2.0)


@dataclass
class _Worst:
    """Worst value of each metric over every step and layer (each metric on its own)."""

    max_abs: float = 0.0
    rel_l2: float = 0.0
    cosine: float = 1.0
    nonfinite: int = 0
    numel: int = 0
    ref_max: float = 0.0
    tokens: int = 0  # the longest sequence attended over

    def add(self, stats: ErrorStats, ref_max: float, tokens: int = 0) -> None:
        self.max_abs = max(self.max_abs, stats.max_abs)
        self.rel_l2 = max(self.rel_l2, stats.rel_l2)
        self.cosine = min(self.cosine, stats.cosine)
        self.nonfinite += stats.nonfinite
        self.numel += stats.numel
        self.ref_max = max(self.ref_max, ref_max)
        self.tokens = max(self.tokens, tokens)

    def stats(self) -> ErrorStats:
        return ErrorStats(self.max_abs, self.rel_l2, self.cosine, self.nonfinite, self.numel)


@dataclass(frozen=True)
class CheckResult:
    """Outcome of :func:`check`: numbers, never a boolean.

    ``error`` is the candidate's worst error against float64 attention, each metric's worst over every
    decode step and layer; ``calibration`` the same for the calibration reference (the workload's
    dtype rounded as a careful kernel rounds it, :func:`attnbench.correctness.reference.calibration_decode`);
    ``tolerance`` the bound that was applied — for an exact backend ``multiple`` × ``calibration`` plus
    a floor; for a lossy one its declared bound against exact attention, while ``stored_*`` hold the
    calibrated comparison against the K/V as the backend stores them. ``retrieval`` is the share of
    needle probes whose every output value was within the ``max_abs`` bound (a correct backend
    retrieves 1.0; a missed probe is also a ``max_abs`` failure of the whole run).
    """

    backend: str
    config: dict[str, Any]
    workload: str
    seed: int
    error: ErrorStats
    tolerance: Tolerance
    failures: list[str]
    calibration: ErrorStats | None = None
    multiple: float = DEFAULT_ERROR_MULTIPLE
    retrieval: float = 1.0
    probes: int = 0
    missed: tuple[str, ...] = ()  # the probes that were not retrieved, described
    decode_steps: int = 0
    lossy: str = ""
    stored_error: ErrorStats | None = None  # against K/V as the backend stores them (fp8)
    stored_calibration: ErrorStats | None = None
    stored_tolerance: Tolerance | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def ratios(self) -> dict[str, float]:
        """Candidate error / calibration error per metric (exact comparison, or stored for lossy)."""
        err, cal = (
            (self.stored_error, self.stored_calibration) if self.lossy else (self.error, self.calibration)
        )
        if err is None or cal is None:
            return {}

        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else (math.inf if a > 0 else 1.0)

        return {
            "max_abs": ratio(err.max_abs, cal.max_abs),
            "rel_l2": ratio(err.rel_l2, cal.rel_l2),
            "angle": ratio(angle(err.cosine), angle(cal.cosine)),
        }

    def bound_share(self) -> float:
        """The candidate's worst error as a share of its bound, over the metrics (≤ 1 passes)."""
        pairs = [(self.error, self.tolerance)]
        if self.stored_error is not None and self.stored_tolerance is not None:
            pairs.append((self.stored_error, self.stored_tolerance))
        worst = 0.0
        for err, tol in pairs:
            if err.nonfinite:
                return math.inf
            worst = max(
                worst,
                err.max_abs / tol.max_abs,
                err.rel_l2 / tol.rel_l2,
                angle(err.cosine) / max(angle(tol.min_cosine), 1e-300),
            )
        return worst

    def summary(self) -> str:
        verdict = "pass" if self.passed else "FAIL: " + "; ".join(self.failures)
        e = self.error
        text = f"max_abs={e.max_abs:.2e} rel_l2={e.rel_l2:.2e} cos={e.cosine:.6f}"
        if self.calibration is not None and not self.lossy:
            text += f" (calibration rel_l2={self.calibration.rel_l2:.2e}, ×{self.multiple:g} allowed)"
        if self.lossy:
            text += f" lossy ({self.lossy})"
        if self.probes:
            text += f" retrieval={self.retrieval:.0%} of {self.probes}"
        return f"{text} seed={self.seed} ({verdict})"

    def as_dict(self) -> dict[str, Any]:
        head = ("backend", "config", "workload", "seed", "passed", "failures")  # as they are, in this order
        return {key: getattr(self, key) for key in head} | {
            "error": self.error.as_dict(),
            "calibration": self.calibration.as_dict() if self.calibration else None,
            "multiple": self.multiple,
            "ratios": self.ratios(),
            "bound_share": self.bound_share(),
            "tolerance": vars(self.tolerance),
            "retrieval": self.retrieval,
            "probes": self.probes,
            "missed": list(self.missed),
            "decode_steps": self.decode_steps,
            "lossy": self.lossy,
            "stored_error": self.stored_error.as_dict() if self.stored_error else None,
            "stored_calibration": self.stored_calibration.as_dict() if self.stored_calibration else None,
            "stored_tolerance": vars(self.stored_tolerance) if self.stored_tolerance else None,
        }


def random_step_inputs(
    geometry: AttentionGeometry,
    form: str,
    *,
    batch: int,
    tokens: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh N(0, 1) ``q [B, T, Hq, Dk]``, ``k [B, T, Hkv, Dk]``, ``v [B, T, Hkv, Dv]``.

    For the latent form ``v`` is the first ``Dv`` columns of ``k`` (the shared latent).
    """
    g = geometry

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)

    q = randn(batch, tokens, g.num_q_heads, g.qk_head_dim)
    k = randn(batch, tokens, g.num_kv_heads, g.qk_head_dim)
    v = k[..., : g.v_head_dim] if form == "latent" else randn(batch, tokens, g.num_kv_heads, g.v_head_dim)
    return q, k, v


def gate_seed(seed: int | None = None) -> int:
    """``seed``, else ``ATTNBENCH_SEED`` from the environment (to replay a failure), else a fresh one."""
    if seed is not None:
        return int(seed)
    env = os.environ.get("ATTNBENCH_SEED", "").strip()
    if env:
        try:
            return int(env, 0)
        except ValueError:
            raise ValueError(f"ATTNBENCH_SEED = {env!r} is not an integer (accepted: e.g. 12345)") from None
    return int.from_bytes(os.urandom(4), "little")


@dataclass
class Judge:
    """Compares outputs with float64 and with the calibration reference; keeps each metric's worst.

    Used by :func:`check` over a whole gate run and by the timed-run spot check on one call.
    """

    backend: Backend
    config: Mapping[str, Any]
    dtype: torch.dtype
    scale: float
    multiple: float
    exact: _Worst = field(default_factory=_Worst)
    calib: _Worst = field(default_factory=_Worst)
    stored: _Worst | None = None
    stored_calib: _Worst | None = None
    probe_stats: list[tuple[Probe, ErrorStats, ErrorStats | None]] = field(default_factory=list)

    def add(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        hk: torch.Tensor,
        hv: torch.Tensor,
        lens: tuple[int, ...],
        *,
        probes: Sequence[Probe] = (),
        expected: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> None:
        """One call's output ``out [B, Hq, Dv]`` for query ``q`` over history ``hk``/``hv``.

        ``expected``: the float64 and calibration outputs of these inputs, when already computed.
        """
        ref, cals = expected if expected is not None else reference_pair(q, hk, hv, lens, scale=self.scale)
        ref_max = float(ref.abs().max()) if ref.numel() else 0.0
        self.exact.add(compare(out, ref), ref_max, max(lens))
        for cal in cals:  # each metric's worst over the calibration orders, as over steps and layers
            self.calib.add(compare(cal, ref), ref_max)
        stored = self.backend.reference_kv(hk, hv, config=self.config)
        sref = None
        if stored is not None:
            sref, scals = reference_pair(q, stored[0], stored[1], lens, scale=self.scale)
            s_max = float(sref.abs().max()) if sref.numel() else 0.0
            self.stored = self.stored or _Worst()
            self.stored_calib = self.stored_calib or _Worst()
            self.stored.add(compare(out, sref), s_max, max(lens))
            for scal in scals:
                self.stored_calib.add(compare(scal, sref), s_max)
        for probe in probes:
            sl = (probe.seq, slice(*probe.q_heads))
            exact = compare(out[sl], ref[sl])
            st = compare(out[sl], sref[sl]) if sref is not None else None
            self.probe_stats.append((probe, exact, st))

    def tolerances(self) -> tuple[Tolerance, Tolerance | None]:
        """The bound against exact attention, and (lossy caches) against the stored K/V."""

        def calibrated(calib: _Worst, acc: _Worst) -> Tolerance:
            return calibrated_tolerance(
                calib.stats(),
                multiple=self.multiple,
                dtype=self.dtype,
                ref_max=acc.ref_max,
                tokens=acc.tokens,
            )

        lossy = self.stored is not None
        exact_tol = self.backend.tolerance(self.dtype) if lossy else calibrated(self.calib, self.exact)
        stored_tol = None
        if self.stored is not None and self.stored_calib is not None:
            stored_tol = calibrated(self.stored_calib, self.stored)
        return exact_tol, stored_tol

    def failures(self) -> tuple[list[str], float, tuple[str, ...]]:
        """What broke a bound, the needle retrieval and the probes that were missed."""
        exact_tol, stored_tol = self.tolerances()
        failures = within(self.exact.stats(), exact_tol)
        if self.stored is not None and stored_tol is not None:
            failures += [f"vs stored K/V: {f}" for f in within(self.stored.stats(), stored_tol)]
        missed = []
        for probe, exact, st in self.probe_stats:  # a probe is retrieved when every value is in bound
            bad = (
                []
                if exact.nonfinite == 0 and exact.max_abs <= exact_tol.max_abs
                else [f"max_abs {exact.max_abs:.3g} > {exact_tol.max_abs:.3g}"]
            )
            if st is not None and stored_tol is not None and not st.max_abs <= stored_tol.max_abs:
                bad.append(f"vs stored K/V: max_abs {st.max_abs:.3g} > {stored_tol.max_abs:.3g}")
            if bad:
                missed.append(f"{probe.describe()}: {'; '.join(bad)}")
        n = len(self.probe_stats)
        retrieval = 1.0 - len(missed) / n if n else 1.0
        if missed:
            failures.append(f"needle retrieval {retrieval:.0%}: missed {missed[0]}")
        return failures, retrieval, tuple(missed)


@dataclass
class GateCase:
    """A gate run's inputs and expected outputs, built once and usable for many candidates.

    ``expected[(step, layer)] = (float64 output, [calibration outputs])`` of each decode call.
    """

    workload: Workload
    form: str
    num_layers: int
    seed: int
    inputs: GateInputs
    expected: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]]

    def matches(self, workload: Workload, form: str) -> bool:
        return (self.workload, self.form) == (workload, form)


def prepare_case(
    workload: Workload,
    *,
    form: KVForm = "expanded",
    num_layers: int = 2,
    decode_steps: int | None = None,
    seed: int | None = None,
    probes: bool = True,
) -> GateCase:
    """Inputs (with needle probes) and the float64 and calibration outputs for a gate run."""
    seed = gate_seed(seed)
    geom = workload.geometry(form)
    inputs = build_gate_inputs(
        geom,
        form,
        context_lens=tuple(workload.context_lens),
        num_layers=num_layers,
        decode_steps=decode_steps,
        dtype=workload.dtype,
        device=torch.device(workload.device),
        generator=torch.Generator().manual_seed(seed),
        probes=probes,
    )
    expected = {}
    for step in range(inputs.decode_steps):
        lens = tuple(n + step + 1 for n in workload.context_lens)
        for layer in range(num_layers):
            q = inputs.steps[step][layer][0]
            hk, hv = inputs.history[layer]
            n = max(lens)
            expected[(step, layer)] = reference_pair(q, hk[:, :n], hv[:, :n], lens, scale=geom.scale)
    return GateCase(workload, form, num_layers, seed, inputs, expected)


def check(
    backend: Backend,
    workload: Workload,
    *,
    config: Mapping[str, Any] | None = None,
    seed: int | None = None,
    decode_steps: int | None = None,
    num_layers: int = 2,
    probes: bool = True,
    multiple: float | None = None,
    case: GateCase | None = None,
    resolution: Resolution | None = None,
) -> CheckResult:
    """Compare ``backend``'s decode against float64 attention for ``workload``.

    The cache is filled to ``workload.context_lens`` (the workload's full context) with random K/V —
    fresh each call unless ``seed`` or ``ATTNBENCH_SEED`` is given; the seed is recorded — in which
    needle probes are planted (:mod:`attnbench.correctness.needles`), then ``decode_steps`` steps run over
    ``num_layers`` layers, each layer with its own data so that a mix-up between layers shows
    (``None``: one random step plus as many probe steps as the probes need). Every output is compared
    with float64 attention and with the calibration reference on the same inputs; the candidate
    passes when each metric's worst over every step and layer is within ``multiple`` (default: the
    backend's ``error_multiple(dtype)``) × the calibration's worst plus a floor, and every probe is
    retrieved. ``case`` (from :func:`prepare_case`) reuses inputs and references across candidates;
    ``resolution`` (``backend.resolve(workload, config)``) is reused when it answers this workload."""
    if resolution is None or not resolution.matches(workload, config):
        resolution = backend.resolve(workload, config)
    cfg = dict(resolution.require().config)
    mult = float(backend.error_multiple(workload.dtype, config=cfg) if multiple is None else multiple)
    if not (math.isfinite(mult) and mult > 0):
        raise ValueError(f"error multiple = {mult!r} must be a positive number")
    form = backend.kv_form
    if case is None:
        case = prepare_case(
            workload, form=form, num_layers=num_layers, decode_steps=decode_steps, seed=seed, probes=probes
        )
    elif not case.matches(workload, form):
        raise ValueError(f"gate case was prepared for {case.workload.describe()} ({case.form} form)")
    inputs, num_layers = case.inputs, case.num_layers
    geom = workload.geometry(form)
    b, lens = workload.batch, tuple(workload.context_lens)
    steps = inputs.decode_steps
    cache = backend.create_cache(workload, config=cfg, num_layers=num_layers, max_seq_len=max(lens) + steps)
    if max(lens) > 0:
        plan = backend.plan(cache, num_new=lens)
        for layer, (k, v) in enumerate(inputs.history):
            backend.append(cache, plan, layer=layer, k=k[:, : max(lens)], v=v[:, : max(lens)])
        cache.commit(plan)

    judge = Judge(backend=backend, config=cfg, dtype=workload.dtype, scale=geom.scale, multiple=mult)
    by_call: dict[tuple[int, int], list[Probe]] = {}
    for p in inputs.probes:
        by_call.setdefault((p.step, p.layer), []).append(p)
    for step in range(steps):
        plan = backend.plan(cache, num_new=[1] * b)
        for layer in range(num_layers):
            q, k, v = inputs.steps[step][layer]
            out = backend.decode(cache, plan, layer=layer, q=q, k=k, v=v)
            hk, hv = inputs.history[layer]
            n = max(plan.seq_lens_after)
            judge.add(
                out,
                q,
                hk[:, :n],
                hv[:, :n],
                plan.seq_lens_after,
                probes=by_call.get((step, layer), []),
                expected=case.expected[(step, layer)],
            )
        cache.commit(plan)
    del cache

    failures, retrieval, missed = judge.failures()
    exact_tol, stored_tol = judge.tolerances()
    return CheckResult(
        backend=backend.name,
        config=cfg,
        workload=workload.describe(),
        seed=case.seed,
        error=judge.exact.stats(),
        tolerance=exact_tol,
        failures=failures,
        calibration=judge.calib.stats(),
        multiple=mult,
        retrieval=retrieval,
        probes=len(judge.probe_stats),
        missed=missed,
        decode_steps=steps,
        lossy=resolution.lossy,
        stored_error=judge.stored.stats() if judge.stored else None,
        stored_calibration=judge.stored_calib.stats() if judge.stored_calib else None,
        stored_tolerance=stored_tol,
    )
