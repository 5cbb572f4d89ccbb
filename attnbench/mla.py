"""MLA (DeepSeek-V2/V3 multi-head latent attention): weight absorption and the decode roofline.

MLA caches, per token and layer, one compressed latent ``c`` (``kv_lora_rank``) and one decoupled RoPE
key ``k_pe`` (``qk_rope_head_dim``) shared by all heads. ``kv_b_proj`` decompresses the latent into
per-head keys and values: ``k_nope[h] = W_UK[h] @ c`` and ``v[h] = W_UV[h] @ c``. Because

    q_nope[h] · k_nope[h] = (W_UK[h]^T q_nope[h]) · c        and        Σ p · v[h] = W_UV[h] (Σ p · c),

decode can attend over the latent directly (the *absorbed* form): the query becomes
``[W_UK^T q_nope | q_pe]`` (``kv_lora_rank + qk_rope_head_dim``), every head attends to the one shared
row ``[c | k_pe]`` (like MQA), the value is ``c`` itself, and ``W_UV`` is applied to the output.
The softmax scale stays ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``.

Weight layout (as in transformers' ``DeepseekV3Attention``): ``kv_b_proj.weight`` is
``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``; :func:`split_kv_b` gives
``w_uk [H, qk_nope_head_dim, kv_lora_rank]`` and ``w_uv [H, v_head_dim, kv_lora_rank]``.

The second half of the module is the roofline of one decode step. Absorbed MLA does
``2 · H · (Dk + Dv)`` FLOPs per cached token and head over a row of ``Dk`` values read once for all
``H`` heads, so with 128 heads its arithmetic intensity (~240 FLOP/B in bf16) passes the ridge point of
several GPUs: it can be compute-bound, unlike the expanded form (~1 FLOP/B). :func:`decode_roofline`
says which bound applies for a workload on a device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from attnbench.shapes import dtype_bytes
from attnbench.workload import Workload

__all__ = [
    "DecodeCost",
    "Roofline",
    "absorb_query",
    "decode_cost",
    "decode_roofline",
    "expand_kv",
    "expand_output",
    "latent_query",
    "measure_matmul_flops",
    "split_kv_b",
]


# -- weight absorption ----------------------------------------------------------------------------
def split_kv_b(
    weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [H·(nope+v), rank]`` → ``w_uk [H, nope, rank]``, ``w_uv [H, v, rank]`` (views)."""
    per_head = qk_nope_head_dim + v_head_dim
    if weight.dim() != 2 or weight.shape[0] != num_heads * per_head:
        raise ValueError(
            f"kv_b_proj weight of shape {tuple(weight.shape)}: expected [{num_heads} * {per_head}, kv_lora_rank]"
        )
    w = weight.view(num_heads, per_head, weight.shape[1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Fold the key up-projection into the query: ``q_nope [..., H, nope]`` → ``[..., H, rank]``.

    ``w_uk [H, nope, rank]``. Computed in the inputs' dtype (cast them to float64 for a reference).
    """
    return torch.einsum("...hn,hnr->...hr", q_nope, w_uk)


def latent_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed decode query ``[W_UK^T q_nope | q_pe]``: ``[..., H, rank + rope]``."""
    return torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)


def expand_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Apply the value up-projection: ``out_latent [..., H, rank]`` → ``[..., H, v]``; ``w_uv [H, v, rank]``."""
    return torch.einsum("...hr,hvr->...hv", out_latent, w_uv)


def expand_kv(
    latent: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decompress the latent cache into per-head K/V, as transformers caches them (the expanded form).

    ``latent [..., S, rank]``, ``k_pe [..., S, rope]`` → ``k [..., S, H, nope + rope]``,
    ``v [..., S, H, v]``; the RoPE key is shared by every head.
    """
    k_nope = torch.einsum("...sr,hnr->...shn", latent, w_uk)
    k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], k_pe.shape[-1])
    v = torch.einsum("...sr,hvr->...shv", latent, w_uv)
    return torch.cat([k_nope, k_pe], dim=-1), v


# -- roofline ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeCost:
    """Work of one decode step of attention, over all layers.

    ``kv_bytes`` the cache read (every cached token once, the new one included); ``io_bytes`` the
    query read and output written; ``flops`` the attention matmuls (``QK^T`` and ``PV``). With
    ``projections=True`` the latent form also counts the absorption matmuls (``W_UK`` on the query,
    ``W_UV`` on the output) and the read of their weights (``weight_bytes``), which the batch shares.
    """

    form: str
    kv_bytes: int
    io_bytes: int
    weight_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.kv_bytes + self.io_bytes + self.weight_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0


def decode_cost(
    workload: Workload,
    *,
    form: Literal["expanded", "latent", "auto"] = "auto",
    projections: bool = False,
    kv_dtype: torch.dtype | str | None = None,
) -> DecodeCost:
    """FLOPs and bytes of one decode step of ``workload`` in geometry ``form`` (``auto``: latent for MLA).

    Works for any shape (for GQA ``form`` is ``expanded``); ``kv_dtype`` overrides the cache's dtype.
    """
    shape = workload.shape
    if form == "auto":
        form = "latent" if shape.is_mla else "expanded"
    g = workload.geometry(form)
    act = dtype_bytes(workload.dtype)
    b, layers = workload.batch, shape.num_layers
    attended = workload.total_tokens + b  # every sequence also attends to its new token
    flops = 2 * g.num_q_heads * (g.qk_head_dim + g.v_head_dim) * attended * layers
    io = b * g.num_q_heads * (g.qk_head_dim + g.v_head_dim) * act * layers
    weight_bytes = 0
    if projections and form == "latent":
        nope, v, rank = shape.qk_nope_head_dim, shape.v_head_dim, shape.kv_lora_rank
        flops += 2 * b * g.num_q_heads * rank * (nope + v) * layers  # type: ignore[operator]
        weight_bytes = g.num_q_heads * rank * (nope + v) * act * layers  # type: ignore[operator]
    kv = workload.kv_bytes_per_step(form, kv_dtype=kv_dtype)
    return DecodeCost(form=form, kv_bytes=kv, io_bytes=io, weight_bytes=weight_bytes, flops=flops)


@dataclass(frozen=True)
class Roofline:
    """Lower bounds on a step's time: ``memory_s = bytes / bandwidth``, ``compute_s = flops / peak``."""

    form: str
    bytes: int
    flops: int
    intensity: float  # FLOP/B of the step
    ridge: float  # FLOP/B where the device turns compute-bound (peak_flops / bandwidth)
    memory_s: float
    compute_s: float

    @property
    def bound(self) -> Literal["memory", "compute"]:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def floor_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"bound": self.bound, "floor_s": self.floor_s}


def decode_roofline(
    workload: Workload,
    *,
    bandwidth: float,
    peak_flops: float,
    form: Literal["expanded", "latent", "auto"] = "auto",
    projections: bool = False,
    kv_dtype: torch.dtype | str | None = None,
) -> Roofline:
    """Which bound applies to a decode step of ``workload`` on a device of ``bandwidth`` (bytes/s) and
    ``peak_flops`` (FLOP/s in the workload's dtype).

    Example (DeepSeek-V3, absorbed, on an H100 SXM's dense bf16 peak)::

        >>> w = Workload.uniform("deepseek-v3", batch=64, context="4k")
        >>> decode_roofline(w, bandwidth=3.35e12, peak_flops=989e12).bound
        'memory'
    """
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth = {bandwidth!r} and peak_flops = {peak_flops!r} must both be > 0")
    cost = decode_cost(workload, form=form, projections=projections, kv_dtype=kv_dtype)
    return Roofline(
        form=cost.form,
        bytes=cost.bytes,
        flops=cost.flops,
        intensity=cost.intensity,
        ridge=peak_flops / bandwidth,
        memory_s=cost.bytes / bandwidth,
        compute_s=cost.flops / peak_flops,
    )


def measure_matmul_flops(
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype = torch.bfloat16,
    n: int = 1024,
    repeats: int = 5,
) -> float:
    """Achieved FLOP/s of a square ``n × n`` matmul (median): a measured stand-in for peak compute."""
    from attnbench.timing import measure

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = measure(lambda i: torch.matmul(a, b), device=device, warmup=2, repeats=repeats, max_seconds=10.0)
    return 2 * n**3 / t.median_s
