"""The split-KV Triton decode kernel family shared by ``triton_paged``, ``fp8`` and ``mla``.

One tile loop (:func:`split_kv_decode_kernel`, the flash-decoding online-softmax update) reads K/V
through a block table; constexprs choose the variant, so a fix is made once:

- ``KV_FP8``: the pages hold float8 e4m3 *bytes* (read as ``uint8``) with float32 scales per token
  and KV head (or one static scale: zero strides). Bytes become fp16 by integer ops
  (``s eeee mmm`` → ``s 0eeee mmm0000000`` is the value / 256, exactly; sm_80 has no fp8 type) and
  the scales (× 256, folded into ``scale_log2e`` and the probabilities) multiply the scores and the
  probabilities, so a tile is never rescaled element by element;
- ``LATENT``: the MLA absorbed form. One KV head whose row is ``[c | k_pe]`` (``DV + DPE`` wide); the
  value is ``c``, loaded once and used by both dots (``q_c·cᵀ + q_pe·k_peᵀ``);
- ``PAGE_SIZE`` and ``BLOCK_N`` (tile): when a tile lies in one page (``PAGE_SIZE ≥ BLOCK_N``) one
  page id is read per tile and the rows are contiguous, else one page id per token. fp8's 64-token
  tiles read one page id per token whatever the page size: the compiled kernel then needs 168/174
  registers on sm_80/sm_90 instead of 188/188 (``docs/fp8.md``); so do the latent tiles of 32 heads
  (``h32_n32_w8``: 176/140 instead of 172/163; ``docs/mla.md``);
- ``BLOCK_G``: query heads per program (``GROUP`` of them share one KV head; ``tl.dot`` needs ≥ 16);
- ``direct`` (a run-time flag, fixed per launch): one split, normalise and write the output; else
  write one partial per split. The latent form always writes partials (the merge follows, as in the
  MLA-only kernel this family replaced): its bf16 output store from the ``[BLOCK_G, 512]``
  accumulator costs 40–64 registers per thread on both architectures (241 → 191 on sm_80 for
  ``h32_n64_w8``, 191 → 127 for ``h16_n32_w4``; ``docs/mla.md``), and it normalises its 512-wide
  rows by one reciprocal per head rather than a division per value. Its one KV head is known at
  compile time (axis 1 of the grid is the head block alone).

Grid ``(B, Hkv · cdiv(GROUP, BLOCK_G), num_splits)``. The partial format is one: the normalised
partial output ``o [B, Hq, S, Dv]`` (float32) and its log-sum-exp in base 2 ``lse [B, Hq, S]``
(``-inf`` for an empty split); :func:`split_merge_kernel` merges them (FlashInfer's and vLLM's
``merge_attn_states`` format). ``S`` is the buffer's split capacity; the grid's split count may be
smaller. Lengths are read from a device tensor, so a launch with a fixed grid replays in a CUDA
graph at any length up to the one its split count was chosen for (:func:`auto_splits`).

:func:`launch_decode` runs both kernels for one layer; :mod:`attnbench.correctness.aot` lists the
specialisations compiled ahead of time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from attnbench.kernels.triton_utils import TritonMode, kernel_for

__all__ = [
    "MAX_SPLITS",
    "MERGE_WARPS",
    "DecodeSpec",
    "auto_splits",
    "context_bucket",
    "decode_constexprs",
    "device_programs",
    "launch_decode",
    "merge_constexprs",
    "pow2",
    "split_kv_decode_kernel",
    "split_merge_kernel",
]

#: the most splits any backend of the family declares (the partial buffers' capacity)
MAX_SPLITS = 32
LOG2E = math.log2(math.e)


def pow2(n: int, floor: int = 16) -> int:
    """``n`` rounded up to a power of two, at least ``floor`` (``tl.dot``'s minimum dimension)."""
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _load_rows(rows, offs, valid, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` elements ``rows[:, None] + offs[None, :]`` of the valid rows (0 elsewhere)."""
    if BLOCK_D == D:  # row mask only: lets the compiler use 16-byte loads along D
        return tl.load(rows[:, None] + offs[None, :], mask=valid[:, None], other=0.0)
    return tl.load(rows[:, None] + offs[None, :], mask=valid[:, None] & (offs[None, :] < D), other=0.0)


@triton.jit
def _store_partial(
    part_o_ptr,
    part_lse_ptr,
    row,
    out,
    m_i,
    l_i,
    offs_dv,
    dv_mask,
    g_mask,
    DV: tl.constexpr,
    NORMALISE: tl.constexpr,
):
    """One split's partial: the normalised output rows and their log2-sum-exp2 (``-inf``: empty).
    ``NORMALISE``: ``out`` is the accumulator, normalised here by the reciprocal of ``l_i``."""
    nonempty = l_i > 0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    if NORMALISE:
        out = out * (1.0 / tl.where(nonempty, l_i, 1.0))[:, None]
    tl.store(part_o_ptr + row[:, None] * DV + offs_dv[None, :], out, mask=dv_mask)
    tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def split_kv_decode_kernel(
    q_ptr,  # [B, Hq, Dk] compute dtype (latent: Dk = DV + DPE)
    k_ptr,  # [P, PAGE_SIZE, Hkv, Dk]: one layer's pages (uint8 when KV_FP8; latent: the [c | k_pe] rows)
    v_ptr,  # [P, PAGE_SIZE, Hkv, Dv] (latent: unused, V is the first DV columns of K)
    ks_ptr,  # KV_FP8: [P, PAGE_SIZE, Hkv] float32 scales, or [1] with zero strides (static scale)
    vs_ptr,
    block_table_ptr,  # [B, max_pages] int32
    lens_ptr,  # [B] int32: tokens to attend to (the new one included)
    out_ptr,  # [B, Hq, Dv]: written when direct
    part_o_ptr,  # [B, Hq, S_cap, Dv] float32, normalised per split: written when not direct
    part_lse_ptr,  # [B, Hq, S_cap] float32: log2-sum-exp2 of each split's scores (-inf: empty)
    scale_log2e,  # softmax scale × log2(e) (× 256 when KV_FP8: the byte trick's bias)
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_sp,  # KV_FP8 scale strides (0, 0, 0 for a static per-tensor scale)
    stride_st,
    stride_sh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_lb,  # part_lse strides (the split stride is 1; part_o's row is the lse index × DV)
    stride_lh,
    direct,  # 1: one split, normalise and write out_ptr; 0: write this split's partial (a run-time
    # flag: as a constexpr the split epilogue costs up to 3× the registers on sm_90, fp32)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # query heads per program: a power of two ≥ 16
    DK: tl.constexpr,  # expanded: K width; latent: unused (DV + DPE)
    DV: tl.constexpr,
    DPE: tl.constexpr,  # latent: rope width of a row (0 when expanded)
    BLOCK_DK: tl.constexpr,  # expanded: DK padded; latent: DPE padded
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per K/V tile
    KV_FP8: tl.constexpr,
    LATENT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32)
    DOT_F32: tl.constexpr,  # interpreter with bf16: run the dots on fp32 copies (exact products)
):
    HEAD_BLOCKS: tl.constexpr = (GROUP + BLOCK_G - 1) // BLOCK_G
    b = tl.program_id(0)
    if LATENT:  # one KV head (the latent rows): the programs along axis 1 are head blocks
        kv_head = 0
        g_idx = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    else:
        kv_head = tl.program_id(1) // HEAD_BLOCKS
        g_idx = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_G + tl.arange(0, BLOCK_G)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g_idx
    g_mask = g_idx < GROUP
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if LATENT:  # q = [q_c | q_pe]
        q = tl.load(q_rows + offs_dv[None, :], mask=g_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
        q_pe = tl.load(
            q_rows + DV + offs_dk[None, :], mask=g_mask[:, None] & (offs_dk[None, :] < DPE), other=0.0
        )
    else:
        q = tl.load(q_rows + offs_dk[None, :], mask=g_mask[:, None] & (offs_dk[None, :] < DK), other=0.0)
    if KV_FP8:  # float32 operands: exact for q and for K/V (4 significant bits)
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    table = block_table_ptr + b * stride_bt
    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        valid = tokens < end
        if PAGE_SIZE >= BLOCK_N and not (KV_FP8 and BLOCK_N >= 64) and not (LATENT and BLOCK_G >= 32):
            # one page id per tile
            pages = tl.load(table + tile // PAGE_SIZE).to(tl.int64)  # a scalar
            rows = tile % PAGE_SIZE + offs_n
        else:  # one page id per token (the tile spans pages; fp8's 64-token and 32-head latent tiles)
            pages = tl.load(table + tokens // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            rows = tokens % PAGE_SIZE
        k_rows = k_ptr + kv_head * stride_kh + pages * stride_kp + rows * stride_kt
        if LATENT:  # c [BLOCK_N, BLOCK_DV] is both the key's first DV columns and the value
            k = _load_rows(k_rows, offs_dv, valid, D=DV, BLOCK_D=BLOCK_DV)
            k_pe = _load_rows(k_rows + DV, offs_dk, valid, D=DPE, BLOCK_D=BLOCK_DK)
            v = k
        else:
            v_rows = v_ptr + kv_head * stride_vh + pages * stride_vp + rows * stride_vt
            k = _load_rows(k_rows, offs_dk, valid, D=DK, BLOCK_D=BLOCK_DK)
            v = _load_rows(v_rows, offs_dv, valid, D=DV, BLOCK_D=BLOCK_DV)
        if KV_FP8:  # e4m3 byte s.eeee.mmm -> fp16 bits s.0eeee.mmm0000000 == value / 256
            kb = k.to(tl.uint16)
            vb = v.to(tl.uint16)
            k = (((kb & 0x7F) << 7) | ((kb & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
            v = (((vb & 0x7F) << 7) | ((vb & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)

        if DOT_F32:  # the interpreter's tl.dot multiplies bf16 bit patterns: compute it in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            if LATENT:
                s += tl.dot(q_pe.to(tl.float32), tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
            if LATENT:
                s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        if KV_FP8:
            s_off = pages * stride_sp + rows * stride_st + kv_head * stride_sh
            k_scale = tl.load(ks_ptr + s_off, mask=valid, other=0.0)  # [BLOCK_N]
            v_scale = tl.load(vs_ptr + s_off, mask=valid, other=0.0)
            s = s * (k_scale * scale_log2e)[None, :]
        else:
            s = s * scale_log2e
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:  # TF32 dots round only the probabilities, to 10 bits
            pv = tl.dot(p * (v_scale * 256.0)[None, :], v, input_precision=DOT_PRECISION)
        elif DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:  # P rounded to the cache dtype for the tensor-core dot, as FlashAttention does
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    dv_mask = g_mask[:, None] & (offs_dv[None, :] < DV)
    row = b * stride_lb + heads * stride_lh + split  # [BLOCK_G] into the partials
    if LATENT:  # always the partials, even for one split: see the module doc
        _store_partial(
            part_o_ptr, part_lse_ptr, row, acc, m_i, l_i, offs_dv, dv_mask, g_mask, DV=DV, NORMALISE=True
        )
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if direct:
            o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv_mask)
        else:
            _store_partial(
                part_o_ptr, part_lse_ptr, row, out, m_i, l_i, offs_dv, dv_mask, g_mask, DV=DV, NORMALISE=False
            )


@triton.jit
def split_merge_kernel(
    part_o_ptr,  # [B, Hq, S_cap, Dv] float32, normalised per split
    part_lse_ptr,  # [B, Hq, S_cap] float32, base 2 (-inf: empty split)
    out_ptr,  # [B, Hq, Dv]
    num_splits,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """``out = Σ_s 2^(lse_s − max) · o_s / Σ_s 2^(lse_s − max)``; one program per (sequence, head).

    The splits are read ``BLOCK_S`` rows at a time (a ``[BLOCK_S, BLOCK_DV]`` tile, four values per
    thread: 16-byte loads), summed over the rows once at the end."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    base = b * stride_lb + head * stride_lh
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < DV
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        rows = s0 + offs_s
        m = tl.maximum(m, tl.load(part_lse_ptr + base + rows, mask=rows < num_splits, other=float("-inf")))
    m_all = tl.max(m, 0)
    acc = tl.zeros([BLOCK_S, BLOCK_DV], dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        rows = s0 + offs_s
        s_mask = rows < num_splits
        w = tl.math.exp2(tl.load(part_lse_ptr + base + rows, mask=s_mask, other=float("-inf")) - m_all)
        o = tl.load(
            part_o_ptr + (base + rows)[:, None] * DV + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc += w[:, None] * o  # w is 0 for an empty split and for the rows past num_splits
        w_sum += w
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + offs_d,
        (tl.sum(acc, 0) / tl.sum(w_sum, 0)).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@dataclass(frozen=True)
class DecodeSpec:
    """The compile-time shape of one launch: everything but pointers, strides and the grid."""

    group: int  # query heads per KV head (latent: all heads)
    dk: int  # key width (latent: DV + DPE)
    dv: int
    page_size: int
    block_n: int
    block_g: int = 0  # query heads per program; 0: GROUP padded to a power of two ≥ 16
    kv_fp8: bool = False
    latent: bool = False
    num_warps: int = 4
    num_stages: int = 2

    @property
    def heads_per_program(self) -> int:
        return self.block_g or pow2(self.group)

    def head_blocks(self) -> int:
        return -(-self.group // self.heads_per_program)


def decode_constexprs(spec: DecodeSpec, dtype: torch.dtype, *, interpreted: bool = False) -> dict[str, Any]:
    """Compile-time parameters of :func:`split_kv_decode_kernel` for ``spec`` in compute ``dtype``."""
    dpe = spec.dk - spec.dv if spec.latent else 0
    return {
        "GROUP": spec.group,
        "BLOCK_G": spec.heads_per_program,
        "DK": spec.dk,
        "DV": spec.dv,
        "DPE": dpe,
        "BLOCK_DK": pow2(dpe if spec.latent else spec.dk),
        "BLOCK_DV": pow2(spec.dv),
        "PAGE_SIZE": spec.page_size,
        "BLOCK_N": spec.block_n,
        "KV_FP8": spec.kv_fp8,
        "LATENT": spec.latent,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_F32": interpreted and dtype == torch.bfloat16 and not spec.kv_fp8,
    }


def merge_constexprs(dv: int) -> dict[str, Any]:
    """Compile-time parameters of :func:`split_merge_kernel` (one specialisation for every split count):
    a tile of 512 values (four per thread of :data:`MERGE_WARPS`), ``BLOCK_S`` splits × ``BLOCK_DV``."""
    return {"DV": dv, "BLOCK_DV": pow2(dv), "BLOCK_S": max(1, 512 // pow2(dv))}


#: warps of the merge: a 512-value tile is four values per thread, read in 16-byte loads (at Dv 128:
#: one split row per warp, the rows summed across warps in shared memory at the end)
MERGE_WARPS = 4


def device_programs(device: torch.device) -> int:
    """Programs that keep the device busy: 2 per SM on CUDA; a nominal 8 elsewhere (interpreter)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def context_bucket(length: int, *, max_seq_len: int) -> int:
    """The context bucket of a step whose longest sequence has ``length`` tokens: the next power of
    two (≥ 64), capped at ``max_seq_len``. Split counts and grids are fixed per bucket, so one CUDA
    graph serves every step of a bucket."""
    return min(max(64, triton.next_power_of_2(max(1, length))), max_seq_len)


def auto_splits(
    *, programs_per_split: int, max_len: int, block_n: int, programs: int, max_splits: int
) -> int:
    """The split count of ``num_splits = 0``: double it while the grid (``programs_per_split`` per
    split) leaves the device's ``programs`` unfilled and each split keeps ≥ 2 tiles of ``max_len``."""
    splits = 1
    while (
        splits < max_splits
        and programs_per_split * splits < programs
        and -(-max_len // (2 * splits)) >= 2 * block_n
    ):
        splits *= 2
    return splits


def launch_decode(
    *,
    spec: DecodeSpec,
    mode: TritonMode,
    plan: Any,
    q: torch.Tensor,
    scale: float,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    scale_strides: tuple[int, int, int] = (0, 0, 0),
) -> torch.Tensor:
    """One layer's decode: ``q [B, Hq, Dk]`` over one layer's pages → a new ``[B, Hq, Dv]`` output.

    ``plan`` supplies ``block_table``, ``device_lens``, ``num_splits`` and the scratch partials
    ``part_o [B, Hq, S_cap, Dv]`` / ``part_lse [B, Hq, S_cap]`` (float32, contiguous, ``S_cap ≥
    num_splits``; :class:`attnbench.kernels.split_kv.SplitKVPlan`). ``v_pages=None``: the latent form (V is
    K's first ``Dv`` columns). Allocates only the output; no host sync; the grid depends only on
    ``num_splits`` and the shapes: capturable in a CUDA graph.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    b, hq = q.shape[0], q.shape[1]
    out = torch.empty(b, hq, spec.dv, dtype=q.dtype, device=q.device)
    splits, part_o, part_lse, table = plan.num_splits, plan.part_o, plan.part_lse, plan.block_table
    direct = splits == 1 and not spec.latent  # the latent form always writes partials
    vp = k_pages if v_pages is None else v_pages
    ks = k_pages if k_scales is None else k_scales
    vs = k_pages if v_scales is None else v_scales
    bias = 256.0 if spec.kv_fp8 else 1.0
    kernel_for(split_kv_decode_kernel, mode)[(b, hq // spec.group * spec.head_blocks(), splits)](
        q, k_pages, vp, ks, vs, table, plan.device_lens, out, part_o, part_lse,
        scale * LOG2E * bias,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        vp.stride(0), vp.stride(1), vp.stride(2),
        *scale_strides,
        table.stride(0),
        out.stride(0), out.stride(1),
        part_lse.stride(0), part_lse.stride(1),
        int(direct),
        **decode_constexprs(spec, q.dtype, interpreted=mode == "interpreted"),
        num_warps=spec.num_warps,
        num_stages=spec.num_stages,
    )  # fmt: skip
    if not direct:
        kernel_for(split_merge_kernel, mode)[(b, hq)](
            part_o, part_lse, out, splits,
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            **merge_constexprs(spec.dv),
            num_warps=MERGE_WARPS,
        )  # fmt: skip
    return out
