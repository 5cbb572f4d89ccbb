"""The correctness gate: a backend's decode output against float64 attention on the same inputs.

:func:`check` fills a cache with fresh random K/V at the workload's context lengths (ragged if the
workload is), runs decode steps, and compares each output with :func:`reference_decode`. The result
is numbers, not a boolean; NaN or inf never passes. A candidate that fails is never timed or selected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from attnbench.backend import Backend, Tolerance
from attnbench.reference import ErrorStats, compare, reference_decode
from attnbench.shapes import AttentionGeometry
from attnbench.workload import Workload

__all__ = ["CheckResult", "check", "random_step_inputs", "within"]


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
        failures.append(f"cosine {stats.cosine:.7f} < {tol.min_cosine}")
    return failures


@dataclass(frozen=True)
class CheckResult:
    """Outcome of :func:`check`: the worst error over all steps, against the declared tolerance."""

    backend: str
    config: dict[str, Any]
    workload: str
    seed: int
    error: ErrorStats
    tolerance: Tolerance
    failures: list[str]
    stored_error: ErrorStats | None = None  # against K/V as the backend stores them (fp8)
    stored_tolerance: Tolerance | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        verdict = "pass" if self.passed else "FAIL: " + "; ".join(self.failures)
        e = self.error
        return f"max_abs={e.max_abs:.2e} rel_l2={e.rel_l2:.2e} cos={e.cosine:.6f} ({verdict})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "config": self.config,
            "workload": self.workload,
            "seed": self.seed,
            "passed": self.passed,
            "failures": self.failures,
            "error": self.error.as_dict(),
            "tolerance": vars(self.tolerance),
            "stored_error": self.stored_error.as_dict() if self.stored_error else None,
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


def check(
    backend: Backend,
    workload: Workload,
    *,
    config: Mapping[str, Any] | None = None,
    seed: int | None = None,
    decode_steps: int = 2,
    num_layers: int = 2,
) -> CheckResult:
    """Compare ``backend``'s decode against float64 attention for ``workload``.

    The cache is filled to ``workload.context_lens`` with random K/V (fresh each call unless ``seed``
    is given; the seed used is recorded), then ``decode_steps`` steps run over ``num_layers`` layers,
    each layer with its own data so that a mix-up between layers shows. Returns the worst error.
    """
    reasons = backend.supports(workload)
    if reasons:
        raise ValueError(f"backend {backend.name!r} cannot run this workload: {'; '.join(reasons)}")
    cfg = backend.resolve_config(config)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    form = backend.kv_form
    geom = workload.geometry(form)
    device = torch.device(workload.device)
    dtype = workload.dtype
    b = workload.batch
    lens = list(workload.context_lens)
    max_len = max(lens) + decode_steps
    cache = backend.create_cache(workload, config=cfg, num_layers=num_layers, max_seq_len=max_len)

    # history[layer] = (k, v) of every token so far, [B, max_len, Hkv, D]
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    if max(lens) > 0:
        plan = backend.plan(cache, num_new=lens)
        fill_geom = replace(geom, num_q_heads=geom.num_kv_heads)
        for layer in range(num_layers):
            _, k, v = random_step_inputs(  # no query for the history: with MLA's 128 heads it is 128× K
                fill_geom, form, batch=b, tokens=max(lens), dtype=dtype, device=device, generator=gen
            )
            backend.append(cache, plan, layer=layer, k=k, v=v)
            history.append((k, v))
        cache.commit(plan)
    else:
        empty = torch.empty(b, 0, geom.num_kv_heads, geom.qk_head_dim, dtype=dtype, device=device)
        history = [(empty, empty[..., : geom.v_head_dim])] * num_layers

    worst: ErrorStats | None = None
    worst_stored: ErrorStats | None = None
    for _ in range(decode_steps):
        plan = backend.plan(cache, num_new=[1] * b)
        for layer in range(num_layers):
            q, k, v = random_step_inputs(
                geom, form, batch=b, tokens=1, dtype=dtype, device=device, generator=gen
            )
            out = backend.decode(cache, plan, layer=layer, q=q[:, 0], k=k[:, 0], v=v[:, 0])
            hk, hv = history[layer]
            hk, hv = _scatter_new(hk, hv, k, v, plan.positions)
            history[layer] = (hk, hv)
            ref = reference_decode(q[:, 0], hk, hv, plan.seq_lens_after, scale=geom.scale)
            stats = compare(out, ref)
            worst = stats if worst is None or _worse(stats, worst) else worst
            stored = backend.reference_kv(hk, hv, config=cfg)
            if stored is not None:
                sref = reference_decode(q[:, 0], stored[0], stored[1], plan.seq_lens_after, scale=geom.scale)
                s_stats = compare(out, sref)
                worst_stored = (
                    s_stats if worst_stored is None or _worse(s_stats, worst_stored) else worst_stored
                )
        cache.commit(plan)

    assert worst is not None
    tol = backend.tolerance(dtype)
    failures = within(worst, tol)
    stol = None
    if worst_stored is not None:
        stol = backend.stored_tolerance(dtype)
        failures += [f"vs stored K/V: {f}" for f in within(worst_stored, stol)]
    return CheckResult(
        backend=backend.name,
        config=cfg,
        workload=workload.describe(),
        seed=seed,
        error=worst,
        tolerance=tol,
        failures=failures,
        stored_error=worst_stored,
        stored_tolerance=stol,
    )


def _worse(a: ErrorStats, b: ErrorStats) -> bool:
    return (a.nonfinite, a.rel_l2) > (b.nonfinite, b.rel_l2)


def _scatter_new(
    hk: torch.Tensor, hv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """History with one new token per sequence written at ``positions`` (grows the buffer if needed)."""
    need = max(positions) + 1
    if hk.shape[1] < need:
        pad = need - hk.shape[1]
        hk = torch.cat([hk, hk.new_zeros(hk.shape[0], pad, *hk.shape[2:])], dim=1)
        hv = torch.cat([hv, hv.new_zeros(hv.shape[0], pad, *hv.shape[2:])], dim=1)
    hk, hv = hk.clone(), hv.clone()
    for i, p in enumerate(positions):
        hk[i, p] = k[i, 0]
        hv[i, p] = v[i, 0]
    return hk, hv
