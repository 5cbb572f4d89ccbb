"""How vLLM's CPU cache stores fp8, restated in torch for the correctness gate's stored reference.

``cpu_attn_reshape_and_cache`` with ``kv_cache_dtype="fp8_e4m3"`` (vLLM's ``float_to_fp8e4m3_scalar``
in ``csrc/cpu/cpu_attn_fp8.hpp``) divides by the scale, clamps to ±448 and keeps the top three
mantissa bits: it *truncates* toward zero instead of rounding to nearest, so its error is up to one
fp8 step (twice torch's ``.to(torch.float8_e4m3fn)``) and biased toward zero. Below the smallest
normal (2⁻⁶) the same truncation lands on the subnormal grid (multiples of 2⁻⁹). The gate compares
the kernel's output against float64 attention over these values (``stored_tolerance``) and, with
the looser ``tolerance``, against the exact inputs.
"""

from __future__ import annotations

import torch

from attnbench.core.backend import Tolerance

_MANTISSA_BITS = 3
_MIN_NORMAL = 2.0**-6
_MAX = 448.0

#: against the exact float64 reference: the fp8 truncation itself (N(0, 1) inputs, unit scale). The
#: truncation shrinks every value toward zero, a bias that averaging over tokens does not cancel:
#: rel_l2 reaches 0.12-0.15 on the gate's needle probes, against < 0.09 for the round-to-nearest
#: built-in ``fp8`` (whose bound is 0.09).
FP8_EXACT_TOLERANCE = Tolerance(max_abs=0.6, rel_l2=0.25, min_cosine=0.99)
#: against float64 attention over the stored (truncated) values: only the kernel's arithmetic
FP8_STORED_TOLERANCE = {
    torch.float32: Tolerance(max_abs=2e-5, rel_l2=1e-5, min_cosine=0.999_999),
    torch.float16: Tolerance(max_abs=1e-2, rel_l2=3e-3, min_cosine=0.999_95),
    torch.bfloat16: Tolerance(max_abs=4e-2, rel_l2=2e-2, min_cosine=0.999),
}


def stored_fp8(x: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``x`` as vLLM's CPU fp8 (e4m3) cache holds it, dequantised, in float64."""
    v = (x.float() * (1.0 / scale)).clamp(-_MAX, _MAX)
    a = v.abs()
    normal = (a.view(torch.int32) & ~((1 << (23 - _MANTISSA_BITS)) - 1)).view(torch.float32)
    step = _MIN_NORMAL * 2.0**-_MANTISSA_BITS
    sub = torch.floor(a / step) * step
    return (torch.sign(v) * torch.where(a >= _MIN_NORMAL, normal, sub)).double() * scale
