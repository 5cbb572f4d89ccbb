"""The ``mla`` backend: latent cache, absorbed decode (torch and Triton), expanded baseline, roofline.

Both MLA paths — absorbed ``mla`` (torch and Triton split-KV) and expanded ``naive`` — are compared with
the float64 expanded math: random ``W_UK``/``W_UV`` and latents, decompressed in float64, attended
per head. The Triton kernels run in the interpreter here and are compiled ahead of time for sm_80 and
sm_90 for every declared tile.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import math
from typing import Any, ClassVar

import pytest
import torch

from attnbench.backends.mla import TILES, MLABackend, decode_spec, effective_tile
from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import Backend, ConfigError
from attnbench.core.shapes import ModelShape, load_shape
from attnbench.core.traffic import decode_cost, decode_roofline
from attnbench.core.workload import Workload
from attnbench.correctness.aot import specialization
from attnbench.correctness.gate import check
from attnbench.correctness.reference import compare, reference_decode
from attnbench.kernels.triton_decode import auto_splits
from attnbench.kernels.triton_utils import aot_compile_many
from attnbench.models.mla import (
    absorb_query,
    expand_kv,
    expand_output,
    latent_query,
    split_kv_b,
)
from attnbench.testing import BackendConformance

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TestMLAConformance(BackendConformance):
    backend = MLABackend
    # the default, the torch path, and the kernel's edge cases: many (empty) splits on small pages,
    # one split on large pages, each other tile (the full one-at-a-time grid is too slow interpreted)
    configs: ClassVar[list[dict[str, Any]]] = [
        {},
        {"kernel": "torch"},
        {"kernel": "torch", "page_size": 16},
        {"num_splits": 8, "page_size": 16},
        {"num_splits": 1, "page_size": 128, "tile": "h16_n64_w8"},
        {"tile": "h32_n32_w8", "num_splits": 2},
        {"tile": "h32_n64_w8", "page_size": 32},
    ]


def _dsv3_dims(heads: int) -> ModelShape:
    """DeepSeek-V3's per-head and latent dims (rank 512, rope 64, nope 128, v 128) with fewer heads."""
    return ModelShape(
        name=f"dsv3-dims-h{heads}",
        num_layers=1,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=192,
        hidden_size=7168,
        intermediate_size=18432,
        vocab_size=129280,
        num_params=10**9,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )


# -- float64 expanded math: both paths ---------------------------------------------------------------
def _mla_problem(
    shape: ModelShape, lens: tuple[int, ...], dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Random weights, latents and one decode query, rounded to ``dtype`` (the float64 math starts there)."""
    gen = torch.Generator().manual_seed(seed)
    h, rank, rope = shape.num_heads, shape.kv_lora_rank, shape.qk_rope_head_dim
    nope, vd, b, s = shape.qk_nope_head_dim, shape.v_head_dim, len(lens), max(lens)

    def randn(*size: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * std).to(dtype)

    return {
        "w_uk": randn(h, nope, rank, std=rank**-0.5),
        "w_uv": randn(h, vd, rank, std=rank**-0.5),
        "latent": randn(b, s, rank),
        "k_pe": randn(b, s, rope),
        "q_nope": randn(b, h, nope),
        "q_pe": randn(b, h, rope),
    }


def _expanded_reference(p: dict[str, torch.Tensor], lens: tuple[int, ...], scale: float) -> torch.Tensor:
    """Decompress the latents in float64, attend per head: ``[B, H, v_head_dim]`` float64."""
    d = {k: v.double() for k, v in p.items()}
    k, v = expand_kv(d["latent"], d["k_pe"], d["w_uk"], d["w_uv"])  # [B, S, H, nope+rope], [B, S, H, v]
    q = torch.cat([d["q_nope"], d["q_pe"]], dim=-1)
    return reference_decode(q, k, v, lens, scale=scale)


def _run_decode(
    backend: Backend,
    shape: ModelShape,
    lens: tuple[int, ...],
    dtype: torch.dtype,
    config: dict[str, Any],
    k_hist: torch.Tensor,  # [B, S, Hkv, Dk]
    v_hist: torch.Tensor,  # [B, S, Hkv, Dv]
    q: torch.Tensor,  # [B, Hq, Dk]
) -> torch.Tensor:
    """Fill a cache with the history but the last token of each sequence, then decode that token."""
    w = Workload(shape, tuple(n - 1 for n in lens), dtype)
    cache = backend.create_cache(
        w, config=backend.resolve_config(config), num_layers=1, max_seq_len=max(lens)
    )
    prompt = [n - 1 for n in lens]
    plan = backend.plan(cache, num_new=prompt)
    backend.append(cache, plan, layer=0, k=k_hist[:, : max(prompt)], v=v_hist[:, : max(prompt)])
    cache.commit(plan)
    plan = backend.plan(cache, num_new=[1] * len(lens))
    rows = torch.arange(len(lens))
    last = torch.tensor(prompt)
    return backend.decode(cache, plan, layer=0, q=q, k=k_hist[rows, last], v=v_hist[rows, last])


# measured bounds with margin: fp32 is exact up to reassociation; bf16 also rounds the absorbed query,
# the output latent and the expanded output (three more bf16 roundings than plain attention)
PATH_TOL = {torch.float32: (1e-5, 0.999_999), torch.bfloat16: (2e-2, 0.999)}  # measured: 5e-7, 6e-3


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    ("shape", "lens"),
    [(load_shape("tiny-mla"), (70, 5, 129)), (_dsv3_dims(32), (100, 37))],
    ids=["tiny-mla", "dsv3-dims"],
)
@pytest.mark.parametrize("path", ["mla-triton", "mla-torch", "naive-expanded"])
def test_both_paths_match_float64_expanded_math(
    path: str, shape: ModelShape, lens: tuple, dtype: torch.dtype
) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    p = _mla_problem(shape, lens, dtype, seed)
    ref = _expanded_reference(p, lens, scale=shape.geometry().scale)
    if path.startswith("mla"):
        q = latent_query(p["q_nope"], p["q_pe"], p["w_uk"])  # absorbed in the working dtype
        k = torch.cat([p["latent"], p["k_pe"]], dim=-1)[:, :, None]  # [B, S, 1, rank + rope]
        config = {"kernel": path.removeprefix("mla-")}
        out_lat = _run_decode(MLABackend(), shape, lens, dtype, config, k, k[..., : shape.kv_lora_rank], q)
        out = expand_output(out_lat, p["w_uv"])
    else:
        k, v = expand_kv(p["latent"], p["k_pe"], p["w_uk"], p["w_uv"])  # what transformers would cache
        q = torch.cat([p["q_nope"], p["q_pe"]], dim=-1)
        out = _run_decode(NaiveBackend(), shape, lens, dtype, {}, k, v, q)
    assert out.shape == ref.shape and out.dtype == dtype
    stats = compare(out, ref)
    rel, cos = PATH_TOL[dtype]
    assert stats.rel_l2 <= rel and stats.cosine >= cos, f"{path} seed {seed}: {stats}"


def test_absorption_identities_in_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    h, nope, vd, rank = 3, 8, 6, 16
    w = torch.randn(h * (nope + vd), rank, generator=gen, dtype=torch.float64)
    w_uk, w_uv = split_kv_b(w, num_heads=h, qk_nope_head_dim=nope, v_head_dim=vd)
    assert w_uk.shape == (h, nope, rank) and w_uv.shape == (h, vd, rank)
    c = torch.randn(5, rank, generator=gen, dtype=torch.float64)
    q = torch.randn(h, nope, generator=gen, dtype=torch.float64)
    k_nope = torch.einsum("hnr,sr->shn", w_uk, c)
    torch.testing.assert_close(torch.einsum("hn,shn->hs", q, k_nope), absorb_query(q, w_uk) @ c.T)
    p = torch.softmax(torch.randn(h, 5, generator=gen, dtype=torch.float64), -1)
    v = torch.einsum("hvr,sr->shv", w_uv, c)
    torch.testing.assert_close(torch.einsum("hs,shv->hv", p, v), expand_output(p @ c, w_uv))
    with pytest.raises(ValueError, match=r"expected \[3 \* 14, kv_lora_rank\]"):
        split_kv_b(w[:-1], num_heads=h, qk_nope_head_dim=nope, v_head_dim=vd)


# -- transformers' DeepseekV3Attention -----------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["triton", "torch"])
@pytest.mark.parametrize("variant", ["v3", "no-q-lora-plain-rope"])
def test_attention_output_matches_transformers_deepseek_v3(kernel: str, variant: str) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    extra = {} if variant == "v3" else {"q_lora_rank": None, "rope_interleave": False, "v_head_dim": 24}
    fields = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4,
    )  # fmt: skip
    config = transformers.DeepseekV3Config(**(fields | extra))
    config._attn_implementation = "eager"
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    attn = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    for param in attn.parameters():  # norms too: random, not ones
        torch.nn.init.normal_(param, std=0.2)
    b, t = 2, 11
    x = torch.randn(b, t, config.hidden_size)
    pos = torch.arange(t)[None].expand(b, t)
    cos, sin = hf.DeepseekV3RotaryEmbedding(config)(x, pos)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
    with torch.no_grad():
        want, _ = attn(x, (cos, sin), causal)  # [B, T, hidden]

        # the same projections, then the latent path: absorbed query, latent cache, W_UV on the output
        h, nope, rank = config.num_attention_heads, config.qk_nope_head_dim, config.kv_lora_rank
        if config.q_lora_rank is None:
            q = attn.q_proj(x)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(b, t, h, -1).transpose(1, 2)  # [B, H, T, nope + rope]
        ckv = attn.kv_a_proj_with_mqa(x)
        c = attn.kv_a_layernorm(ckv[..., :rank])  # [B, T, rank]
        rope = hf.apply_rotary_pos_emb_interleave if config.rope_interleave else hf.apply_rotary_pos_emb
        q_pe, k_pe = rope(q[..., nope:], ckv[:, None, :, rank:], cos, sin)  # [B, H, T, r], [B, 1, T, r]
        w_uk, w_uv = split_kv_b(
            attn.kv_b_proj.weight, num_heads=h, qk_nope_head_dim=nope, v_head_dim=config.v_head_dim
        )
        q_lat = latent_query(q[..., :nope].transpose(1, 2), q_pe.transpose(1, 2), w_uk)  # [B, T, H, rank + r]
        rows = torch.cat([c, k_pe[:, 0]], dim=-1)[:, :, None]  # [B, T, 1, rank + rope]

        shape = ModelShape.from_hf_config(config.to_dict(), name="tiny-deepseek-v3")
        backend = MLABackend()
        cache = backend.create_cache(
            Workload(shape, (0,) * b, torch.float32), config={"kernel": kernel}, num_layers=1, max_seq_len=t
        )
        prompt = 4
        plan = backend.plan(cache, num_new=[prompt] * b)
        backend.append(cache, plan, layer=0, k=rows[:, :prompt], v=rows[:, :prompt, :, :rank])
        cache.commit(plan)
        for i in range(prompt, t):
            plan = backend.plan(cache, num_new=[1] * b)
            out_lat = backend.decode(
                cache, plan, layer=0, q=q_lat[:, i], k=rows[:, i], v=rows[:, i, :, :rank]
            )
            cache.commit(plan)
            got = attn.o_proj(expand_output(out_lat, w_uv).reshape(b, -1))
            torch.testing.assert_close(got, want[:, i], rtol=1e-5, atol=1e-5)
    assert attn.scaling == pytest.approx(shape.geometry("latent").scale)


# -- ahead-of-time compilation for NVIDIA targets ------------------------------------------------------
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # opt-in shared memory per block
ARCHS = (80, 90)
FP32_TILE = max(TILES, key=lambda n: TILES[n].block_h * TILES[n].block_n)  # the widest tile


def _latent(tile: str, dtype: torch.dtype, page: int) -> dict[str, Any]:
    spec = decode_spec(tile, dtype, heads=128, dk=576, dv=512, page_size=page)  # DeepSeek-V3
    return specialization(spec, dtype)


@pytest.fixture(scope="module")
def aot_results() -> dict[tuple, Any]:
    """The family kernel in its latent form, compiled in one batch (one child process when interpreted)."""
    jobs = {(t, "bfloat16", a): _latent(t, torch.bfloat16, 64) for t in TILES for a in ARCHS}
    jobs[(FP32_TILE, "float32", 80)] = _latent(FP32_TILE, torch.float32, 64)
    # the extremes of the other constexprs, in fp16: pages of 16 / 128
    jobs[("h16_n32_w4", "float16", 90, 1, 16)] = _latent("h16_n32_w4", torch.float16, 16)
    jobs[("h16_n32_w4", "float16", 90, 32, 128)] = _latent("h16_n32_w4", torch.float16, 128)
    results = aot_compile_many([{**spec, "arch": key[2]} for key, spec in jobs.items()])
    return dict(zip(jobs, results, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tile", list(TILES))
def test_kernels_compile_ahead_of_time(aot_results: dict, tile: str, arch: int) -> None:
    """Every declared tile, DeepSeek-V3 dims, bf16: compiles, fits shared memory, no spills, 16-byte loads."""
    r = aot_results[(tile, "bfloat16", arch)]
    if isinstance(r, Exception):
        raise r
    assert ".entry" in r.ptx and r.cubin
    assert r.shared_bytes is not None and r.shared_bytes <= SHARED_LIMIT[arch], r.summary()
    if r.sass is not None:
        assert r.local_bytes == 0 and not r.sass_count("STL"), f"register spills: {r.summary()}"
        assert r.global_loads().get("LDG.E.128", 0) + r.global_loads().get("LDGSTS.E.BYPASS.128", 0) > 0


@pytest.mark.parametrize(("splits", "page"), [(1, 16), (32, 128)])
def test_split_and_page_extremes_compile(aot_results: dict, splits: int, page: int) -> None:
    r = aot_results[("h16_n32_w4", "float16", 90, splits, page)]
    assert not isinstance(r, Exception), r


def test_fp32_kernel_fits_shared_memory(aot_results: dict) -> None:
    """float32 rows are twice as wide: the capped widest tile must still fit sm_80's shared memory."""
    assert effective_tile(FP32_TILE, torch.float32).block_n == 32
    r = aot_results[(FP32_TILE, "float32", 80)]
    assert not isinstance(r, Exception), r
    assert r.shared_bytes is not None and r.shared_bytes <= SHARED_LIMIT[80], r.summary()


# -- cache, bytes, roofline, errors ------------------------------------------------------------------
def test_latent_cache_bytes_deepseek_v3() -> None:
    shape = load_shape("deepseek-v3")
    w = Workload(shape, (0,), torch.bfloat16)
    backend = MLABackend()
    cache = backend.create_cache(w, config={"kernel": "torch"}, num_layers=shape.num_layers, max_seq_len=64)
    assert cache.bytes_per_token() == shape.kv_bytes_per_token("bf16") == 70_272  # 61 × 576 × 2
    assert cache.k_pages.shape[-2:] == (1, 576) and cache.v_pages.data_ptr() == cache.k_pages.data_ptr()
    expanded = NaiveBackend().create_cache(w, config={}, num_layers=shape.num_layers, max_seq_len=1)
    assert expanded.bytes_per_token() == shape.kv_bytes_per_token("bf16", "expanded") == 61 * 128 * 320 * 2


def test_roofline_says_which_bound_applies() -> None:
    w = Workload.uniform("deepseek-v3", batch=8, context="8k")
    lat = decode_cost(w, form="latent")
    assert lat.kv_bytes == w.kv_bytes_per_step("latent") == 70_272 * 8 * (8192 + 1)
    assert lat.flops == 2 * 128 * (576 + 512) * 8 * (8192 + 1) * 61
    exp = decode_cost(w, form="expanded")
    assert exp.kv_bytes == w.kv_bytes_per_step("expanded") and exp.flops < lat.flops
    # absorbed MLA: ~240 FLOP/B, past an A100's ridge (312e12 / 2.039e12 ≈ 153), short of an H100's (≈ 295)
    assert 200 < lat.intensity < 250 and exp.intensity < 2
    assert decode_roofline(w, bandwidth=2.039e12, peak_flops=312e12).bound == "compute"
    assert decode_roofline(w, bandwidth=3.35e12, peak_flops=989.5e12).bound == "memory"
    assert decode_roofline(w, bandwidth=2.039e12, peak_flops=312e12, form="expanded").bound == "memory"
    r = decode_roofline(w, bandwidth=4.8e12, peak_flops=989.5e12)
    assert r.floor_s == max(r.memory_s, r.compute_s) and r.as_dict()["bound"] == r.bound
    # counting the absorption matmuls (weights shared by the batch), an H200 (ridge ≈ 206 FLOP/B)
    # turns compute-bound as the batch grows
    h200 = {"bandwidth": 4.8e12, "peak_flops": 989.5e12, "projections": True}
    small = decode_roofline(Workload.uniform("deepseek-v3", batch=1, context="8k"), **h200)
    big = decode_roofline(Workload.uniform("deepseek-v3", batch=256, context="8k"), **h200)
    assert small.bound == "memory" and big.bound == "compute" and small.intensity < 60 < 200 < big.intensity
    with pytest.raises(ValueError, match="must both be > 0"):
        decode_roofline(w, bandwidth=0, peak_flops=1.0)


def test_refusals_and_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = MLABackend()
    gqa = Workload.uniform("tiny-gqa", batch=1, context=8)
    assert any("not MLA" in r for r in backend.supports(gqa))
    with pytest.raises(ValueError, match="not MLA"):
        backend.create_cache(gqa, config={}, num_layers=1, max_seq_len=16)
    with pytest.raises(ConfigError, match=r"page_size = 48 not in"):
        backend.resolve_config({"page_size": 48})
    # 64 tokens: at 8 the gate's fp32 bound (×2 a calibration error of ~1e-7, 512 outputs) refused the
    # exact torch path in 9 of 200 seeds (its error 2.5-5× the calibration's, a few ulps); from 64 on,
    # its error equals the calibration's (0 of 140 seeds refused at 64 and 1k)
    mla = Workload.uniform("tiny-mla", batch=1, context=64, dtype="fp32")
    import attnbench.backends.mla as mla_module

    why = "Triton kernels run on the CPU only in the interpreter: set TRITON_INTERPRET=1"
    monkeypatch.setattr(mla_module, "triton_mode", lambda device: (None, why))  # as without the interpreter
    assert backend.implementation(mla).startswith("torch") and not backend.interpreted(mla)
    assert [t.name for t in backend.tunables_for(mla)] == ["page_size"]
    with pytest.raises(ValueError, match="kernel = 'triton' cannot run on cpu: .*TRITON_INTERPRET=1"):
        backend.create_cache(mla, config={"kernel": "triton"}, num_layers=1, max_seq_len=16)
    assert check(backend, mla).passed  # the torch path still runs


def test_declared_tolerance() -> None:
    from attnbench.core.backend import DEFAULT_TOLERANCES

    backend = MLABackend()
    assert backend.tolerance(torch.float32) == DEFAULT_TOLERANCES[torch.float32]
    # the default bf16 max_abs (4e-2) covers the worst seen on 576-wide latent rows (0.025)
    assert backend.tolerance(torch.bfloat16) == DEFAULT_TOLERANCES[torch.bfloat16]
    assert DEFAULT_TOLERANCES[torch.bfloat16].max_abs >= 0.025


def test_interpreted_is_reported_and_splits_are_powers_of_two() -> None:
    w = Workload.uniform("tiny-mla", batch=2, context=8)
    backend = MLABackend()
    assert backend.interpreted(w) and "interpreted" in backend.implementation(w)
    kw = {"block_n": 32, "programs": 264, "max_splits": 32}
    assert auto_splits(programs_per_split=8, max_len=8192, **kw) == 32
    assert auto_splits(programs_per_split=64 * 8, max_len=8192, **kw) == 1
    assert auto_splits(programs_per_split=8, max_len=300, **kw) == 4  # ≥ 2 tiles of 32 per split
    for b in (1, 3, 7):
        n = auto_splits(programs_per_split=b, max_len=10**6, block_n=16, programs=216, max_splits=32)
        assert n & (n - 1) == 0 and 1 <= n <= 32
    assert math.isclose(w.geometry("latent").scale, 1 / math.sqrt(24))
