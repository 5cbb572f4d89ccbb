"""``fp8`` — a float8 (e4m3) paged KV cache with scales, dequantised on the fly.

The cache (:class:`attnbench.kernels.fp8_cache.FP8KVCache`) is a :class:`attnbench.kernels.paged.PagedKVCache` whose pages
hold ``float8_e4m3fn`` bytes, plus float32 scales written with each token:

    k_pages, v_pages:     [L, P, page_size, Hkv, D]  float8_e4m3fn
    k_scales, v_scales:   [L, P, page_size, Hkv]     float32   (scale "token_head", the default)
                          [L]                        float32   (scale "tensor": a static scale)

Per token-head scales need no calibration and cost 8 bytes per token, head and layer next to the
``2 · D`` fp8 bytes: 264 bytes instead of bf16's 512 for head_dim 128 (0.52×).

Two attention paths, and ``implementation()`` says which one runs:

- ``triton`` (CUDA; on the CPU only under ``TRITON_INTERPRET=1``, where it is checked, never timed):
  the split-KV family kernel of :mod:`attnbench.kernels.triton_decode` with ``KV_FP8`` (grid
  ``(B, Hkv, splits)``, one K/V tile load per GQA group, online softmax), reading the fp8 *bytes*
  (half of bf16's traffic). Bytes are turned into fp16 by integer ops (``s eeee mmm`` →
  ``s 0eeee mmm0000000`` is the value / 256, exactly), because sm_80 has no fp8 type; scales (× 256)
  multiply the scores and the probabilities, so a K/V tile is never rescaled element by element.
  The family's merge combines the splits by their log-sum-exp.
- ``torch`` (everywhere; what runs and is timed on the CPU): gathers the step's pages into int16
  buffers the cache owns, applies the same byte trick (three in-place integer passes; torch's own
  fp8 → bf16 conversion runs in software on CPUs, several times slower), then fp16 matmuls with a
  float32 softmax (fp32 matmuls for fp32 workloads). The query is normalised per head so fp16 cannot
  overflow.

Prefill writes the prompt's quantised K/V into the pages and attends in the compute dtype on the
given (unquantised) K/V. Non-finite K/V are refused: in ``append``/prefill at once (one host sync,
nothing stored); in ``decode`` a per-layer device flag is raised (no host sync per layer, the row
is stored as zeros) and :meth:`FP8KVCache.commit` of a decode step raises, one sync per step.

Which call does what: ``create_cache`` allocates everything once (pages, scales, the plan's buffers,
the split partials or the torch path's gather buffers); ``plan()`` is host work once per step that
fills them in place (no device allocation); ``decode()`` does no host-device sync. The Triton path
is **capturable** (lengths from the device, split count fixed per context bucket; it allocates only
its output and the new token's quantised rows); the torch path slices to the step's longest
sequence, so it is not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from attnbench.core.backend import Backend, KVCache, Resolution, StepPlan, Tolerance, Tunable
from attnbench.core.workload import Workload
from attnbench.kernels.fp8_cache import (
    FP16_BIAS,
    GRANULARITIES,
    FP8KVCache,
    dequantize,
    fp8_bits_to_fp16,
    quantize,
)
from attnbench.kernels.paged import PagedStepPlan, cdiv
from attnbench.kernels.split_kv import SplitKVPlan, attach_split_kv, decode_split_kv, plan_split_kv
from attnbench.kernels.triton_decode import DecodeSpec
from attnbench.kernels.triton_utils import TritonMode, triton_mode

# -- the search space, as data ------------------------------------------------------------------------
PAGE_SIZES = (16, 32, 64, 128, 256)
NUM_SPLITS = (0, 1, 2, 4, 8, 16)  # 0: chosen per context bucket to fill the device (triton path only)
BLOCK_N = (16, 32, 64)  # tokens per K/V tile (triton path only)
NUM_WARPS = {16: 4, 32: 4, 64: 4}  # by block_n
NUM_STAGES = 2
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# -- accuracy, as data (how these were chosen: docs/fp8.md, scripts/fp8_accuracy.py) ---------------
#: against the exact float64 reference: the fp8 rounding itself (any compute dtype)
EXACT_TOLERANCE = Tolerance(max_abs=0.5, rel_l2=0.2, min_cosine=0.98)
#: against float64 attention over the dequantised bytes: only the attention arithmetic
STORED_TOLERANCE = {
    torch.float32: Tolerance(max_abs=2e-5, rel_l2=1e-5, min_cosine=0.999_999),
    torch.float16: Tolerance(max_abs=1e-2, rel_l2=3e-3, min_cosine=0.999_95),
    torch.bfloat16: Tolerance(max_abs=2e-2, rel_l2=5e-3, min_cosine=0.999_9),
}


@dataclass
class FP8TorchPlan(PagedStepPlan):
    """The torch path's plan: prefix views of the cache's buffers, sized by the step's longest sequence."""

    pages: torch.Tensor | None = None  # [B * n_pages] int64: the step's pages, sequence by sequence
    masked: torch.Tensor | None = None  # [B, 1, 1, S] bool: True past each sequence's length
    k8: torch.Tensor | None = field(default=None, metadata={"scratch": True})  # gathered bytes
    v8: torch.Tensor | None = field(default=None, metadata={"scratch": True})
    k16: torch.Tensor | None = field(default=None, metadata={"scratch": True})  # as fp16 bit patterns
    v16: torch.Tensor | None = field(default=None, metadata={"scratch": True})


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
    page_order: ClassVar[Literal["sequential", "random"]] = "random"
    #: the Triton path's decode steps replay as CUDA graphs (the torch path's do not)
    capturable: ClassVar[bool] = True

    # -- availability ----------------------------------------------------------------------------
    def _path(self, workload: Workload) -> tuple[str, list[str]]:
        """Which attention path runs ``workload`` ("triton" or "torch"), and why it cannot."""
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

    def resolve(self, workload: Workload, config: Mapping[str, Any] | None = None) -> Resolution:
        """Speed knobs only are tunables: ``scale`` changes the numerics, so it is chosen, never tuned."""
        path, reasons = self._path(workload)
        mode = triton_mode(workload.device)[0]
        triton_path = path == "triton"
        keep = ("page_size", "num_splits", "block_n") if triton_path else ("page_size",)
        return self.resolution(
            workload,
            config,
            reasons=reasons,
            implementation=f"triton[{mode}]" if triton_path else "torch (fp8 bytes → fp16 matmul)",
            interpreted=triton_path and mode == "interpreted",
            tunables=tuple(t for t in self.tunables if t.name in keep),
        )

    def kv_bytes_per_token(self, workload: Workload, *, config: Mapping[str, Any]) -> int:
        """One byte per K/V value plus, unless one scale serves the tensor, two float32 scales per KV head."""
        shape = workload.shape
        scales = 0 if config["scale"] == "tensor" else 2 * workload.geometry(self.kv_form).num_kv_heads * 4
        return shape.kv_bytes_per_token("fp8", "expanded") + scales * shape.num_layers

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
        """Allocates the pages, scales and every per-step buffer, once (the only call that allocates)."""
        res = self.resolve(workload, config).require()
        cfg = dict(res.config)
        path = "triton" if res.implementation.startswith("triton") else "torch"
        g = workload.geometry(self.kv_form)
        cache = FP8KVCache(
            **self.cache_fields(workload, cfg, num_layers, max_seq_len),
            page_size=cfg["page_size"],
            granularity=cfg["scale"],
            static_scale=self.static_scale,
            page_order=self.page_order,
            implementation=path,
        )
        if path == "triton":
            spec = DecodeSpec(
                group=g.group_size, dk=g.qk_head_dim, dv=g.v_head_dim, page_size=cfg["page_size"],
                block_n=cfg["block_n"], kv_fp8=True, num_warps=NUM_WARPS[cfg["block_n"]], num_stages=NUM_STAGES,
            )  # fmt: skip
            mode: TritonMode = "interpreted" if res.interpreted else "native"
            attach_split_kv(
                cache, spec=spec, mode=mode, num_splits=cfg["num_splits"], max_splits=max(NUM_SPLITS)
            )
        return cache

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> PagedStepPlan:
        """Host work once per step, into the cache's buffers (no device allocation)."""
        assert isinstance(cache, FP8KVCache)
        if cache.implementation == "triton":
            return plan_split_kv(cache, num_new)
        return _plan_torch(cache, cache.plan_step(num_new))

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(cache, FP8KVCache)
        cache.store(plan, layer=layer, k=k, v=v, defer_check=False)

    # -- the step --------------------------------------------------------------------------------
    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, Dk]``, new ``k [B, Hkv, Dk]``/``v [B, Hkv, Dv]`` → ``[B, Hq, Dv]``. No host sync."""
        assert isinstance(cache, FP8KVCache)
        cache.store(plan, layer=layer, k=k[:, None], v=v[:, None], defer_check=True)
        if isinstance(plan, SplitKVPlan):
            return _decode_triton(cache, plan, layer, q)
        assert isinstance(plan, FP8TorchPlan)
        return _decode_torch(cache, plan, layer, q)


def _decode_triton(cache: FP8KVCache, plan: SplitKVPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
    kp, vp = cache.k_pages[layer].view(torch.uint8), cache.v_pages[layer].view(torch.uint8)
    if cache.granularity == "token_head":
        ks, vs = cache.k_scales[layer], cache.v_scales[layer]
        strides = ks.stride()[:3]
    else:
        ks, vs = cache.k_scales[layer : layer + 1], cache.v_scales[layer : layer + 1]
        strides = (0, 0, 0)
    return decode_split_kv(
        cache, plan, q=q, k_pages=kp, v_pages=vp, k_scales=ks, v_scales=vs, scale_strides=strides
    )


# -- torch path -----------------------------------------------------------------------------------------
def _plan_torch(cache: FP8KVCache, base: PagedStepPlan) -> FP8TorchPlan:
    g, b = cache.geometry, cache.batch
    n_pages = cdiv(max(base.seq_lens_after), cache.page_size)
    s = n_pages * cache.page_size
    pages = cache.page_index[: b * n_pages]
    pages.view(b, n_pages).copy_(cache.block_table[:, :n_pages])
    masked = cache.pad_buffer[: b * s].view(b, 1, 1, s)
    torch.ge(cache.columns[None, :s], base.device_lens[:, None], out=masked[:, 0, 0])
    views: dict[str, torch.Tensor] = {}
    for name, d in (("k", g.qk_head_dim), ("v", g.v_head_dim)):
        n = b * s * g.num_kv_heads * d
        views[f"{name}8"] = cache.gather_bytes[name][:n].view(b * n_pages, cache.page_size, -1)
        views[f"{name}16"] = cache.gather_fp16[name][:n].view(b, g.num_kv_heads, s, d)
    return base.extend(FP8TorchPlan, pages=pages, masked=masked, **views)


def _dequant_pages(cache: FP8KVCache, plan: FP8TorchPlan, layer: int, name: str, work: torch.dtype):
    """Gather one layer's K or V pages of the step → ``[B, Hkv, S, D]`` in ``work`` (value / 256)."""
    pages = cache.k_pages if name == "k" else cache.v_pages
    raw = pages[layer].view(torch.int8).flatten(2)  # [P, page_size, Hkv * D]
    assert plan.pages is not None
    gathered = torch.index_select(raw, 0, plan.pages, out=getattr(plan, f"{name}8"))
    out16 = getattr(plan, f"{name}16")
    b, hkv, s, d = out16.shape
    vals = fp8_bits_to_fp16(gathered.view(b, s, hkv, d).transpose(1, 2), out=out16)
    return vals if work == torch.float16 else vals.to(work)


def _gather_scales(cache: FP8KVCache, plan: FP8TorchPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scales ``[B, Hkv, 1, S]`` (float32), or the static 0-d scales."""
    if cache.granularity == "tensor":
        return cache.k_scales[layer], cache.v_scales[layer]
    b, hkv = cache.batch, cache.geometry.num_kv_heads
    idx = plan.pages
    assert idx is not None
    ks = cache.k_scales[layer].index_select(0, idx).view(b, -1, hkv).transpose(1, 2)[:, :, None, :]
    vs = cache.v_scales[layer].index_select(0, idx).view(b, -1, hkv).transpose(1, 2)[:, :, None, :]
    return ks, vs


#: Scale of the fp16 attention weights in the torch path (see :func:`_decode_torch`).
_P_LIFT = 2.0**13


def _decode_torch(cache: FP8KVCache, plan: FP8TorchPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
    assert plan.masked is not None
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
    scores = scores.masked_fill(plan.masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    v_max = vs.amax(-1, keepdim=True) if vs.dim() else vs  # keep fp16 weights ≤ 1
    # × 2^13 so that small probabilities stay in fp16's normal range (at 128k context a background
    # token's is ~2e-6, an fp16 subnormal with a few bits left); the output stays ≤ 2^13 · 448/256
    lift = 1.0 if work == torch.float32 else _P_LIFT
    weights = (probs * (vs / v_max) * lift).to(work)
    out = torch.matmul(weights, values).float() * (v_max * (FP16_BIAS / lift))  # [B, Hkv, G, Dv]
    return out.to(q.dtype).view(b, g.num_q_heads, g.v_head_dim)
