"""``triton_paged`` — Triton decode attention over a paged KV cache, with split-KV (flash-decoding).

The cache is an :class:`attnbench.paged.PagedKVCache` (``k_pages: [L, P, page_size, Hkv, D]``, a block
table per sequence, pages handed out in a random order). One decode call per layer:

1. ``cache.write``: the new token's K/V go to their slots (one ``index_copy_`` each);
2. ``_paged_decode_kernel``, grid ``(B, Hkv, num_splits)``: each program takes one KV head of one
   sequence and one contiguous share of its tokens, loads each ``[block_n, D]`` K/V tile *once* for
   all ``G = Hq / Hkv`` query heads of the group (``q: [G→16, D] @ kᵀ`` with ``tl.dot``), and runs
   an online softmax over the tiles (exp2, float32 statistics). Tokens past the sequence's length
   (the partial last page) are masked. With one split it normalises and writes the output;
3. with several splits, ``_split_reduce_kernel``, grid ``(B, Hq)``, merges the partial results
   (unnormalised ``o``, running max ``m`` and sum ``l`` per split) with the log-sum-exp rule.

``plan()`` (host, once per step) reserves pages, builds the slot mapping, picks the split count and
allocates the partial buffers; ``decode()`` does no host-device sync and no host planning, so a step
can be captured in a CUDA graph. Prefill uses the base class: write the pages, then torch attention
over the given K/V.

Runs natively on CUDA; on the CPU only in the Triton interpreter (``TRITON_INTERPRET=1``), where it is
checked for correctness and never timed. Every kernel specialisation below is also compiled ahead of
time for sm_80 and sm_90 in the tests (``aot_specializations``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from attnbench.backend import Backend, KVCache, StepPlan, Tunable
from attnbench.paged import PagedKVCache, PagedStepPlan, cdiv
from attnbench.triton_utils import kernel_for, triton_mode
from attnbench.workload import Workload

# -- the search space, as data ------------------------------------------------------------------------
PAGE_SIZES = (16, 32, 64, 128, 256)
NUM_SPLITS = (0, 1, 2, 4, 8, 16)  # 0: chosen per step from batch × KV heads vs the device's SMs
BLOCK_N = (16, 32, 64)  # tokens per K/V tile
NUM_WARPS = {16: 4, 32: 4, 64: 4}  # by block_n
NUM_STAGES = 2
MAX_SPLITS = max(NUM_SPLITS)
MAX_HEAD_DIM = 256
MAX_GROUP = 64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, Dk]
    k_ptr,  # [P, PAGE_SIZE, Hkv, Dk]: one layer's pages
    v_ptr,  # [P, PAGE_SIZE, Hkv, Dv]
    block_table_ptr,  # [B, max_pages] int32
    lens_ptr,  # [B] int32: tokens to attend to (the new one included)
    out_ptr,  # [B, Hq, Dv]: written when direct
    part_o_ptr,  # [B, Hq, S, Dv] float32, unnormalised: written when not direct
    part_m_ptr,  # [B, Hq, S] float32: running max (log2 domain)
    part_l_ptr,  # [B, Hq, S] float32: running sum of exp2
    scale_log2e,  # softmax scale × log2(e)
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    direct,  # 1: one split, normalise and write out_ptr; 0: write the partial buffers
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two ≥ 16 (tl.dot's minimum)
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32)
    DOT_F32: tl.constexpr,  # interpreter with bf16: run the dots on fp32 copies of the bf16 values
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & (offs_dk[None, :] < DK), other=0.0)  # [BLOCK_G, BLOCK_DK]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    table = block_table_ptr + b * stride_bt
    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        valid = tokens < end
        if PAGE_SIZE >= BLOCK_N:  # the tile lies in one page: one page id, contiguous rows
            page = tl.load(table + tile // PAGE_SIZE).to(tl.int64)
            k_rows = page * stride_kp + (tile % PAGE_SIZE + offs_n) * stride_kt
            v_rows = page * stride_vp + (tile % PAGE_SIZE + offs_n) * stride_vt
        else:  # the tile spans pages: one page id per token
            pages = tl.load(table + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            k_rows = pages * stride_kp + (tokens % PAGE_SIZE) * stride_kt
            v_rows = pages * stride_vp + (tokens % PAGE_SIZE) * stride_vt
        k_ptrs = k_ptr + kv_head * stride_kh + k_rows[:, None] + offs_dk[None, :]
        v_ptrs = v_ptr + kv_head * stride_vh + v_rows[:, None] + offs_dv[None, :]
        if BLOCK_DK == DK:
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)  # [BLOCK_N, BLOCK_DK]
        else:
            k = tl.load(k_ptrs, mask=valid[:, None] & (offs_dk[None, :] < DK), other=0.0)
        if BLOCK_DV == DV:
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)  # [BLOCK_N, BLOCK_DV]
        else:
            v = tl.load(v_ptrs, mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)

        if (
            DOT_F32
        ):  # the interpreter's tl.dot multiplies bf16 bit patterns: compute it in fp32 (exact products)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        s = s * scale_log2e
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    dv_mask = g_mask[:, None] & (offs_dv[None, :] < DV)
    if direct:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv_mask)
    else:
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_G] into [B*Hq*S]
        tl.store(part_o_ptr + row[:, None] * DV + offs_dv[None, :], acc, mask=dv_mask)
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)


@triton.jit
def _split_reduce_kernel(
    part_o_ptr,  # [B, Hq, S, Dv] float32
    part_m_ptr,  # [B, Hq, S]
    part_l_ptr,  # [B, Hq, S]
    out_ptr,  # [B, Hq, Dv]
    num_splits,
    stride_ob,
    stride_oh,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < num_splits
    rows = (b * tl.num_programs(1) + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + rows, mask=s_mask, other=float("-inf"))  # empty splits hold -inf too
    l_s = tl.load(part_l_ptr + rows, mask=s_mask, other=0.0)
    w = tl.math.exp2(m - tl.max(m, 0))  # [BLOCK_S]; 0 for empty splits
    o = tl.load(
        part_o_ptr + rows[:, None] * DV + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < DV),
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.sum(w * l_s, 0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < DV,
    )


def _device_programs(device: torch.device) -> int:
    """Programs that keep the device busy: 2 per SM on CUDA; a nominal 8 elsewhere (interpreter)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def auto_splits(*, batch: int, kv_heads: int, max_len: int, block_n: int, programs: int) -> int:
    """Split count for ``num_splits = 0``: enough programs to fill the device, ≥ 2 tiles per split."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and batch * kv_heads * splits < programs
        and cdiv(max_len, 2 * splits) >= 2 * block_n
    ):
        splits *= 2
    return splits


class TritonPagedBackend(Backend):
    name = "triton_paged"
    description = "Triton paged-KV decode: GQA-grouped tiles, online softmax, split-KV with a reduction"
    tunables = (
        Tunable("page_size", PAGE_SIZES, 16, "tokens per KV page"),
        Tunable("num_splits", NUM_SPLITS, 0, "split-KV programs per sequence and KV head; 0 = auto"),
        Tunable("block_n", BLOCK_N, 32, "tokens per K/V tile loaded by one program"),
    )
    #: order in which pages are handed out; "random" models a long-running server and catches kernels
    #: that assume a sequence's pages are contiguous
    page_order = "random"

    # -- availability ----------------------------------------------------------------------------
    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """6 in bf16, else the default 2: the kernel rounds P to the cache dtype for the tensor-core
        P·V dot (as FlashAttention does), which in bf16 costs up to ~4× the calibration reference's
        error on needle probes, where a few probabilities near 0.3 carry the output."""
        return 6.0 if dtype == torch.bfloat16 else super().error_multiple(dtype)

    def supports(self, workload: Workload) -> list[str]:
        reasons = []
        mode, why = triton_mode(workload.device)
        if mode is None:
            reasons.append(why)
        if workload.dtype not in DTYPES:
            reasons.append(f"dtype {workload.dtype_name} not in (fp32, fp16, bf16)")
        g = workload.geometry(self.kv_form)
        if max(g.qk_head_dim, g.v_head_dim) > MAX_HEAD_DIM:
            reasons.append(f"head_dim {max(g.qk_head_dim, g.v_head_dim)} > {MAX_HEAD_DIM}")
        if g.group_size > MAX_GROUP:
            reasons.append(f"query heads per KV head {g.group_size} > {MAX_GROUP}")
        return reasons

    def interpreted(self, workload: Workload) -> bool:
        return triton_mode(workload.device)[0] == "interpreted"

    def implementation(self, workload: Workload) -> str:
        mode, why = triton_mode(workload.device)
        return f"triton[{mode}]" if mode else f"unavailable: {why}"

    # -- cache and plan --------------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> PagedKVCache:
        reasons = self.supports(workload)
        if reasons:
            raise ValueError(f"backend {self.name!r} cannot run {workload.describe()}: {'; '.join(reasons)}")
        cfg = self.resolve_config(config)
        return PagedKVCache(
            workload=workload,
            geometry=workload.geometry(self.kv_form),
            config=cfg,
            num_layers=num_layers,
            max_seq_len=max_seq_len,
            page_size=cfg["page_size"],
            page_order=self.page_order,
        )

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> StepPlan:
        assert isinstance(cache, PagedKVCache)
        plan = cache.plan_step(num_new)
        cfg, g = cache.config, cache.geometry
        splits = cfg["num_splits"] or auto_splits(
            batch=cache.batch,
            kv_heads=g.num_kv_heads,
            max_len=max(plan.seq_lens_after),
            block_n=cfg["block_n"],
            programs=_device_programs(cache.device),
        )
        b, hq = cache.batch, g.num_q_heads
        plan.extra["num_splits"] = splits
        if splits > 1:  # shared by every layer of the step (layers run one after another)
            f32 = {"dtype": torch.float32, "device": cache.device}
            plan.extra["part_o"] = torch.empty(b, hq, splits, g.v_head_dim, **f32)
            plan.extra["part_m"] = torch.empty(b, hq, splits, **f32)
            plan.extra["part_l"] = torch.empty(b, hq, splits, **f32)
        plan.extra["mode"] = triton_mode(cache.device)[0]
        return plan

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(cache, PagedKVCache)
        cache.write(plan, layer=layer, k=k, v=v)

    # -- the step --------------------------------------------------------------------------------
    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, Dk]``, new ``k [B, Hkv, Dk]``/``v [B, Hkv, Dv]`` → ``[B, Hq, Dv]``. Capturable."""
        assert isinstance(cache, PagedKVCache) and isinstance(plan, PagedStepPlan)
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None])
        g, cfg = cache.geometry, cache.config
        if q.stride(-1) != 1:
            q = q.contiguous()
        b = q.shape[0]
        out = torch.empty(b, g.num_q_heads, g.v_head_dim, dtype=q.dtype, device=q.device)
        splits = plan.extra["num_splits"]
        direct = splits == 1
        part_o = out if direct else plan.extra["part_o"]
        part_m = out if direct else plan.extra["part_m"]
        part_l = out if direct else plan.extra["part_l"]
        kp, vp = cache.k_pages[layer], cache.v_pages[layer]
        mode = plan.extra["mode"]
        kernel = kernel_for(_paged_decode_kernel, mode)
        constexprs = decode_constexprs(
            g.group_size, g.qk_head_dim, g.v_head_dim, cfg, q.dtype, interpreted=mode == "interpreted"
        )
        kernel[(b, g.num_kv_heads, splits)](
            q, kp, vp, plan.block_table, plan.device_lens, out, part_o, part_m, part_l,
            g.scale * math.log2(math.e),
            q.stride(0), q.stride(1),
            kp.stride(0), kp.stride(1), kp.stride(2),
            vp.stride(0), vp.stride(1), vp.stride(2),
            plan.block_table.stride(0),
            out.stride(0), out.stride(1),
            int(direct),
            **constexprs,
            num_warps=NUM_WARPS[cfg["block_n"]],
            num_stages=NUM_STAGES,
        )  # fmt: skip
        if not direct:
            kernel_for(_split_reduce_kernel, mode)[(b, g.num_q_heads)](
                part_o, part_m, part_l, out, splits, out.stride(0), out.stride(1),
                **reduce_constexprs(g.v_head_dim),
                num_warps=4,
            )  # fmt: skip
        return out


def decode_constexprs(
    group: int, dk: int, dv: int, config: Mapping[str, Any], dtype: torch.dtype, *, interpreted: bool = False
) -> dict[str, Any]:
    """Compile-time parameters of :func:`_paged_decode_kernel` for a geometry, config and dtype."""
    return {
        "GROUP": group,
        "BLOCK_G": _pow2(group),
        "DK": dk,
        "DV": dv,
        "BLOCK_DK": _pow2(dk),
        "BLOCK_DV": _pow2(dv),
        "PAGE_SIZE": config["page_size"],
        "BLOCK_N": config["block_n"],
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_F32": interpreted and dtype == torch.bfloat16,
    }


def reduce_constexprs(dv: int) -> dict[str, Any]:
    """Compile-time parameters of :func:`_split_reduce_kernel` (one specialisation for every split count)."""
    return {"DV": dv, "BLOCK_DV": _pow2(dv), "BLOCK_S": MAX_SPLITS}


# -- ahead-of-time compilation: every specialisation this backend can launch --------------------------
_DECODE_ARGS = (
    ("q_ptr", "*{t}"), ("k_ptr", "*{t}"), ("v_ptr", "*{t}"), ("block_table_ptr", "*i32"), ("lens_ptr", "*i32"),
    ("out_ptr", "*{t}"), ("part_o_ptr", "*fp32"), ("part_m_ptr", "*fp32"), ("part_l_ptr", "*fp32"),
    ("scale_log2e", "fp32"),
    *((s, "i32") for s in (
        "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh",
        "stride_bt", "stride_ob", "stride_oh", "direct",
    )),
)  # fmt: skip
#: arguments the JIT sees as multiples of 16 for head_dim 128 (torch pointers are 16-byte aligned)
_ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_o_ptr", "stride_qb", "stride_qh", "stride_kp",
            "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh", "stride_ob", "stride_oh")  # fmt: skip


#: geometries compiled besides Llama-3.1-8B's (bf16, 4 query heads per KV head, head_dim 128), at the
#: default tile config: fp32 and fp16; head_dim 64 with 8 per KV head; MLA's expanded form
#: (DeepSeek-V3: Dk 192 ≠ Dv 128, one per KV head); 16 per KV head (Llama-3.1-405B); the largest allowed
AOT_GEOMETRIES: tuple[tuple[torch.dtype, int, int, int], ...] = (
    (torch.float32, 4, 128, 128),
    (torch.float16, 4, 128, 128),
    (torch.bfloat16, 8, 64, 64),
    (torch.bfloat16, 1, 192, 128),
    (torch.bfloat16, 16, 128, 128),
    (torch.bfloat16, MAX_GROUP, MAX_HEAD_DIM, MAX_HEAD_DIM),
)


def _decode_spec(
    dtype: torch.dtype, group: int, dk: int, dv: int, page_size: int, block_n: int
) -> dict[str, Any]:
    constexprs = decode_constexprs(group, dk, dv, {"page_size": page_size, "block_n": block_n}, dtype)
    t = _TL_DTYPE[dtype]
    sig = {name: kind.format(t=t) for name, kind in _DECODE_ARGS} | dict.fromkeys(constexprs, "constexpr")
    return {
        "kernel": _paged_decode_kernel,
        "signature": sig,
        "constexprs": constexprs,
        "num_warps": NUM_WARPS[block_n],
        "num_stages": NUM_STAGES,
        "aligned": _ALIGNED,
    }


def aot_specializations() -> Iterator[dict[str, Any]]:
    """Keyword arguments for :func:`attnbench.triton_utils.aot_compile`, one per kernel specialisation:
    the decode kernel for every ``page_size × block_n`` the tunables declare (``num_splits`` is a grid
    dimension, not a specialisation) at Llama-3.1-8B's geometry in bf16, the default tile config at each
    of :data:`AOT_GEOMETRIES`, and the split reduction."""
    for page_size in PAGE_SIZES:
        for block_n in BLOCK_N:
            yield _decode_spec(torch.bfloat16, 4, 128, 128, page_size, block_n)
    default = TritonPagedBackend.default_config()
    for dtype, group, dk, dv in AOT_GEOMETRIES:
        yield _decode_spec(dtype, group, dk, dv, default["page_size"], default["block_n"])
    constexprs = reduce_constexprs(128)
    sig = {
        "part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*bf16",
        "num_splits": "i32", "stride_ob": "i32", "stride_oh": "i32",
    } | dict.fromkeys(constexprs, "constexpr")  # fmt: skip
    yield {
        "kernel": _split_reduce_kernel,
        "signature": sig,
        "constexprs": constexprs,
        "num_warps": 4,
        "num_stages": NUM_STAGES,
        "aligned": ("part_o_ptr", "out_ptr", "stride_ob", "stride_oh"),
    }
