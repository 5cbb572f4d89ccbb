"""``mla`` — absorbed MLA decode over a paged latent cache (DeepSeek-V2/V3).

The cache holds, per token and layer, one row ``[c | k_pe]`` of ``kv_lora_rank + qk_rope_head_dim``
values (576 for DeepSeek-V3: 70,272 bytes per token over 61 layers in bf16), shared by all heads, in
pages of ``page_size`` tokens (:class:`attnbench.paged.PagedKVCache` with ``share_v``: the value is
the first ``kv_lora_rank`` columns of the same row, stored once). Decode takes the absorbed query
``q [B, H, rank + rope]`` (see :func:`attnbench.mla.latent_query`) and returns the latent output
``[B, H, rank]`` (apply :func:`attnbench.mla.expand_output` after). All heads share one KV head: the
MQA case, with a very wide head.

Two implementations, and ``implementation()`` says which one runs:

- ``triton`` (CUDA, or on CPU under ``TRITON_INTERPRET=1`` for testing): a split-KV kernel. Program
  ``(b, head block, split)`` walks its share of the sequence through the block table in tiles of
  ``BLOCK_N`` tokens, computes ``[BLOCK_H, BLOCK_N]`` scores as ``q_lat·c + q_pe·k_pe`` (two dots),
  keeps an online softmax and a ``[BLOCK_H, rank]`` accumulator; a second kernel merges the splits
  by their log-sum-exp. Tiles are declared as data (:data:`TILES`), like a ``triton.Config`` list.
- ``torch`` (everywhere): gathers the sequence's pages through the block table and runs two batched
  matmuls with a float32 softmax.

Which call does what: ``plan()`` is host work once per step (reserves pages, slot mapping, split
workspace; may allocate). ``decode()`` writes the new row and attends with no host sync; the Triton
path is capturable in a CUDA graph (it allocates only its output), the torch path allocates the
gathered pages. Prefill runs causal attention on the given latent rows (the absorbed form).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnbench.backend import DEFAULT_TOLERANCES, Backend, ConfigError, KVCache, StepPlan, Tolerance, Tunable
from attnbench.paged import PagedKVCache, PagedStepPlan, cdiv
from attnbench.triton_utils import kernel_for, triton_mode
from attnbench.workload import Workload

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path still works
    triton = None


@dataclass(frozen=True)
class Tile:
    """One launch configuration of the split-KV kernel."""

    block_h: int  # query heads per program (tl.dot needs ≥ 16)
    block_n: int  # cached tokens per inner step
    num_warps: int
    num_stages: int


#: The tile configurations the kernel declares; every one is compiled for sm_80 and sm_90 in the tests.
TILES: dict[str, Tile] = {
    "h16_n32_w4": Tile(16, 32, 4, 2),
    "h16_n64_w8": Tile(16, 64, 8, 2),
    "h32_n64_w8": Tile(32, 64, 8, 2),
    "h32_n32_w8": Tile(32, 32, 8, 2),
}
SPLIT_CHOICES = (0, 1, 2, 4, 8, 16, 32)  # 0: chosen from the batch, heads and SM count
KERNELS = ("auto", "triton", "torch")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _mla_decode_partial(
        Q,  # [B, H, DV + DPE]
        KV,  # one layer's pages: [num_pages, PAGE_SIZE, 1, DV + DPE]
        BlockTable,  # [B, max_pages] int32
        SeqLens,  # [B] int32
        PartialO,  # [B, H, NUM_SPLITS, DV] float32
        PartialLse,  # [B, H, NUM_SPLITS] float32, log2 units
        scale,
        stride_qb,
        stride_qh,
        stride_kvp,
        stride_kvt,
        stride_btb,
        stride_pob,
        stride_poh,
        stride_pos,
        stride_plb,
        stride_plh,
        num_heads,
        DV: tl.constexpr,
        DPE: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_DPE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        EXACT: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        mask_h = offs_h < num_heads
        offs_d = tl.arange(0, BLOCK_DV)
        offs_pe = tl.arange(0, BLOCK_DPE)
        mask_d = offs_d < DV
        mask_pe = offs_pe < DPE
        q_rows = Q + b * stride_qb + offs_h[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        q_pe = tl.load(q_rows + DV + offs_pe[None, :], mask=mask_h[:, None] & mask_pe[None, :], other=0.0)

        seq_len = tl.load(SeqLens + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)
        qk_scale = scale * 1.4426950408889634  # softmax in base 2
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            page = tl.load(BlockTable + b * stride_btb + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            rows = KV + page.to(tl.int64) * stride_kvp + (offs_n % PAGE_SIZE) * stride_kvt
            c = tl.load(rows[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            k_pe = tl.load(
                rows[:, None] + DV + offs_pe[None, :], mask=mask_n[:, None] & mask_pe[None, :], other=0.0
            )
            if EXACT:  # float32 operands, no tf32 (see _exact_dots)
                s = tl.dot(q.to(tl.float32), tl.trans(c.to(tl.float32)), input_precision="ieee")
                s += tl.dot(q_pe.to(tl.float32), tl.trans(k_pe.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))
            s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(c.dtype)  # rounded like the native path, also when EXACT
            if EXACT:
                acc = acc * alpha[:, None] + tl.dot(
                    p.to(tl.float32), c.to(tl.float32), input_precision="ieee"
                )
            else:
                acc = acc * alpha[:, None] + tl.dot(p, c)
            m_i = m_new
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        o_ptr = (
            PartialO + b * stride_pob + offs_h[:, None] * stride_poh + split * stride_pos + offs_d[None, :]
        )
        tl.store(o_ptr, out, mask=mask_h[:, None] & mask_d[None, :])
        tl.store(PartialLse + b * stride_plb + offs_h * stride_plh + split, lse, mask=mask_h)

    @triton.jit
    def _mla_decode_merge(
        PartialO,  # [B, H, NUM_SPLITS, DV] float32
        PartialLse,  # [B, H, NUM_SPLITS] float32, log2 units
        Out,  # [B, H, DV]
        stride_pob,
        stride_poh,
        stride_pos,
        stride_plb,
        stride_plh,
        stride_ob,
        stride_oh,
        DV: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < DV
        lse = tl.load(PartialLse + b * stride_plb + h * stride_plh + offs_s)
        w = tl.exp2(lse - tl.max(lse, 0))  # empty splits have lse = -inf: weight 0
        o_ptr = PartialO + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :]
        o = tl.load(o_ptr, mask=mask_d[None, :], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def effective_tile(name: str, dtype: torch.dtype) -> Tile:
    """The tile that runs for ``dtype``: float32 rows are twice as wide, so BLOCK_N is capped at 32 to
    stay within sm_80's shared memory (163 KiB per block)."""
    tile = TILES[name]
    if dtype == torch.float32 and tile.block_n > 32:
        return Tile(tile.block_h, 32, tile.num_warps, tile.num_stages)
    return tile


def _exact_dots(dtype: torch.dtype, mode: str) -> bool:
    """float32 dots without tf32: for float32 inputs, and for bfloat16 under the interpreter, whose
    ``tl.dot`` (triton 3.9) multiplies the raw bf16 bit patterns as integers. Products of bf16 values
    are exact in float32, so this computes what the native bf16 dot computes."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and mode == "interpreted")


@functools.cache
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def auto_splits(*, batch: int, head_blocks: int, max_seq_len: int, block_n: int, sm_count: int) -> int:
    """Enough programs to fill the device twice over, each split keeping at least 4 tiles of work."""
    want = cdiv(2 * sm_count, batch * head_blocks)
    most = max(1, max_seq_len // (4 * block_n))
    n = max(1, min(want, most, 32))
    return 1 << (n.bit_length() - 1)  # round down to a power of two (the merge kernel needs one)


class MLABackend(Backend):
    name = "mla"
    description = "MLA absorbed decode over a paged latent cache (Triton split-KV on CUDA, torch elsewhere)"
    kv_form = "latent"
    tunables = (
        Tunable("page_size", (16, 32, 64, 128), 64, "tokens per cache page"),
        Tunable(
            "kernel", KERNELS, "auto", "auto: triton where it runs (CUDA, or the interpreter), else torch"
        ),
        Tunable("num_splits", SPLIT_CHOICES, 0, "split-KV programs per sequence (triton); 0 = from SM count"),
        Tunable("tile", tuple(TILES), "h16_n32_w4", "triton tile: heads × tokens per step, warps"),
    )

    # -- what it can do --------------------------------------------------------------------------
    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        """The defaults. The latent rows are 576 wide, so logits are ~1.7× those of a 192-wide head and
        the torch path's bf16 ``q·rowsᵀ`` rounds the largest to ±0.014 after scaling; the worst max_abs
        seen was 0.025 over 524k outputs (DeepSeek-V3, batch 8, 8k), inside the default bf16 bound
        (4e-2, one output ulp at |out| ≈ 3-4). Observed rel_l2 ≈ 6e-3 against 2e-2."""
        return DEFAULT_TOLERANCES[dtype]

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """In bf16/fp16: 6 for the Triton kernel (P rounded to the cache dtype for the P·V dot, as
        FlashAttention does; ~3× measured), 10 for the torch path (``q·rowsᵀ`` returned in the cache
        dtype, so the scores are rounded before the float32 softmax; 4–8× measured on needle probes,
        growing with context, scripts/gate_matrix.py). fp32: the default 2."""
        if dtype not in (torch.float16, torch.bfloat16):
            return super().error_multiple(dtype)
        return 10.0 if self.resolve_config(config).get("kernel") == "torch" else 6.0

    def supports(self, workload: Workload) -> list[str]:
        reasons = []
        if not workload.shape.is_mla:
            reasons.append(
                f"model {workload.shape.name!r} is not MLA (no kv_lora_rank); mla needs the latent form"
            )
        if workload.dtype not in DTYPES:
            reasons.append(f"dtype {workload.dtype_name} not in (fp32, fp16, bf16)")
        return reasons

    def _kernel(self, workload: Workload, config: Mapping[str, Any]) -> str:
        """The implementation ``config`` selects on ``workload``'s device; raises if it cannot run there."""
        choice = config.get("kernel", "auto")
        mode, why = triton_mode(workload.device)
        if choice == "triton" and mode is None:
            raise ConfigError(f"backend 'mla': kernel = 'triton' cannot run on {workload.device}: {why}")
        if choice == "auto":  # float32 on a GPU: torch (the fp32 kernel uses exact, slow FMA dots)
            native_fp32 = mode == "native" and workload.dtype == torch.float32
            return "triton" if mode is not None and not native_fp32 else "torch"
        return choice

    def implementation(self, workload: Workload) -> str:
        kernel = self._kernel(workload, self.default_config())
        if kernel == "torch":
            return "torch.matmul (paged gather)"
        return f"triton split-KV ({triton_mode(workload.device)[0]})"

    def interpreted(self, workload: Workload) -> bool:
        kernel = self._kernel(workload, self.default_config())
        return kernel == "triton" and triton_mode(workload.device)[0] == "interpreted"

    def tunables_for(self, workload: Workload) -> tuple[Tunable, ...]:
        if self._kernel(workload, self.default_config()) == "torch":
            return self.tunables[:1]
        kernel = Tunable("kernel", ("triton", "torch"), "triton", self.tunables[1].doc)
        return (self.tunables[0], kernel, *self.tunables[2:])

    # -- the cache and the step ------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> PagedKVCache:
        reasons = self.supports(workload)
        if reasons:
            raise ValueError(f"backend 'mla' cannot run {workload.describe()}: {'; '.join(reasons)}")
        cfg = self.resolve_config(config)
        cache = PagedKVCache(
            workload=workload,
            geometry=workload.geometry("latent"),
            config=cfg,
            num_layers=num_layers,
            max_seq_len=max_seq_len,
            page_size=cfg["page_size"],
            page_order="random",  # a fragmented pool, as in a long-running server
            share_v=True,
        )
        kernel = self._kernel(workload, cfg)
        cache.config["implementation"] = kernel
        if kernel == "triton":
            cache.config["triton_mode"] = triton_mode(workload.device)[0]
            tile = effective_tile(cfg["tile"], workload.dtype)
            splits = cfg["num_splits"]
            if splits == 0:
                sms = _sm_count(workload.device) if cache.device.type == "cuda" else 4
                head_blocks = cdiv(cache.geometry.num_q_heads, tile.block_h)
                splits = auto_splits(
                    batch=cache.batch,
                    head_blocks=head_blocks,
                    max_seq_len=max_seq_len,
                    block_n=tile.block_n,
                    sm_count=sms,
                )
            cache.config["splits"] = splits  # fixed for the cache's life: no recompile as context grows
        return cache

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> PagedStepPlan:
        assert isinstance(cache, PagedKVCache)
        plan = cache.plan_step(num_new)
        if plan.max_new != 1:
            return plan  # prefill: the default path attends over the given rows
        g = cache.geometry
        if cache.config["implementation"] == "triton":
            splits = cache.config["splits"]
            f32 = {"dtype": torch.float32, "device": cache.device}
            plan.extra["partial_o"] = torch.empty(cache.batch, g.num_q_heads, splits, g.v_head_dim, **f32)
            plan.extra["partial_lse"] = torch.empty(cache.batch, g.num_q_heads, splits, **f32)
        else:
            pages = cdiv(max(plan.seq_lens_after), cache.page_size)
            plan.extra["pages"] = cache.block_table[:, :pages].long()  # [B, P]
            cols = torch.arange(pages * cache.page_size, device=cache.device)
            plan.extra["pad"] = (cols[None, :] >= plan.device_lens[:, None])[:, None, :]  # [B, 1, S]
        return plan

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the latent rows ``k [B, T, 1, rank + rope]``; ``v`` is their prefix and is not stored."""
        assert isinstance(cache, PagedKVCache)
        cache.write(plan, layer=layer, k=k, v=v)

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, H, rank + rope]`` (absorbed), ``k [B, 1, rank + rope]`` → latent output ``[B, H, rank]``."""
        assert isinstance(cache, PagedKVCache)
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None])
        if cache.config["implementation"] == "triton":
            return self._decode_triton(cache, plan, layer, q)
        g = cache.geometry
        b = q.shape[0]
        rows = cache.k_pages[layer][plan.extra["pages"]].view(b, -1, g.qk_head_dim)  # [B, S_pad, D]
        scores = torch.matmul(q, rows.transpose(1, 2)).float() * g.scale  # [B, H, S_pad]
        scores = scores.masked_fill(plan.extra["pad"], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(rows.dtype)
        return torch.matmul(probs, rows[..., : g.v_head_dim])  # [B, H, rank]

    def _decode_triton(
        self, cache: PagedKVCache, plan: StepPlan, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        g = cache.geometry
        tile = effective_tile(cache.config["tile"], q.dtype)
        splits = cache.config["splits"]
        b, h, dk = q.shape
        dv, dpe = g.v_head_dim, dk - g.v_head_dim
        if q.stride(-1) != 1:
            q = q.contiguous()
        kv = cache.k_pages[layer]  # [P, page_size, 1, D]
        po, plse = plan.extra["partial_o"], plan.extra["partial_lse"]
        bt = cache.block_table
        out = torch.empty(b, h, dv, dtype=q.dtype, device=q.device)
        block_dv = max(16, _next_pow2(dv))
        mode = cache.config["triton_mode"]
        partial, merge = kernel_for(_mla_decode_partial, mode), kernel_for(_mla_decode_merge, mode)
        partial[(b, cdiv(h, tile.block_h), splits)](
            q, kv, bt, plan.device_lens, po, plse, g.scale,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), bt.stride(0),
            po.stride(0), po.stride(1), po.stride(2), plse.stride(0), plse.stride(1), h,
            DV=dv, DPE=dpe, BLOCK_DV=block_dv, BLOCK_DPE=max(16, _next_pow2(dpe)),
            BLOCK_H=tile.block_h, BLOCK_N=tile.block_n, PAGE_SIZE=cache.page_size,
            NUM_SPLITS=splits, EXACT=_exact_dots(q.dtype, mode),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )  # fmt: skip
        merge[(b, h)](
            po, plse, out,
            po.stride(0), po.stride(1), po.stride(2), plse.stride(0), plse.stride(1), out.stride(0), out.stride(1),
            DV=dv, BLOCK_DV=block_dv, NUM_SPLITS=splits,
            num_warps=4,
        )  # fmt: skip
        return out


def kernel_specs(
    *, tile: str, dtype: torch.dtype, dv: int = 512, dpe: int = 64, page_size: int = 64, num_splits: int = 8
) -> list[dict[str, Any]]:
    """Keyword arguments of :func:`attnbench.triton_utils.aot_compile` for both kernels (``kernel``,
    ``signature``, ``constexprs``, ``aligned``, ``num_warps``, ``num_stages``) for one tile and dtype.

    Defaults are DeepSeek-V3's latent dims; the tests compile every tile for sm_80 and sm_90.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    t = effective_tile(tile, dtype)
    ty = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    block_dv = max(16, _next_pow2(dv))
    pointers = {"Q": f"*{ty}", "KV": f"*{ty}", "BlockTable": "*i32", "SeqLens": "*i32", "Out": f"*{ty}"}
    pointers |= {"PartialO": "*fp32", "PartialLse": "*fp32"}
    partial_const = {
        "DV": dv, "DPE": dpe, "BLOCK_DV": block_dv, "BLOCK_DPE": max(16, _next_pow2(dpe)), "BLOCK_H": t.block_h,
        "BLOCK_N": t.block_n, "PAGE_SIZE": page_size, "NUM_SPLITS": num_splits, "EXACT": dtype == torch.float32,
    }  # fmt: skip
    merge_const = {"DV": dv, "BLOCK_DV": block_dv, "NUM_SPLITS": num_splits}

    def spec(kernel: Any, const: dict[str, Any], num_warps: int, num_stages: int) -> dict[str, Any]:
        names = kernel_for(kernel, "native").arg_names
        types = {
            n: "constexpr" if n in const else pointers.get(n, "fp32" if n == "scale" else "i32")
            for n in names
        }
        # what the JIT sees at run time for DeepSeek-V3 dims: 16-byte aligned pointers, strides of 16k
        aligned = [n for n in names if n in pointers or n in _ALIGNED]
        return {"kernel": kernel, "signature": types, "constexprs": const, "aligned": aligned,
                "num_warps": num_warps, "num_stages": num_stages}  # fmt: skip

    return [
        spec(_mla_decode_partial, partial_const, t.num_warps, t.num_stages),
        spec(_mla_decode_merge, merge_const, 4, 1),
    ]


# integer arguments that are multiples of 16 for DeepSeek-V3 (576-wide rows, 512-wide outputs, 128 heads)
_ALIGNED = {"stride_qb", "stride_qh", "stride_kvp", "stride_kvt", "stride_pob", "stride_poh", "stride_pos"}
_ALIGNED |= {"stride_ob", "stride_oh", "num_heads"}


__all__ = ["TILES", "MLABackend", "Tile", "auto_splits", "effective_tile", "kernel_specs"]
