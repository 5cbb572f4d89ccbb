"""The conformance suite every backend must pass, built-in or plugin (like ``optuna.testing``).

In a plugin's own tests::

    from attnbench.testing import BackendConformance
    from my_plugin import MyBackend

    class TestMyBackend(BackendConformance):
        backend = MyBackend          # the class
        # optional: dtypes = ("fp32", "bf16"); device = "cuda"; configs = [{"block": 64}]

pytest then runs, for every case shape (MHA, GQA, MQA, and MLA for MLA-capable backends) × dtype ×
config: a ragged prefill followed by several decode steps against the float64 reference, a ragged
prompt in two turns (the second appended to the cached first; whole and in chunks) within the
gate's calibrated bound, the
correctness gate (calibrated bounds and needle probes, :mod:`attnbench.correctness.gate`) at a longer ragged
context, and contract checks; and, in the backend's default config, the gate over a long ragged
*decode context* (:data:`LONG_CASES`: the cache filled to 5,003 tokens directly, then decode steps —
where chunk-combining and split bugs live). Every run draws fresh random inputs; a failure prints
the seed and the case, and ``ATTNBENCH_SEED=<seed>`` replays it. A case the backend's
``supports()`` refuses is skipped with that reason; at least one case must be supported.

Adding a case: subclass and extend ``cases`` (or ``long_cases``) with a :class:`ConformanceCase`::

    class TestMyBackend(BackendConformance):
        backend = MyBackend
        cases = (*CASES, ConformanceCase("wide", my_shape, prompt_lens=(5, 70), gate_lens=(300, 17)))

Outside pytest, :func:`run_case` runs one case and raises ``AssertionError`` on a mismatch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from attnbench.core.backend import Backend, ConfigError
from attnbench.core.shapes import ModelShape, load_shape, parse_dtype
from attnbench.core.workload import Workload
from attnbench.correctness.gate import Judge, check, gate_seed, random_step_inputs, within
from attnbench.correctness.reference import compare, reference_decode, reference_prefill

__all__ = [
    "CASES",
    "LONG_CASES",
    "BackendConformance",
    "ConformanceCase",
    "conformance_configs",
    "replay_hint",
    "run_case",
    "run_prefill_turns",
]


@dataclass(frozen=True)
class ConformanceCase:
    """One shape with a ragged batch: prompt lengths, then decode steps; ``gate_lens`` for check()."""

    id: str
    shape: ModelShape
    prompt_lens: tuple[int, ...]
    gate_lens: tuple[int, ...]
    decode_steps: int = 3


def _shape(name: str, heads: int, kv_heads: int, head_dim: int) -> ModelShape:
    return ModelShape.attention_only(
        name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, source="attnbench conformance shape"
    )


CASES: tuple[ConformanceCase, ...] = (
    ConformanceCase("mha", _shape("conf-mha", 4, 4, 32), (7, 19, 1, 33), (70, 5, 129)),
    ConformanceCase("gqa", _shape("conf-gqa", 8, 2, 64), (16, 3, 40), (100, 257)),
    ConformanceCase("mqa", _shape("conf-mqa", 4, 1, 64), (1, 24), (33, 190, 2)),
    ConformanceCase("mla", load_shape("tiny-mla"), (9, 21, 2), (64, 131)),
)

#: Long ragged decode contexts: the gate fills the cache directly (no 5,000-token prefill), then runs
#: one random and one needle-probe decode step; in each backend's default config and first dtype.
LONG_CASES: tuple[ConformanceCase, ...] = (
    ConformanceCase("long-gqa", _shape("conf-gqa", 8, 2, 64), (), (5003, 1290), decode_steps=2),
    ConformanceCase("long-mla", load_shape("tiny-mla"), (), (5003, 777), decode_steps=2),
)


def conformance_configs(backend: type[Backend]) -> list[dict[str, Any]]:
    """The default config, then each tunable's other choices one at a time (others at default)."""
    base = backend.default_config()
    configs = [base]
    for t in backend.tunables:
        configs += [{**base, t.name: c} for c in t.choices if c != t.default]
    return configs


def replay_hint(seed: int, case: str) -> str:
    """How to run a failed case again with the same inputs."""
    return f"seed {seed} (replay: ATTNBENCH_SEED={seed} pytest -k {case!r})"


class _Run(NamedTuple):
    workload: Workload
    config: dict[str, Any]  # the config the backend resolved
    generator: torch.Generator  # the run's random inputs, seeded
    where: str  # the backend, case, dtype, config and replay hint, for the assertion messages


def _start(
    backend: Backend,
    case: ConformanceCase,
    lens: tuple[int, ...],
    *,
    dtype: str | torch.dtype,
    config: Mapping[str, Any] | None,
    device: str,
    seed: int | None,
) -> _Run:
    """``case`` with prompts of ``lens`` tokens, resolved by ``backend`` and seeded (``seed``, else a fresh
    one); raises ``ValueError`` with the backend's reasons where it does not support the case."""
    seed = gate_seed(seed)
    workload = Workload(case.shape, lens, parse_dtype(dtype), device)
    resolution = backend.resolve(workload, config)
    if resolution.reasons:
        raise ValueError(
            f"backend {backend.name!r} does not support case {case.id}: {'; '.join(resolution.reasons)}"
        )
    cfg = dict(resolution.config)
    where = f"backend {backend.name!r} case {case.id} {dtype} config {cfg} {replay_hint(seed, case.id)}"
    return _Run(workload, cfg, torch.Generator().manual_seed(seed), where)


def run_case(
    backend: Backend,
    case: ConformanceCase,
    *,
    dtype: str | torch.dtype,
    config: Mapping[str, Any] | None = None,
    device: str = "cpu",
    seed: int | None = None,
) -> dict[str, Any]:
    """Ragged prefill then ``case.decode_steps`` decode steps on 2 layers, each against float64.

    Raises ``AssertionError`` naming the step, layer and error numbers on any mismatch. Returns the
    worst errors seen (for reporting).
    """
    workload, cfg, gen, where = _start(
        backend, case, case.prompt_lens, dtype=dtype, config=config, device=device, seed=seed
    )
    form = backend.kv_form
    geom = workload.geometry(form)
    tol = backend.tolerance(workload.dtype)
    b, layers = workload.batch, 2
    cache = backend.create_cache(
        workload, config=cfg, num_layers=layers, max_seq_len=max(case.prompt_lens) + case.decode_steps
    )
    worst: dict[str, Any] = {"prefill_rel_l2": 0.0, "decode_rel_l2": 0.0}

    plan = backend.plan(cache, num_new=case.prompt_lens)
    history = []
    for layer in range(layers):
        q, k, v = random_step_inputs(
            geom,
            form,
            batch=b,
            tokens=max(case.prompt_lens),
            dtype=workload.dtype,
            device=device,
            generator=gen,
        )
        out = backend.prefill(cache, plan, layer=layer, q=q, k=k, v=v)
        ref = reference_prefill(q, k, v, case.prompt_lens, scale=geom.scale)
        stats = compare(out, ref)
        failures = within(stats, tol)
        assert not failures, f"{where}: prefill layer {layer}: {'; '.join(failures)}"
        worst["prefill_rel_l2"] = max(worst["prefill_rel_l2"], stats.rel_l2)
        history.append([k, v])
    cache.commit(plan)

    for step in range(case.decode_steps):
        plan = backend.plan(cache, num_new=[1] * b)
        assert plan.positions == tuple(p + step for p in case.prompt_lens), f"{where}: plan positions wrong"
        for layer in range(layers):
            q, k, v = random_step_inputs(
                geom, form, batch=b, tokens=1, dtype=workload.dtype, device=device, generator=gen
            )
            out = backend.decode(cache, plan, layer=layer, q=q[:, 0], k=k[:, 0], v=v[:, 0])
            assert out.shape == (b, geom.num_q_heads, geom.v_head_dim), (
                f"{where}: decode output shape {tuple(out.shape)}, expected {(b, geom.num_q_heads, geom.v_head_dim)}"
            )
            assert out.dtype == workload.dtype, (
                f"{where}: decode output dtype {out.dtype} != {workload.dtype}"
            )
            hk, hv = history[layer]
            hk = _insert(hk, k, plan.positions)
            hv = hk[..., : geom.v_head_dim] if form == "latent" else _insert(hv, v, plan.positions)
            history[layer] = [hk, hv]
            ref = reference_decode(q[:, 0], hk, hv, plan.seq_lens_after, scale=geom.scale)
            stats = compare(out, ref)
            failures = within(stats, tol)
            stored = backend.reference_kv(hk, hv, config=cfg)
            if stored is not None:
                sref = reference_decode(q[:, 0], stored[0], stored[1], plan.seq_lens_after, scale=geom.scale)
                failures += [
                    f"vs stored K/V: {f}"
                    for f in within(compare(out, sref), backend.stored_tolerance(workload.dtype))
                ]
            assert not failures, f"{where}: decode step {step} layer {layer}: {'; '.join(failures)}"
            worst["decode_rel_l2"] = max(worst["decode_rel_l2"], stats.rel_l2)
        cache.commit(plan)
    assert cache.seq_lens == tuple(p + case.decode_steps for p in case.prompt_lens), (
        f"{where}: lengths not committed"
    )
    return worst


def run_prefill_turns(
    backend: Backend,
    case: ConformanceCase,
    *,
    dtype: str | torch.dtype,
    config: Mapping[str, Any] | None = None,
    device: str = "cpu",
    seed: int | None = None,
    budget_bytes: int | None = None,
) -> dict[str, Any]:
    """A ragged prompt in two turns on 2 layers — the second appended to the cached first (a chat's
    second turn) — every prompt row judged against float64 causal attention.

    An exact backend is held to the gate's calibrated bound (:class:`attnbench.correctness.gate.Judge`: the error
    multiple × what a careful implementation in ``dtype`` makes on the same inputs, each prompt row
    judged as a query over its visible keys); a lossy one to its declared bound against exact
    attention. ``budget_bytes`` (set on the backend instance) forces the prefill into chunks of a few
    rows. Raises ``AssertionError`` naming the turn, the layer and the numbers. Returns the worst
    errors and the bounds.
    """
    first = tuple(max(1, n // 2) for n in case.prompt_lens)
    second = tuple(max(1, n - f) for n, f in zip(case.prompt_lens, first, strict=True))
    total = tuple(a + b for a, b in zip(first, second, strict=True))
    workload, cfg, gen, where = _start(
        backend, case, total, dtype=dtype, config=config, device=device, seed=seed
    )
    if budget_bytes is not None:
        backend.prefill_budget_bytes = budget_bytes  # an instance attribute: this backend object only
    form, geom, layers = backend.kv_form, workload.geometry(backend.kv_form), 2
    cache = backend.create_cache(workload, config=cfg, num_layers=layers, max_seq_len=max(total) + 1)
    judge = Judge(
        backend=backend,
        config=cfg,
        dtype=workload.dtype,
        scale=geom.scale,
        multiple=backend.error_multiple(workload.dtype, config=cfg),
    )
    history: list[list[list[torch.Tensor]]] = [[], []]  # per layer: each sequence's K and V so far
    worst = {"rel_l2": 0.0, "max_abs": 0.0}
    for turn, new in enumerate((first, second)):
        plan = backend.plan(cache, num_new=new)
        for layer in range(layers):
            q, k, v = random_step_inputs(
                geom,
                form,
                batch=workload.batch,
                tokens=max(new),
                dtype=workload.dtype,
                device=device,
                generator=gen,
            )
            out = backend.prefill(cache, plan, layer=layer, q=q, k=k, v=v)
            assert out.shape == (*q.shape[:3], geom.v_head_dim), (
                f"{where}: prefill output shape {tuple(out.shape)}"
            )
            hk = [
                torch.cat([history[layer][0][i], k[i, :n]]) if turn else k[i, :n] for i, n in enumerate(new)
            ]
            hv = [hk_i[..., : geom.v_head_dim] for hk_i in hk]  # latent: V is the first Dv columns of K
            if form != "latent":
                hv = [
                    torch.cat([history[layer][1][i], v[i, :n]]) if turn else v[i, :n]
                    for i, n in enumerate(new)
                ]
            history[layer] = [hk, hv]
            # every prompt row as a decode query over the keys it may see
            rows = [(i, r) for i, n in enumerate(new) for r in range(n)]
            lens = tuple(plan.positions[i] + r + 1 for i, r in rows)
            width = max(lens)
            qk = torch.stack([q[i, r] for i, r in rows])
            kk = torch.stack([_pad_rows(hk[i][: lens[j]], width) for j, (i, _) in enumerate(rows)])
            vk = torch.stack([_pad_rows(hv[i][: lens[j]], width) for j, (i, _) in enumerate(rows)])
            got = torch.stack([out[i, r] for i, r in rows])
            ref = reference_decode(qk, kk, vk, lens, scale=geom.scale)
            stats = compare(got, ref)
            worst["rel_l2"] = max(worst["rel_l2"], stats.rel_l2)
            worst["max_abs"] = max(worst["max_abs"], stats.max_abs)
            if backend.lossy:
                failures = within(stats, backend.tolerance(workload.dtype))
                assert not failures, f"{where}: prefill turn {turn + 1} layer {layer}: {'; '.join(failures)}"
            else:
                judge.add(got, qk, kk, vk, lens)
            for i, n in enumerate(new):  # rows past a prompt's length are zero
                if n < max(new):
                    assert not out[i, n:].any(), f"{where}: prefill rows past length {n} not zero"
        cache.commit(plan)
    if not backend.lossy:
        failures, _, _ = judge.failures()
        assert not failures, f"{where}: prefill (two turns, calibrated bound): {'; '.join(failures)}"
        worst["bound_rel_l2"] = judge.tolerances()[0].rel_l2
    assert cache.seq_lens == total, f"{where}: lengths after two turns {cache.seq_lens}, expected {total}"
    return worst


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t [n, H, D]`` zero-padded to ``[rows, H, D]``."""
    return torch.nn.functional.pad(t, (0, 0, 0, 0, 0, rows - t.shape[0]))


def _insert(hist: torch.Tensor, new: torch.Tensor, positions: tuple[int, ...]) -> torch.Tensor:
    """``hist [B, S, H, D]`` with ``new [B, 1, H, D]`` written at each sequence's position."""
    need = max(positions) + 1
    if hist.shape[1] < need:
        hist = torch.cat([hist, hist.new_zeros(hist.shape[0], need - hist.shape[1], *hist.shape[2:])], dim=1)
    hist = hist.clone()
    for i, p in enumerate(positions):
        hist[i, p] = new[i, 0]
    return hist


def _config_id(cfg: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


class BackendConformance:
    """Subclass with ``backend = YourBackendClass``; pytest collects the conformance tests."""

    backend: ClassVar[type[Backend]]
    dtypes: ClassVar[tuple[str, ...]] = ("fp32", "bf16")
    device: ClassVar[str] = "cpu"
    configs: ClassVar[list[dict[str, Any]] | None] = None
    cases: ClassVar[tuple[ConformanceCase, ...]] = CASES
    long_cases: ClassVar[tuple[ConformanceCase, ...]] = LONG_CASES

    @classmethod
    def _cases(cls, cases: tuple[ConformanceCase, ...] | None = None) -> list[ConformanceCase]:
        """The cases for this backend's form; the long ones keep MLA shapes for latent backends only."""
        long = cases is not None
        cases = cls.cases if cases is None else cases
        if cls.backend.kv_form == "latent":
            return [c for c in cases if c.shape.is_mla]
        return [c for c in cases if not (long and c.shape.is_mla)]

    @classmethod
    def _configs(cls) -> list[dict[str, Any]]:
        return cls.configs if cls.configs is not None else conformance_configs(cls.backend)

    def pytest_generate_tests(self, metafunc: Any) -> None:
        cls = metafunc.cls
        if "case" in metafunc.fixturenames:
            cases = cls._cases()
            metafunc.parametrize("case", cases, ids=[c.id for c in cases])
        if "long_case" in metafunc.fixturenames:
            cases = cls._cases(cls.long_cases)
            metafunc.parametrize("long_case", cases, ids=[c.id for c in cases])
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", list(cls.dtypes))
        if "chunked" in metafunc.fixturenames:
            metafunc.parametrize("chunked", [False, True], ids=["whole", "chunked"])
        if "config" in metafunc.fixturenames:
            configs = cls._configs()
            metafunc.parametrize("config", configs, ids=[_config_id(c) for c in configs])

    def _instance_for(
        self,
        case: ConformanceCase,
        dtype: str,
        lens: tuple[int, ...],
        config: Mapping[str, Any] | None = None,
    ) -> Backend:
        """A fresh backend; the test is skipped, with the backend's own reasons, where its resolution
        for this case, dtype and config refuses (e.g. a kernel variant that runs bf16 only)."""
        import pytest  # deferred: a plugin imports this module's helpers without pytest too

        backend = self.backend()
        reasons = backend.resolve(Workload(case.shape, lens, parse_dtype(dtype), self.device), config).reasons
        if reasons:
            with_cfg = f" with {_config_id(config)}" if config else ""
            pytest.skip(f"{backend.name} does not support {case.id}/{dtype}{with_cfg}: {'; '.join(reasons)}")
        return backend

    # -- contract --------------------------------------------------------------------------------
    def test_declares_contract(self) -> None:
        cls = self.backend
        assert isinstance(cls.name, str) and re.fullmatch(r"[a-z][a-z0-9_]*", cls.name), cls.name
        assert cls.kv_form in ("expanded", "latent")
        for t in cls.tunables:
            assert t.default in t.choices and len(set(t.choices)) == len(t.choices), t
        backend = cls()
        w = Workload(self._cases()[0].shape, (4,), torch.float32, self.device)
        res = backend.resolve(w)
        assert res.backend == cls.name and res.workload == w and res.kv_form == cls.kv_form, res
        assert all(isinstance(r, str) and r for r in res.reasons), res.reasons
        assert isinstance(res.implementation, str) and res.lossy == cls.lossy
        assert all(t in cls.tunables or t.name in {u.name for u in cls.tunables} for t in res.tunables)
        assert list(res.reasons) == list(backend.supports(w)), "supports() disagrees with resolve()"
        for dt in (torch.float32, torch.bfloat16):
            tol = backend.tolerance(dt)
            assert all(math.isfinite(x) and x > 0 for x in (tol.max_abs, tol.rel_l2, tol.min_cosine))
            assert tol.min_cosine <= 1.0

    def test_supports_some_case(self) -> None:
        backend = self.backend()
        supported = [
            (c.id, d)
            for c in self._cases()
            for d in self.dtypes
            if backend.resolve(Workload(c.shape, c.prompt_lens, parse_dtype(d), self.device)).runnable
        ]
        assert supported, f"{backend.name} supports none of the conformance cases on {self.device}"

    def test_resolution_counts_the_bytes_its_cache_stores(self) -> None:
        """``resolve().kv_bytes_per_token`` (no cache allocated) equals what a cache reports per token."""
        backend = self.backend()
        for c in self._cases():
            w = Workload(c.shape, c.prompt_lens, parse_dtype(self.dtypes[0]), self.device)
            res = backend.resolve(w)
            if res.runnable:
                cache = backend.create_cache(
                    w, config=res.config, num_layers=2, max_seq_len=max(c.prompt_lens) + 1
                )
                assert res.kv_bytes_per_token * 2 == cache.bytes_per_token() * c.shape.num_layers, (c.id, res)

    def test_rejects_unknown_config(self) -> None:
        import pytest  # deferred: as above

        with pytest.raises(ConfigError, match="no tunable"):
            self.backend.resolve_config({"no_such_tunable_xyz": 1})
        for t in self.backend.tunables:
            with pytest.raises(ConfigError, match=t.name):
                self.backend.resolve_config({t.name: object()})

    # -- numerics --------------------------------------------------------------------------------
    def test_prefill_then_decode(self, case: ConformanceCase, dtype: str, config: dict[str, Any]) -> None:
        backend = self._instance_for(case, dtype, case.prompt_lens, config)
        run_case(backend, case, dtype=dtype, config=config, device=self.device)

    def test_prefill_in_two_turns(self, case: ConformanceCase, dtype: str, chunked: bool) -> None:
        """Ragged prompts, then a second prompt appended to the cached first, unchunked and in chunks
        of a few rows: every row within the calibrated bound of float64 causal attention."""
        backend = self._instance_for(case, dtype, case.prompt_lens)
        run_prefill_turns(
            backend, case, dtype=dtype, device=self.device, budget_bytes=512 if chunked else None
        )

    def test_gate_at_ragged_context(self, case: ConformanceCase, dtype: str, config: dict[str, Any]) -> None:
        backend = self._instance_for(case, dtype, case.gate_lens, config)
        workload = Workload(case.shape, case.gate_lens, parse_dtype(dtype), self.device)
        result = check(backend, workload, config=config)
        assert result.passed, (
            f"{backend.name} {case.id} {dtype} {config} {replay_hint(result.seed, case.id)}: {result.summary()}"
        )
        assert result.probes > 0 and result.retrieval == 1.0

    def test_long_decode_context(self, long_case: ConformanceCase) -> None:
        """The gate over a ragged cache filled to 5,003 tokens, default config, first dtype."""
        dtype = self.dtypes[0]
        backend = self._instance_for(long_case, dtype, long_case.gate_lens)
        workload = Workload(long_case.shape, long_case.gate_lens, parse_dtype(dtype), self.device)
        result = check(backend, workload, decode_steps=long_case.decode_steps)
        assert result.passed, (
            f"{backend.name} {long_case.id} {dtype} {replay_hint(result.seed, long_case.id)}: {result.summary()}"
        )
        assert result.retrieval == 1.0 and result.probes >= 4

    def test_fresh_inputs_each_run(self, case: ConformanceCase) -> None:
        """Two runs draw different inputs (guards against a suite that tests one fixed draw)."""
        dtype = self.dtypes[0]
        backend = self._instance_for(case, dtype, case.gate_lens)
        workload = Workload(case.shape, case.gate_lens, parse_dtype(dtype), self.device)
        a, b = (
            check(backend, workload, decode_steps=1, num_layers=1),
            check(backend, workload, decode_steps=1, num_layers=1),
        )
        assert a.seed != b.seed, f"two runs drew the same seed {a.seed}"
        for r in (a, b):
            assert r.passed, f"{backend.name} {case.id} {dtype} {replay_hint(r.seed, case.id)}: {r.summary()}"
