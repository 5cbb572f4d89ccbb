"""fp8 (``float8_e4m3fn``) quantisation of K/V rows: scales, quantise, dequantise.

Two scale granularities:

- ``"token_head"`` (default): one float32 scale per token and KV head, computed when the token is
  appended (``scale = amax(|row|) / 448``), so no calibration is needed and one outlier token cannot
  spoil the others. An all-zero row gets the smallest normal float32 as its scale and is stored as
  zeros (never ``0 / 0``).
- ``"tensor"``: one static scale per cache tensor (vLLM's ``k_scale``/``v_scale``; 1.0 when a
  checkpoint carries none). Values beyond ``±448 · scale`` saturate to ``±448 · scale``.

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

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP16_BIAS",
    "GRANULARITIES",
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
