"""fp8 (``float8_e4m3fn``) K/V storage: scales, quantise, dequantise, and the paged fp8 cache.

Two scale granularities:

- ``"token_head"`` (default): one float32 scale per token and KV head, computed when the token is
  appended (``scale = amax(|row|) / 448``), so no calibration is needed and one outlier token cannot
  spoil the others. An all-zero row gets the smallest normal float32 as its scale and is stored as
  zeros (never ``0 / 0``).
- ``"tensor"``: one static scale per cache tensor (vLLM's ``k_scale``/``v_scale``; 1.0 when a
  checkpoint carries none). Values beyond ``±448 · scale`` saturate to ``±448 · scale``.

:class:`FP8KVCache` is the paged cache that stores rows this way (used by ``backends/fp8.py``).

Both reject non-finite input: :func:`quantize` returns the per-row ``amax`` so that callers can test
``isfinite`` without a second pass over the data (see :class:`NonFiniteKVError`).

Storing ``x`` as ``q = fp8(x / s)`` and reading it back as ``q · s`` is the whole contract; the
float64 reference of a quantised cache is :func:`dequantize` of the very bytes :func:`quantize`
produced, so the "stored" comparison measures attention, not rounding luck.

The byte trick used by kernels that cannot convert fp8 in hardware (sm_80, CPUs): an e4m3 byte
``s eeee mmm`` placed as the fp16 bit pattern ``s 0eeee mmm0000000`` is exactly the e4m3 value
divided by 2**8, subnormals included (:func:`fp8_bits_to_fp16`); the 2**8 is folded into the scale.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from attnbench.core.backend import StepPlan
from attnbench.kernels.paged import PagedKVCache, PagedStepPlan, cdiv

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP16_BIAS",
    "GRANULARITIES",
    "FP8KVCache",
    "NonFiniteKVError",
    "check_finite",
    "dequantize",
    "fp8_bits_to_fp16",
    "quantize",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_BIAS = 256.0  # fp8_bits_to_fp16(q) * FP16_BIAS == q, exactly
GRANULARITIES = ("token_head", "tensor")
_TINY = torch.finfo(torch.float32).tiny  # scale of an all-zero row: x / tiny == 0, never 0 / 0


class NonFiniteKVError(ValueError):
    """K or V given to an fp8 cache holds NaN or inf (they have no fp8 encoding worth storing)."""


def quantize(
    x: torch.Tensor, *, granularity: str = "token_head", static_scale: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise rows of ``x [..., D]`` to fp8.

    Returns ``(q, scale, amax)``: ``q [..., D]`` ``float8_e4m3fn``; ``scale`` float32, ``[...]`` for
    ``"token_head"`` and the static scale as a 0-d tensor for ``"tensor"``; ``amax [...]`` float32,
    the per-row max magnitude (non-finite iff the row holds NaN or inf; such rows are quantised as
    zeros, so that nothing non-finite is ever stored). Allocates; no host sync.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    ok = torch.isfinite(amax)
    xf = torch.where(ok[..., None], xf, 0.0)  # a refused row is stored as zeros, never as NaN bytes
    if granularity == "token_head":
        scale = (torch.where(ok, amax, 0.0) / FP8_MAX).clamp_min(_TINY)
        q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    elif granularity == "tensor":
        if isinstance(static_scale, float | int) and not static_scale > 0:
            raise ValueError(f"static_scale = {static_scale!r}: need a positive number")
        scale = torch.as_tensor(static_scale, dtype=torch.float32, device=x.device).reshape(())
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        raise ValueError(f"scale granularity {granularity!r} not in {GRANULARITIES}")
    return q, scale, amax


def dequantize(q: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``q [..., D]`` fp8 times ``scale`` (``[...]`` per row, or 0-d) in ``dtype`` (float64: the reference)."""
    s = scale.to(dtype)
    return q.to(dtype) * (s[..., None] if s.dim() else s)


def check_finite(amax: torch.Tensor, *, what: str) -> None:
    """Raise :class:`NonFiniteKVError` if any row's ``amax`` is NaN or inf (one host sync)."""
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        n = int(bad.sum())
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise NonFiniteKVError(
            f"{what}: {n} of {amax.numel()} rows hold NaN or inf (first at index {first}); "
            "an fp8 cache accepts finite values only"
        )


def fp8_bits_to_fp16(q: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 e4m3 bytes → float16 values equal to ``q / 256`` (exact), by integer ops only.

    ``q``: ``float8_e4m3fn`` (or its ``int8`` view), any shape. ``out``: optional int16 buffer of
    ``q``'s shape to fill (no allocation then); returned viewed as float16. Sign-extending the byte
    to int16 and shifting left by 7 puts sign/exponent/mantissa where fp16 keeps them, except that
    the sign is copied into bit 14 (the exponent's top bit), which the mask clears.
    """
    b = q.view(torch.int8) if q.dtype == FP8_DTYPE else q
    if out is None:
        out = b.to(torch.int16)
    else:
        out.copy_(b)
    out.bitwise_left_shift_(7).bitwise_and_(-16385)  # ~0x4000 as int16
    return out.view(torch.float16)


class FP8KVCache(PagedKVCache):
    """Paged fp8 K/V with float32 scales (see the module docstring for the layout).

    ``granularity``: ``"token_head"`` (a scale per token and KV head, computed on append) or
    ``"tensor"`` (``static_scale`` for every K and V tensor of every layer). ``implementation``: the
    attention path that reads it, ``"triton"`` (it gets the split-KV state, ``split_kv``) or
    ``"torch"`` (it gets the gather buffers below, sized for one layer of every sequence at
    ``max_seq_len``). Everything is allocated here, once.
    """

    implementation: str  # "triton" or "torch"
    page_index: torch.Tensor  # torch path: [B * pages_per_seq] int64, the step's pages
    pad_buffer: torch.Tensor  # torch path: [B * pages_per_seq * page_size] bool, the step's mask
    columns: torch.Tensor  # torch path: arange(pages_per_seq * page_size)
    gather_bytes: dict[str, torch.Tensor]  # torch path: "k"/"v" → flat int8, one layer's gathered bytes
    gather_fp16: dict[str, torch.Tensor]  # torch path: "k"/"v" → flat int16, the same as fp16 bit patterns

    def __init__(
        self,
        *,
        page_size: int,
        granularity: str = "token_head",
        static_scale: float = 1.0,
        page_order: Literal["sequential", "random"] = "random",
        implementation: str = "torch",
        **base: Any,
    ) -> None:
        super().__init__(
            **base,
            page_size=page_size,
            page_order=page_order,
            kv_dtype=FP8_DTYPE,
        )
        if granularity not in GRANULARITIES:
            raise ValueError(f"fp8 cache: scale granularity {granularity!r} not in {GRANULARITIES}")
        if not static_scale > 0 or not math.isfinite(static_scale):
            raise ValueError(f"fp8 cache: static_scale = {static_scale!r} must be a finite number > 0")
        geometry, num_layers = self.geometry, self.num_layers
        self.granularity = granularity
        self.static_scale = float(static_scale)
        f32: dict[str, Any] = {"dtype": torch.float32, "device": self.device}
        if granularity == "token_head":
            shape = (num_layers, self.num_pages, page_size, geometry.num_kv_heads)
            self.k_scales = torch.zeros(shape, **f32)
            self.v_scales = torch.zeros(shape, **f32)
        else:
            self.k_scales = torch.full((num_layers,), self.static_scale, **f32)
            self.v_scales = torch.full((num_layers,), self.static_scale, **f32)
        self.nonfinite = torch.zeros(num_layers, dtype=torch.bool, device=self.device)  # deferred check
        if implementation not in ("triton", "torch"):
            raise ValueError(f"fp8 cache: implementation = {implementation!r} not in ('triton', 'torch')")
        self.implementation = implementation
        if implementation == "torch":
            tokens = self.batch * self.pages_per_seq * page_size
            dev: dict[str, Any] = {"device": self.device}
            self.page_index = torch.zeros(self.batch * self.pages_per_seq, dtype=torch.int64, **dev)
            self.pad_buffer = torch.zeros(tokens, dtype=torch.bool, **dev)
            self.columns = torch.arange(self.pages_per_seq * page_size, **dev)
            dims = {"k": geometry.qk_head_dim, "v": geometry.v_head_dim}
            n = {name: tokens * geometry.num_kv_heads * d for name, d in dims.items()}
            self.gather_bytes = {name: torch.empty(n[name], dtype=torch.int8, **dev) for name in dims}
            self.gather_fp16 = {name: torch.empty(n[name], dtype=torch.int16, **dev) for name in dims}

    def store(
        self, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor, defer_check: bool
    ) -> None:
        """Quantise ``k [B, T, Hkv, Dk]``/``v [B, T, Hkv, Dv]`` (right-padded) and write bytes and scales.

        ``defer_check=False``: refuse non-finite rows now (one host sync; nothing is stored).
        ``defer_check=True``: no sync; flag the layer and let :meth:`commit` raise.
        """
        assert isinstance(plan, PagedStepPlan) and plan.slots is not None
        kw: dict[str, Any] = {"granularity": self.granularity, "static_scale": self.static_scale}
        kq, ks, kmax = quantize(k, **kw)
        vq, vs, vmax = quantize(v, **kw)
        amax = torch.stack([kmax, vmax], -1)  # [B, T, Hkv, 2]
        if defer_check:  # device-side only (capturable); commit() of a decode step checks the flags
            self.nonfinite[layer].logical_or_(~torch.isfinite(amax).all())
        else:
            rows = (
                torch.arange(amax.shape[1], device=amax.device)[None, :] < torch.tensor(plan.num_new)[:, None]
            )
            check_finite(amax[rows.to(amax.device)], what=f"fp8 cache layer {layer} (K/V rows)")
        writes = [(self.k_pages, kq), (self.v_pages, vq)]  # fp8 has no index_copy_ on CPU: copy bytes
        if self.granularity == "token_head":
            writes += [(self.k_scales, ks[..., None]), (self.v_scales, vs[..., None])]
        hkv = self.geometry.num_kv_heads
        for pages, new in writes:
            dst = pages[layer]
            if dst.dtype == FP8_DTYPE:
                dst, new = dst.view(torch.uint8), new.view(torch.uint8)
            flat = new.reshape(-1, hkv, new.shape[-1])
            if plan.src is not None:
                flat = flat.index_select(0, plan.src)
            dst.view(-1, hkv, new.shape[-1]).index_copy_(0, plan.slots, flat)

    def commit(self, plan: StepPlan) -> None:
        # decode stored with defer_check: one host sync per step, not per layer
        if plan.max_new == 1 and bool(self.nonfinite.any()):
            layers = self.nonfinite.nonzero().flatten().tolist()
            self.nonfinite.zero_()
            raise NonFiniteKVError(
                f"fp8 cache: decode K/V of layer(s) {layers} held NaN or inf at positions "
                f"{list(plan.positions)} (stored as zeros; the step's outputs are not valid)"
            )
        super().commit(plan)

    def read(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of ``seq`` as stored, dequantised to the compute dtype."""
        k, v = self.dequantized(layer, seq, length)
        return k.to(self.dtype), v.to(self.dtype)

    def dequantized(
        self, layer: int, seq: int, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``k [S, Hkv, Dk]``, ``v [S, Hkv, Dv]`` of one sequence as stored (default: all of it)."""
        n = self.seq_lens[seq] if length is None else length
        k, v = self.gather(layer, seq, n)
        if self.granularity == "tensor":
            return dequantize(k, self.k_scales[layer]), dequantize(v, self.v_scales[layer])
        pages = torch.tensor(
            self.pages[seq][: cdiv(n, self.page_size)], dtype=torch.int64, device=self.device
        )
        ks = self.k_scales[layer].index_select(0, pages).flatten(0, 1)[:n]
        vs = self.v_scales[layer].index_select(0, pages).flatten(0, 1)[:n]
        return dequantize(k, ks), dequantize(v, vs)

    def scale_bytes_per_token(self) -> int:
        if self.granularity == "tensor":
            return 0  # two floats per layer in all, not per token
        return 2 * self.geometry.num_kv_heads * 4 * self.num_layers

    def bytes_per_token(self) -> int:
        """fp8 K/V bytes plus the float32 scales, over all layers."""
        return super().bytes_per_token() + self.scale_bytes_per_token()

    def nbytes(self) -> int:
        return super().nbytes() + self.k_scales.nbytes + self.v_scales.nbytes
