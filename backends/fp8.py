"""``fp8`` — a float8 (e4m3) paged KV cache with scales, dequantised on the fly.

The cache (:class:`attnbench.fp8.FP8KVCache`) is a :class:`attnbench.paged.PagedKVCache` whose pages
hold ``float8_e4m3fn`` bytes, plus float32 scales written with each token:

    k_pages, v_pages:     [L, P, page_size, Hkv, D]  float8_e4m3fn
    k_scales, v_scales:   [L, P, page_size, Hkv]     float32   (scale "token_head", the default)
                          [L]                        float32   (scale "tensor": a static scale)

Per token-head scales need no calibration and cost 8 bytes per token, head and layer next to the
``2 · D`` fp8 bytes: 264 bytes instead of bf16's 512 for head_dim 128 (0.52×).

Two attention paths, and ``implementation()`` says which one runs:

- ``triton`` (CUDA; on the CPU only under ``TRITON_INTERPRET=1``, where it is checked, never timed):
  a split-KV paged decode kernel (``triton_paged``'s structure: grid ``(B, Hkv, splits)``, one
  K/V tile load per GQA group, online softmax) that reads the fp8 *bytes* (half of bf16's traffic).
  Bytes are turned into fp16 by integer ops (``s eeee mmm`` → ``s 0eeee mmm0000000`` is the value
  / 256, exactly), because sm_80 has no fp8 type; scales (× 256) multiply the scores and the
  probabilities, so a K/V tile is never rescaled element by element. The split reduction
  merges the partial results by their log-sum-exp, as ``triton_paged`` does.
- ``torch`` (everywhere; what runs and is timed on the CPU): gathers the step's pages into reusable
  int16 buffers, applies the same byte trick (three in-place integer passes; torch's own fp8 → bf16
  conversion runs in software on CPUs, several times slower), then fp16 matmuls with a float32
  softmax (fp32 matmuls for fp32 workloads). The query is normalised per head so fp16 cannot overflow.

Prefill writes the prompt's quantised K/V into the pages and attends in the compute dtype on the
given (unquantised) K/V. Non-finite K/V are refused: in ``append``/prefill at once (one host sync,
nothing stored); in ``decode`` a per-layer device flag is raised (no host sync per layer, the row
is stored as zeros) and :meth:`FP8KVCache.commit` raises, one sync per step.

Which call does what: ``plan()`` is host work once per step (pages, slot mapping, split buffers,
torch-path workspaces; may allocate); ``decode()`` does no host-device sync. The Triton path is
capturable in a CUDA graph (it allocates only its output and the new token's quantised rows).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from attnbench.backend import Backend, KVCache, StepPlan, Tolerance, Tunable
from attnbench.backends.triton_paged import (  # the split merge and split heuristic are shared, not copied
    MAX_SPLITS,
    _device_programs,
    _pow2,
    _split_reduce_kernel,
    auto_splits,
    reduce_constexprs,
)
from attnbench.fp8 import (
    FP16_BIAS,
    GRANULARITIES,
    FP8KVCache,
    dequantize,
    fp8_bits_to_fp16,
    quantize,
)
from attnbench.paged import PagedStepPlan, cdiv
from attnbench.triton_utils import kernel_for, triton_mode
from attnbench.workload import Workload

# -- the search space, as data ------------------------------------------------------------------------
PAGE_SIZES = (16, 32, 64, 128, 256)
NUM_SPLITS = (0, 1, 2, 4, 8, 16)  # 0: chosen per step to fill the device (triton path only)
BLOCK_N = (16, 32, 64)  # tokens per K/V tile (triton path only)
NUM_WARPS = {16: 4, 32: 4, 64: 4}  # by block_n
NUM_STAGES = 2
assert max(NUM_SPLITS) <= MAX_SPLITS  # the shared reduction is specialised for MAX_SPLITS
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# -- accuracy, as data (how these were chosen: docs/fp8.md, scripts/fp8_accuracy.py) ---------------
#: against the exact float64 reference: the fp8 rounding itself (any compute dtype)
EXACT_TOLERANCE = Tolerance(max_abs=0.5, rel_l2=0.2, min_cosine=0.98)
#: against float64 attention over the dequantised bytes: only the attention arithmetic
STORED_TOLERANCE = {
    torch.float32: Tolerance(max_abs=2e-5, rel_l2=1e-5, min_cosine=0.999_999),
    torch.float16: Tolerance(max_abs=1e-2, rel_l2=3e-3, min_cosine=0.999_95),
    torch.bfloat16: Tolerance(max_abs=2e-2, rel_l2=5e-3, min_cosine=0.999_9),
}


@triton.jit
def _fp8_paged_decode_kernel(
    q_ptr,  # [B, Hq, Dk] compute dtype
    k_ptr,  # [P, page_size, Hkv, Dk] uint8 (float8_e4m3fn bytes): one layer's pages
    v_ptr,  # [P, page_size, Hkv, Dv] uint8
    ks_ptr,  # [P, page_size, Hkv] float32 (token_head) or [1] with zero strides (tensor)
    vs_ptr,
    block_table_ptr,  # [B, max_pages] int32
    lens_ptr,  # [B] int32: tokens to attend to (the new one included)
    out_ptr,  # [B, Hq, Dv]: written when DIRECT
    part_o_ptr,  # [B, Hq, S, Dv] float32, unnormalised: written when not DIRECT
    part_m_ptr,  # [B, Hq, S] float32: running max (log2 domain)
    part_l_ptr,  # [B, Hq, S] float32: running sum of exp2
    scale_log2e,  # softmax scale × log2(e) × 256 (the byte trick's bias)
    page_size,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_sp,  # scale strides (0, 0, 0 for a static per-tensor scale)
    stride_st,
    stride_sh,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two ≥ 16 (tl.dot's minimum)
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: normalise and write out_ptr
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32)
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
    q = tl.load(q_ptrs, mask=g_mask[:, None] & (offs_dk[None, :] < DK), other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    table = block_table_ptr + b * stride_bt
    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        valid = tokens < end
        pages = tl.load(table + tokens // page_size, mask=valid, other=0).to(tl.int64)
        rows = tokens % page_size
        k_ptrs = k_ptr + pages[:, None] * stride_kp + rows[:, None] * stride_kt + kv_head * stride_kh
        v_ptrs = v_ptr + pages[:, None] * stride_vp + rows[:, None] * stride_vt + kv_head * stride_vh
        if BLOCK_DK == DK:  # row mask only: lets the compiler use 16-byte loads along D
            kb = tl.load(k_ptrs + offs_dk[None, :], mask=valid[:, None], other=0)  # [BLOCK_N, BLOCK_DK] u8
        else:
            kb = tl.load(k_ptrs + offs_dk[None, :], mask=valid[:, None] & (offs_dk[None, :] < DK), other=0)
        if BLOCK_DV == DV:
            vb = tl.load(v_ptrs + offs_dv[None, :], mask=valid[:, None], other=0)
        else:
            vb = tl.load(v_ptrs + offs_dv[None, :], mask=valid[:, None] & (offs_dv[None, :] < DV), other=0)
        s_off = pages * stride_sp + rows * stride_st + kv_head * stride_sh
        k_scale = tl.load(ks_ptr + s_off, mask=valid, other=0.0)  # [BLOCK_N]
        v_scale = tl.load(vs_ptr + s_off, mask=valid, other=0.0)
        # e4m3 byte s.eeee.mmm -> fp16 bits s.0eeee.mmm0000000 == value / 256 (exact, subnormals too)
        kb = kb.to(tl.uint16)
        vb = vb.to(tl.uint16)
        # float32 operands: exact for q (from bf16/fp16) and K/V (4 significant bits); TF32 dots then
        # round only the probabilities, to 10 bits (bf16 would keep 7)
        k = (((kb & 0x7F) << 7) | ((kb & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        v = (((vb & 0x7F) << 7) | ((vb & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        s = s * (k_scale * scale_log2e)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p * (v_scale * 256.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
        m_i = m_new

    dv_mask = g_mask[:, None] & (offs_dv[None, :] < DV)
    if DIRECT:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv_mask)
    else:
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_G] into [B*Hq*S]
        tl.store(part_o_ptr + row[:, None] * DV + offs_dv[None, :], acc, mask=dv_mask)
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)


def decode_constexprs(
    group: int, dk: int, dv: int, block_n: int, dtype: torch.dtype, *, direct: bool
) -> dict[str, Any]:
    return {
        "GROUP": group,
        "BLOCK_G": _pow2(group),
        "DK": dk,
        "DV": dv,
        "BLOCK_DK": _pow2(dk),
        "BLOCK_DV": _pow2(dv),
        "BLOCK_N": block_n,
        "DIRECT": direct,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


class FP8Backend(Backend):
    name = "fp8"
    description = "fp8 (e4m3) paged KV cache with per-token scales; Triton on CUDA, torch on CPU"
    lossy = "fp8 e4m3 K/V"
    tunables = (
        Tunable("page_size", PAGE_SIZES, 64, "tokens per KV page"),
        Tunable(
            "scale", GRANULARITIES, "token_head", "scale per token and KV head, or one static per tensor"
        ),
        Tunable("num_splits", NUM_SPLITS, 0, "split-KV programs per sequence and KV head; 0 = auto (triton)"),
        Tunable("block_n", BLOCK_N, 32, "tokens per K/V tile loaded by one program (triton)"),
    )
    #: which attention path: "auto" (triton on CUDA, torch elsewhere), "triton" or "torch"
    kernel: ClassVar[str] = "auto"
    #: the per-tensor scale of ``scale = "tensor"`` (vLLM's default when a checkpoint has none)
    static_scale: ClassVar[float] = 1.0
    #: page hand-out order; "random" catches kernels that assume a sequence's pages are contiguous
    page_order: ClassVar[str] = "random"

    # -- availability ----------------------------------------------------------------------------
    def _path(self, workload: Workload) -> tuple[str | None, list[str]]:
        reasons = []
        if workload.dtype not in DTYPES:
            reasons.append(f"compute dtype {workload.dtype_name} not in (fp32, fp16, bf16)")
        g = workload.geometry(self.kv_form)
        if max(g.qk_head_dim, g.v_head_dim) > MAX_HEAD_DIM:
            reasons.append(f"head_dim {max(g.qk_head_dim, g.v_head_dim)} > {MAX_HEAD_DIM}")
        mode, why = triton_mode(workload.device)
        if self.kernel == "triton" or (self.kernel == "auto" and mode == "native"):
            if mode is None:
                reasons.append(why)
            return "triton", reasons
        if self.kernel not in ("auto", "torch"):
            reasons.append(f"kernel {self.kernel!r} not in ('auto', 'triton', 'torch')")
        if torch.device(workload.device).type not in ("cpu", "cuda"):
            reasons.append(f"device {torch.device(workload.device).type!r} not in ('cpu', 'cuda')")
        return "torch", reasons

    def supports(self, workload: Workload) -> list[str]:
        return self._path(workload)[1]

    def interpreted(self, workload: Workload) -> bool:
        return self._path(workload)[0] == "triton" and triton_mode(workload.device)[0] == "interpreted"

    def implementation(self, workload: Workload) -> str:
        path, reasons = self._path(workload)
        if reasons:
            return "unavailable: " + "; ".join(reasons)
        return (
            f"triton[{triton_mode(workload.device)[0]}]"
            if path == "triton"
            else "torch (fp8 bytes → fp16 matmul)"
        )

    def kv_bytes_per_token(self, workload: Workload, *, config: Mapping[str, Any]) -> int:
        """One byte per K/V value plus, unless one scale serves the tensor, two float32 scales per KV head."""
        shape = workload.shape
        scales = 0 if config["scale"] == "tensor" else 2 * workload.geometry(self.kv_form).num_kv_heads * 4
        return shape.kv_bytes_per_token("fp8", "expanded") + scales * shape.num_layers

    def tunables_for(self, workload: Workload) -> tuple[Tunable, ...]:
        """Speed knobs only: ``scale`` changes the numerics, so it is chosen, never tuned."""
        keep = (
            ("page_size", "num_splits", "block_n") if self._path(workload)[0] == "triton" else ("page_size",)
        )
        return tuple(t for t in self.tunables if t.name in keep)

    # -- accuracy --------------------------------------------------------------------------------
    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """Against the K/V as stored (dequantised): the torch path multiplies in fp16 (fp8 bytes are
        exact in fp16), so in fp16 the scores are rounded before the softmax — up to ~15× the
        calibration error on needle probes at 8k–128k (scripts/gate_matrix.py, 30 seeds), hence 20; bf16 (fp16's finer rounding under
        bf16's coarser output) 4; fp32 4 (the dequantisation multiplies by a bias and a scale, one
        rounding more than the reference). The Triton kernel rounds P for its P·V dot: 6 in 16-bit."""
        if self.kernel == "triton" or (self.kernel == "auto" and triton_mode("cuda")[0] == "native"):
            return 6.0 if dtype in (torch.float16, torch.bfloat16) else 4.0
        return 20.0 if dtype == torch.float16 else 4.0

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return EXACT_TOLERANCE

    def stored_tolerance(self, dtype: torch.dtype) -> Tolerance:
        return STORED_TOLERANCE[dtype]

    def reference_kv(self, k: torch.Tensor, v: torch.Tensor, *, config: Mapping[str, Any]) -> tuple:
        """``k``/``v`` ``[B, S, Hkv, D]`` quantised exactly as the cache stores them, in float64."""
        kw = {"granularity": self.resolve_config(config)["scale"], "static_scale": self.static_scale}
        (kq, ks, _), (vq, vs, _) = quantize(k, **kw), quantize(v, **kw)
        return dequantize(kq, ks), dequantize(vq, vs)

    # -- cache and plan --------------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> FP8KVCache:
        path, reasons = self._path(workload)
        if reasons:
            raise ValueError(f"backend {self.name!r} cannot run {workload.describe()}: {'; '.join(reasons)}")
        cfg = self.resolve_config(config)
        cache = FP8KVCache(
            workload=workload,
            geometry=workload.geometry(self.kv_form),
            config=cfg,
            num_layers=num_layers,
            max_seq_len=max_seq_len,
            page_size=cfg["page_size"],
            granularity=cfg["scale"],
            static_scale=self.static_scale,
            page_order=self.page_order,
        )
        cache.path = path
        return cache

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> StepPlan:
        assert isinstance(cache, FP8KVCache)
        plan = cache.plan_step(num_new)
        cache.check_on_commit = plan.max_new == 1  # decode writes are checked once per step, in commit()
        if cache.path == "triton":
            _plan_triton(cache, plan)
        else:
            _plan_torch(cache, plan)
        return plan

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(cache, FP8KVCache)
        cache.store(plan, layer=layer, k=k, v=v, defer_check=False)

    # -- the step --------------------------------------------------------------------------------
    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, Dk]``, new ``k [B, Hkv, Dk]``/``v [B, Hkv, Dv]`` → ``[B, Hq, Dv]``. No host sync."""
        assert isinstance(cache, FP8KVCache) and isinstance(plan, PagedStepPlan)
        cache.store(plan, layer=layer, k=k[:, None], v=v[:, None], defer_check=True)
        if cache.path == "triton":
            return _decode_triton(cache, plan, layer, q)
        return _decode_torch(cache, plan, layer, q)


# -- triton path ----------------------------------------------------------------------------------------
def _plan_triton(cache: FP8KVCache, plan: PagedStepPlan) -> None:
    cfg, g = cache.config, cache.geometry
    splits = cfg["num_splits"] or auto_splits(
        batch=cache.batch,
        kv_heads=g.num_kv_heads,
        max_len=max(plan.seq_lens_after),
        block_n=cfg["block_n"],
        programs=_device_programs(cache.device),
    )
    plan.extra["num_splits"] = splits
    if splits > 1:  # shared by every layer of the step (layers run one after another)
        f32 = {"dtype": torch.float32, "device": cache.device}
        plan.extra["part_o"] = torch.empty(cache.batch, g.num_q_heads, splits, g.v_head_dim, **f32)
        plan.extra["part_m"] = torch.empty(cache.batch, g.num_q_heads, splits, **f32)
        plan.extra["part_l"] = torch.empty(cache.batch, g.num_q_heads, splits, **f32)
    plan.extra["mode"] = triton_mode(cache.device)[0]


def _decode_triton(cache: FP8KVCache, plan: PagedStepPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
    g, cfg = cache.geometry, cache.config
    q = q if q.stride(-1) == 1 else q.contiguous()
    b = q.shape[0]
    out = torch.empty(b, g.num_q_heads, g.v_head_dim, dtype=q.dtype, device=q.device)
    splits = plan.extra["num_splits"]
    direct = splits == 1
    part_o = out if direct else plan.extra["part_o"]
    part_m = out if direct else plan.extra["part_m"]
    part_l = out if direct else plan.extra["part_l"]
    kp, vp = cache.k_pages[layer].view(torch.uint8), cache.v_pages[layer].view(torch.uint8)
    if cache.granularity == "token_head":
        ks, vs = cache.k_scales[layer], cache.v_scales[layer]
        s_strides = ks.stride()[:3]
    else:
        ks, vs = cache.k_scales[layer : layer + 1], cache.v_scales[layer : layer + 1]
        s_strides = (0, 0, 0)
    mode = plan.extra["mode"]
    kernel_for(_fp8_paged_decode_kernel, mode)[(b, g.num_kv_heads, splits)](
        q, kp, vp, ks, vs, plan.block_table, plan.device_lens, out, part_o, part_m, part_l,
        g.scale * math.log2(math.e) * FP16_BIAS, cache.page_size,
        q.stride(0), q.stride(1),
        kp.stride(0), kp.stride(1), kp.stride(2),
        vp.stride(0), vp.stride(1), vp.stride(2),
        *s_strides,
        plan.block_table.stride(0),
        out.stride(0), out.stride(1),
        **decode_constexprs(g.group_size, g.qk_head_dim, g.v_head_dim, cfg["block_n"], q.dtype, direct=direct),
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


# -- torch path -----------------------------------------------------------------------------------------
def _buffer(cache: FP8KVCache, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable flat buffer of at least ``numel`` elements (grows geometrically; plan-time only)."""
    buf = cache.workspace.get(name)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(
            max(numel, 2 * (0 if buf is None else buf.numel())), dtype=dtype, device=cache.device
        )
        cache.workspace[name] = buf
    return buf[:numel]


def _plan_torch(cache: FP8KVCache, plan: PagedStepPlan) -> None:
    g, b = cache.geometry, cache.batch
    n_pages = cdiv(max(plan.seq_lens_after), cache.page_size)
    s = n_pages * cache.page_size
    plan.extra["pages"] = plan.block_table[:, :n_pages].reshape(-1).to(torch.int64)  # [B * n_pages]
    cols = torch.arange(s, device=cache.device)
    plan.extra["masked"] = (cols[None, :] >= plan.device_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    for name, d in (("k", g.qk_head_dim), ("v", g.v_head_dim)):
        n = b * s * g.num_kv_heads * d
        plan.extra[f"{name}8"] = _buffer(cache, f"{name}8", n, torch.int8).view(
            b * n_pages, cache.page_size, -1
        )
        plan.extra[f"{name}16"] = _buffer(cache, f"{name}16", n, torch.int16).view(b, g.num_kv_heads, s, d)


def _dequant_pages(cache: FP8KVCache, plan: PagedStepPlan, layer: int, name: str, work: torch.dtype):
    """Gather one layer's K or V pages of the step → ``[B, Hkv, S, D]`` in ``work`` (value / 256)."""
    pages = cache.k_pages if name == "k" else cache.v_pages
    raw = pages[layer].view(torch.int8).flatten(2)  # [P, page_size, Hkv * D]
    gathered = torch.index_select(raw, 0, plan.extra["pages"], out=plan.extra[f"{name}8"])
    out16 = plan.extra[f"{name}16"]
    b, hkv, s, d = out16.shape
    vals = fp8_bits_to_fp16(gathered.view(b, s, hkv, d).transpose(1, 2), out=out16)
    return vals if work == torch.float16 else vals.to(work)


def _gather_scales(cache: FP8KVCache, plan: PagedStepPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scales ``[B, Hkv, 1, S]`` (float32), or the static 0-d scales."""
    if cache.granularity == "tensor":
        return cache.k_scales[layer], cache.v_scales[layer]
    b, hkv = cache.batch, cache.geometry.num_kv_heads
    idx = plan.extra["pages"]
    ks = cache.k_scales[layer].index_select(0, idx).view(b, -1, hkv).transpose(1, 2)[:, :, None, :]
    vs = cache.v_scales[layer].index_select(0, idx).view(b, -1, hkv).transpose(1, 2)[:, :, None, :]
    return ks, vs


#: Scale of the fp16 attention weights in the torch path (see :func:`_decode_torch`).
_P_LIFT = 2.0**13


def _decode_torch(cache: FP8KVCache, plan: PagedStepPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
    g = cache.geometry
    b = q.shape[0]
    work = torch.float32 if q.dtype == torch.float32 else torch.float16
    keys = _dequant_pages(cache, plan, layer, "k", work)  # [B, Hkv, S, Dk] = k / (256 · k_scale)
    values = _dequant_pages(cache, plan, layer, "v", work)  # [B, Hkv, S, Dv]
    ks, vs = _gather_scales(cache, plan, layer)
    qf = q.float().view(b, g.num_kv_heads, g.group_size, g.qk_head_dim)  # [B, Hkv, G, Dk]
    q_amax = qf.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # fp16-safe
    scores = torch.matmul((qf / q_amax).to(work), keys.transpose(-1, -2)).float()  # [B, Hkv, G, S]
    scores = scores * (q_amax * (g.scale * FP16_BIAS)) * ks
    scores = scores.masked_fill(plan.extra["masked"], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    v_max = vs.amax(-1, keepdim=True) if vs.dim() else vs  # keep fp16 weights ≤ 1
    # × 2^13 so that small probabilities stay in fp16's normal range (at 128k context a background
    # token's is ~2e-6, an fp16 subnormal with a few bits left); the output stays ≤ 2^13 · 448/256
    lift = 1.0 if work == torch.float32 else _P_LIFT
    weights = (probs * (vs / v_max) * lift).to(work)
    out = torch.matmul(weights, values).float() * (v_max * (FP16_BIAS / lift))  # [B, Hkv, G, Dv]
    return out.to(q.dtype).view(b, g.num_q_heads, g.v_head_dim)


# -- ahead-of-time compilation: every specialisation this backend can launch --------------------------
_DECODE_ARGS = (
    ("q_ptr", "*{t}"), ("k_ptr", "*u8"), ("v_ptr", "*u8"), ("ks_ptr", "*fp32"), ("vs_ptr", "*fp32"),
    ("block_table_ptr", "*i32"), ("lens_ptr", "*i32"), ("out_ptr", "*{t}"), ("part_o_ptr", "*fp32"),
    ("part_m_ptr", "*fp32"), ("part_l_ptr", "*fp32"), ("scale_log2e", "fp32"), ("page_size", "i32"),
    *((s, "i32") for s in (
        "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh",
        "stride_sp", "stride_st", "stride_sh", "stride_bt", "stride_ob", "stride_oh",
    )),
)  # fmt: skip
#: arguments the JIT sees as multiples of 16 for head_dim 128 (torch pointers are 16-byte aligned)
_ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "out_ptr", "part_o_ptr", "page_size", "stride_qb",
            "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh",
            "stride_ob", "stride_oh")  # fmt: skip


def aot_specializations(
    *, dtype: torch.dtype = torch.bfloat16, group: int = 4, head_dim: int = 128
) -> Iterator[dict[str, Any]]:
    """Keyword arguments for :func:`attnbench.triton_utils.aot_compile`, one per kernel specialisation
    the declared tunables can launch (every block_n × direct/split; page size, scale granularity and
    split count are run-time arguments), and the split reduction, for one model geometry."""
    t = _TL_DTYPE[dtype]
    for block_n in BLOCK_N:
        for direct in (True, False):
            constexprs = decode_constexprs(group, head_dim, head_dim, block_n, dtype, direct=direct)
            sig = {name: kind.format(t=t) for name, kind in _DECODE_ARGS} | dict.fromkeys(
                constexprs, "constexpr"
            )
            yield {
                "kernel": _fp8_paged_decode_kernel,
                "signature": sig,
                "constexprs": constexprs,
                "num_warps": NUM_WARPS[block_n],
                "num_stages": NUM_STAGES,
                "aligned": _ALIGNED,
            }
    constexprs = reduce_constexprs(head_dim)
    sig = {
        "part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": f"*{t}",
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
