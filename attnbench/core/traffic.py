"""The cost model of a decode step: its bytes, its FLOPs and its roofline time — one place for all.

Every figure of the project that says how much a decode step reads or computes comes from here: the
estimator (``attnbench estimate``), ``bench``'s bound column, ``select()``'s heuristic, the MLA
roofline and the docs' scripts. The pieces:

- **KV bytes per token** — the backend's own answer (``Resolution.kv_bytes_per_token``, also through
  :func:`backend_kv_bytes_per_token`: fp8 scales or a plugin's own layout included), or, with no backend at hand
  (a datasheet estimate), the shape's count (:func:`shape_kv_bytes_per_token`: expanded per-head K/V
  for GQA, the latent ``kv_lora_rank + qk_rope_head_dim`` row for MLA, split or replicated over ``tp``).
- **KV bytes per step** — :func:`kv_bytes_per_step`: bytes per token × the tokens the step attends to
  (every cached token of every sequence plus its new one). The only implementation in the project.
- **FLOPs** — :func:`attention_flops`: ``2 · Hq · (Dk + Dv)`` per attended token per layer (``QKᵀ`` and
  ``PV``), in the backend's form (absorbed MLA: ``Dk = 576``, ``Dv = 512``).
- **The roofline** — :class:`Roofline`: ``time = fixed + max(memory, compute)`` with the memory time
  split into weights, KV and activations. The only implementation in the project.
- **The fixed cost** — :func:`step_fixed_s`: what a step costs beyond its bytes and FLOPs (kernel
  launches per layer, host-side scheduling and sampling); see docs/latency-model.md.

Weights are counted separately by :mod:`attnbench.cost.estimate` (their bytes depend on the deployment: tp,
weight dtype, MoE routing) and enter the same :class:`Roofline`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

from attnbench.core.shapes import ModelShape, dtype_bytes

if TYPE_CHECKING:
    import torch

    from attnbench.core.backend import Backend
    from attnbench.core.workload import Workload

__all__ = [
    "KERNELS_PER_LAYER",
    "CostOptions",
    "Roofline",
    "StepCost",
    "attention_flops",
    "backend_kv_bytes_per_token",
    "decode_cost",
    "decode_roofline",
    "kv_bytes_per_step",
    "roofline",
    "shape_kv_bytes_per_token",
    "step_fixed_s",
]

Form = Literal["expanded", "latent", "auto"]

#: Kernels one transformer layer launches in a decode step (norm, QKV projection, RoPE, cache write,
#: attention, output projection, residual, norm, gate/up projection, activation, down projection,
#: residual): what a launch cost is paid for, per layer. All-reduces under tensor parallelism are
#: counted separately by the caller when it models them.
KERNELS_PER_LAYER = 12


def _form(shape: ModelShape, form: Form) -> Literal["expanded", "latent"]:
    if form == "auto":
        return "latent" if shape.is_mla else "expanded"
    return form


# --------------------------------------------------------------------------------------------------
# bytes
# --------------------------------------------------------------------------------------------------
def shape_kv_bytes_per_token(
    shape: ModelShape, *, dtype: str | torch.dtype = "bf16", form: Form = "auto", tp: int = 1
) -> int:
    """Bytes one cached token occupies on one GPU, over all layers, from the shape alone (no scales).

    GQA: ``layers · 2 · ceil(kv_heads / tp) · head_dim · bytes`` (``kv_heads < tp``: one head per GPU,
    replicated). MLA latent: ``layers · (kv_lora_rank + qk_rope_head_dim) · bytes`` on every GPU (one
    shared head).
    """
    full = shape.kv_bytes_per_token(dtype, _form(shape, form))
    if _form(shape, form) == "latent" or tp == 1:
        return full
    return full // shape.num_kv_heads * math.ceil(shape.num_kv_heads / tp)


def backend_kv_bytes_per_token(
    backend: Backend, workload: Workload, *, config: dict[str, Any] | None = None
) -> int:
    """Bytes per cached token over all layers of ``workload`` as ``backend``'s own cache stores it.

    The backend's answer, ``backend.resolve(workload, config).kv_bytes_per_token`` (scales, paddings
    and plugin layouts included, no cache allocated); a caller that holds the resolution reads it there.
    """
    return backend.resolve(workload, config).kv_bytes_per_token


def kv_bytes_per_step(bytes_per_token: float, *, tokens: float) -> float:
    """KV bytes one decode step reads: ``bytes_per_token × tokens``.

    ``tokens`` is what the step attends to over the batch: ``Σ (context_i + 1)`` (every cached token
    once, and each sequence's new one). ``bytes_per_token`` covers all layers.
    """
    return bytes_per_token * tokens


def attention_flops(
    shape: ModelShape, *, tokens: float, form: Form = "auto", layers: int | None = None, tp: int = 1
) -> float:
    """FLOPs of the attention of one decode step on one GPU: ``2 · (Hq / tp) · (Dk + Dv)`` per attended
    token per layer (``QKᵀ`` and ``PV``); ``tokens`` as in :func:`kv_bytes_per_step`."""
    g = shape.geometry(_form(shape, form))
    return 2.0 * (layers or shape.num_layers) * tokens * (g.num_q_heads / tp) * (g.qk_head_dim + g.v_head_dim)


# --------------------------------------------------------------------------------------------------
# one step's work
# --------------------------------------------------------------------------------------------------
class _Traffic:
    """``bytes`` (weights + KV + query/output) and ``intensity`` (FLOPs per byte moved) of a cost."""

    kv_bytes: float
    io_bytes: float
    weight_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.io_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class StepCost(_Traffic):
    """Work of one decode step of attention, over all layers.

    ``kv_bytes`` the cache read; ``io_bytes`` the query read and output written; ``flops`` the
    attention matmuls. With ``projections`` the latent form also counts the absorption matmuls
    (``W_UK`` on the query, ``W_UV`` on the output) and their weights' read (``weight_bytes``).
    """

    form: str
    kv_bytes: float
    io_bytes: float
    weight_bytes: float
    flops: float


def decode_cost(
    workload: Workload,
    *,
    form: Form = "auto",
    projections: bool = False,
    kv_dtype: torch.dtype | str | None = None,
    kv_bytes_per_token: float | None = None,
    num_layers: int | None = None,
) -> StepCost:
    """Bytes and FLOPs of one decode step of ``workload`` in geometry ``form`` (``auto``: latent for MLA).

    ``kv_bytes_per_token`` (all of the shape's layers) is the backend's answer when given (see
    :func:`backend_kv_bytes_per_token`); else the shape's count in ``kv_dtype`` (default: the
    workload's dtype). ``num_layers`` runs fewer layers than the shape has (the synthetic loop's
    ``--layers``).
    """
    shape = workload.shape
    form = _form(shape, form)
    g = shape.geometry(form)
    layers = num_layers or shape.num_layers
    act = dtype_bytes(workload.dtype)
    b = workload.batch
    tokens = workload.total_tokens + b
    per_token = (
        kv_bytes_per_token
        if kv_bytes_per_token is not None
        else shape.kv_bytes_per_token(kv_dtype or workload.dtype, form)
    )
    kv = kv_bytes_per_step(per_token * layers / shape.num_layers, tokens=tokens)
    flops = attention_flops(shape, tokens=tokens, form=form, layers=layers)
    io = b * g.num_q_heads * (g.qk_head_dim + g.v_head_dim) * act * layers
    weight_bytes = 0
    if projections and form == "latent":
        nope, v, rank = shape.qk_nope_head_dim, shape.v_head_dim, shape.kv_lora_rank
        assert nope is not None and v is not None and rank is not None  # the latent form: an MLA shape
        flops += 2 * b * g.num_q_heads * rank * (nope + v) * layers
        weight_bytes = g.num_q_heads * rank * (nope + v) * act * layers
    return StepCost(form=form, kv_bytes=kv, io_bytes=io, weight_bytes=weight_bytes, flops=flops)


# --------------------------------------------------------------------------------------------------
# the roofline
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline(_Traffic):
    """A step's (or a prefill's) bytes and FLOPs on one GPU and its roofline time.

    ``time_s = fixed_s + max(weight_s + kv_s + io_s, flop_s)``: memory traffic and arithmetic overlap,
    the fixed cost (launches, host work) does not. ``ridge`` is the FLOP/B at which the device turns
    compute-bound (0 when the compute time mixes several peaks).
    """

    weight_bytes: float
    kv_bytes: float
    flops: float
    weight_s: float
    kv_s: float
    flop_s: float
    io_bytes: float = 0.0
    io_s: float = 0.0
    fixed_s: float = 0.0
    form: str = "expanded"
    ridge: float = 0.0

    @property
    def memory_s(self) -> float:
        return self.weight_s + self.kv_s + self.io_s

    @property
    def compute_s(self) -> float:
        return self.flop_s

    @property
    def floor_s(self) -> float:
        """The roofline floor: the slower of memory and compute (no fixed cost)."""
        return max(self.memory_s, self.flop_s)

    @property
    def time_s(self) -> float:
        return self.fixed_s + self.floor_s

    @property
    def bound(self) -> Literal["memory", "compute"]:
        return "compute" if self.flop_s > self.memory_s else "memory"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "bytes": self.bytes,
            "intensity": self.intensity,
            "memory_s": self.memory_s,
            "floor_s": self.floor_s,
            "time_s": self.time_s,
            "bound": self.bound,
        }


def roofline(cost: StepCost, *, bandwidth: float, peak_flops: float, fixed_s: float = 0.0) -> Roofline:
    """The roofline of ``cost`` on a device of ``bandwidth`` (bytes/s) and ``peak_flops`` (FLOP/s)."""
    if not (bandwidth > 0 and peak_flops > 0):
        raise ValueError(f"bandwidth = {bandwidth!r} and peak_flops = {peak_flops!r} must both be > 0")
    return Roofline(
        weight_bytes=cost.weight_bytes,
        kv_bytes=cost.kv_bytes,
        flops=cost.flops,
        weight_s=cost.weight_bytes / bandwidth,
        kv_s=cost.kv_bytes / bandwidth,
        flop_s=cost.flops / peak_flops,
        io_bytes=cost.io_bytes,
        io_s=cost.io_bytes / bandwidth,
        fixed_s=fixed_s,
        form=cost.form,
        ridge=peak_flops / bandwidth,
    )


class CostOptions(TypedDict, total=False):
    """:func:`decode_cost`'s keyword arguments, which :func:`decode_roofline` passes on."""

    form: Form
    projections: bool
    kv_dtype: torch.dtype | str | None
    kv_bytes_per_token: float | None
    num_layers: int | None


def decode_roofline(
    workload: Workload, *, bandwidth: float, peak_flops: float, **options: Unpack[CostOptions]
) -> Roofline:
    """Which bound applies to a decode step of ``workload`` on a device of ``bandwidth`` (bytes/s) and
    ``peak_flops`` (FLOP/s in the workload's dtype); the other arguments as in :func:`decode_cost`.

    Example (DeepSeek-V3, absorbed, on an H100 SXM's dense bf16 peak)::

        >>> from attnbench.core.workload import Workload
        >>> w = Workload.uniform("deepseek-v3", batch=64, context="4k")
        >>> decode_roofline(w, bandwidth=3.35e12, peak_flops=989e12).bound
        'memory'
    """
    return roofline(decode_cost(workload, **options), bandwidth=bandwidth, peak_flops=peak_flops)


def step_fixed_s(
    *, layers: int, launch_s: float, step_overhead_s: float, kernels_per_layer: int = KERNELS_PER_LAYER
) -> float:
    """What a decode step costs beyond its bytes and FLOPs: ``step_overhead_s`` once per step (the
    engine's host work: scheduling, input preparation, sampling) plus ``launch_s`` per kernel, for
    ``kernels_per_layer`` kernels in each of ``layers`` layers."""
    return step_overhead_s + layers * kernels_per_layer * launch_s
