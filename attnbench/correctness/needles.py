"""Gate inputs with needle probes: random K/V plus planted keys a wrong kernel cannot average away.

Random inputs weaken with context: attention averages over ``S`` tokens, so a dropped, stale or
mis-paged token moves the output by about ``1/√S`` — at 8k context less than bf16 can see. A *needle
probe* fixes that. For one (decode step, layer, sequence, KV head) the step's query is ``s_j · u`` for
the ``G`` query heads of the group (``s_j`` spread over ``[0.9, 1.1]``, so every query head sees its
own mixture), and at most :data:`NEEDLES_PER_PROBE` keys at chosen positions get logits just above the
log-sum-exp of everything else (``δ`` of ``+0.5, 0, −0.5, −1``): the softmax puts about three
quarters of its weight on them, and an output that misses, duplicates or mis-reads one of them is
off by O(1), at any context. Positions per sequence:

- the first token, the newest (in the ``k`` passed to ``decode()``), the previous step's token;
- ``2^k − 1`` and ``2^k`` for every power of two inside the sequence — page boundaries for every
  power-of-two page size and the block edges of most split schemes (plugins declare no boundaries);
- random middles.

One *long-accumulation* probe per gate run (last layer, sequence 0, KV head 0) makes every other key
of that head nearly equal — the softmax is flat over the whole context, so the output is a long sum
of tiny terms — plus one needle that takes about half the weight.

Step 0 is a purely random step (fresh ``N(0, 1)`` inputs, no planted keys), so the gate sees both.
The planted keys have ``N(0, 1)``-sized entries too: the needle's component along ``u`` sets its
logit and a random component orthogonal to ``u`` keeps the values (and MLA's latent, which doubles as
the value) distinct.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from attnbench.core.shapes import AttentionGeometry

__all__ = [
    "NEEDLES_PER_PROBE",
    "GateInputs",
    "Probe",
    "build_gate_inputs",
    "needle_positions",
    "probe_groups",
]

#: At most this many planted keys per probe.
NEEDLES_PER_PROBE = 4
_DELTAS = (0.5, 0.0, -0.5, -1.0)  # needle logits relative to the log-sum-exp of the rest


@dataclass(frozen=True)
class Probe:
    """Planted keys for one (step, layer, sequence, query-head pair); ``labels`` say why each position."""

    kind: str  # "needle" or "accumulation"
    step: int
    layer: int
    seq: int
    kv_head: int
    q_heads: tuple[int, int]  # the query heads [start, end) whose query the probe sets
    positions: tuple[int, ...]
    labels: tuple[str, ...]

    def describe(self) -> str:
        where = ", ".join(f"{p} ({lab})" for p, lab in zip(self.positions, self.labels, strict=True))
        heads = f"q heads {self.q_heads[0]}-{self.q_heads[1] - 1}"
        return (
            f"{self.kind} probe step {self.step} layer {self.layer} seq {self.seq} kv head {self.kv_head} "
            f"({heads}): {where}"
        )


@dataclass
class GateInputs:
    """Everything the gate feeds a backend, built before the first call.

    ``history[layer] = (k, v)``: ``[B, S, Hkv, D]`` with room for every decode step (rows past a
    sequence's prompt are the decode tokens, written in place as the steps run). ``steps[s][layer] =
    (q, k, v)``: ``[B, Hq, Dk]``, ``[B, Hkv, Dk]``, ``[B, Hkv, Dv]``. For the latent form ``v`` is a view of
    ``k``'s first ``Dv`` columns.
    """

    context_lens: tuple[int, ...]
    history: list[tuple[torch.Tensor, torch.Tensor]]
    steps: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]
    probes: list[Probe] = field(default_factory=list)

    @property
    def decode_steps(self) -> int:
        return len(self.steps)


def needle_positions(
    n: int, *, previous: bool, rng: random.Random, middles: int = 2
) -> list[tuple[int, str]]:
    """Positions to plant in a sequence of ``n`` tokens (after the step), most important first."""
    out: list[tuple[int, str]] = [(n - 1, "newest"), (0, "first")]
    if previous and n >= 2:
        out.append((n - 2, "previous step"))
    k = 1
    while (1 << k) <= n - 2:
        out += [((1 << k) - 1, f"2^{k}-1"), (1 << k, f"2^{k}")]
        k += 1
    if n > 2:
        out += [(rng.randrange(1, n - 1), "middle") for _ in range(middles)]
    unique: dict[int, str] = {}  # each position once, with its first (most important) label
    for p, lab in out:
        unique.setdefault(p, lab)
    return list(unique.items())


def build_gate_inputs(
    geometry: AttentionGeometry,
    form: str,
    *,
    context_lens: tuple[int, ...],
    num_layers: int,
    decode_steps: int | None,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator,
    probes: bool = True,
) -> GateInputs:
    """Fresh random inputs for a gate run, with needle probes planted (unless ``probes=False``).

    ``decode_steps=None`` takes one random step plus as many probe steps as it needs to plant every
    structured position of the longest sequence (usually one or two).
    """
    g = geometry
    b = len(context_lens)
    rng = random.Random(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    hkv = g.num_kv_heads
    if decode_steps is None:
        # per sequence and probe step: newest, first and previous, then a share of the rest
        room = num_layers * len(probe_groups(g)) * NEEDLES_PER_PROBE - NEEDLES_PER_PROBE - 3
        rest = len(needle_positions(max(context_lens) + 2, previous=False, rng=random.Random(0))) - 2
        decode_steps = 1 + (math.ceil(rest / max(room, 1)) if probes else 0)
    if decode_steps < 1:
        raise ValueError(f"decode_steps = {decode_steps} must be ≥ 1")
    total = max(context_lens) + decode_steps

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32)

    # float32 on the host while planting; converted to the workload's dtype and device at the end
    hist_k = [randn(b, total, hkv, g.qk_head_dim) for _ in range(num_layers)]
    hist_v = [None if form == "latent" else randn(b, total, hkv, g.v_head_dim) for _ in range(num_layers)]
    step_q = [
        [randn(b, g.num_q_heads, g.qk_head_dim) for _ in range(num_layers)] for _ in range(decode_steps)
    ]
    # decode tokens live in the history buffers at position context_lens[i] + step
    inputs = GateInputs(context_lens=tuple(context_lens), history=[], steps=[])
    if probes:
        _plant(inputs, g, hist_k, step_q, rng=rng, generator=generator, decode_steps=decode_steps)

    history, steps = [], []
    for layer in range(num_layers):
        k = hist_k[layer].to(device=device, dtype=dtype)
        v = k[..., : g.v_head_dim] if (hv := hist_v[layer]) is None else hv.to(device=device, dtype=dtype)
        history.append((k, v))
    for s in range(decode_steps):
        row = []
        for layer in range(num_layers):
            k, v = history[layer]
            idx = torch.tensor([n + s for n in context_lens], device=k.device)
            ks = k[torch.arange(b, device=k.device), idx]  # [B, Hkv, Dk]
            vs = ks[..., : g.v_head_dim] if form == "latent" else v[torch.arange(b, device=k.device), idx]
            row.append((step_q[s][layer].to(device=device, dtype=dtype), ks, vs))
        steps.append(row)
    inputs.history, inputs.steps = history, steps
    return inputs


def _plant(
    inputs: GateInputs,
    g: AttentionGeometry,
    hist_k: list[torch.Tensor],
    step_q: list[list[torch.Tensor]],
    *,
    rng: random.Random,
    generator: torch.Generator,
    decode_steps: int,
) -> None:
    lens = inputs.context_lens
    num_layers = len(hist_k)
    used: set[tuple[int, int, int, int]] = set()  # (layer, seq, kv head, position)
    first_probe_step = 1 if decode_steps > 1 else 0

    # the long-accumulation probe's head: every key nearly equal (planted first, needles go on top)
    acc_layer, acc_head = num_layers - 1, 0
    base = torch.randn(g.qk_head_dim, generator=generator)
    noise = torch.randn(hist_k[acc_layer].shape[1], g.qk_head_dim, generator=generator)
    hist_k[acc_layer][0, :, acc_head] = base + 1e-2 * noise

    # structured positions (powers of two, random middles) are shared out over the probe steps; every
    # probe step also plants its own newest token, the first token and the previous step's token
    carry: list[list[tuple[int, str]]] = []
    for n0 in lens:
        n = n0 + first_probe_step + 1
        carry.append(
            [pl for pl in needle_positions(n, previous=False, rng=rng) if pl[1] not in ("newest", "first")]
        )
    slots = [(layer, grp) for layer in range(num_layers) for grp in probe_groups(g)]
    for s in range(first_probe_step, decode_steps):
        for i, n0 in enumerate(lens):
            n = n0 + s + 1
            todo = [(n - 1, "newest"), (0, "first")]
            if s > 0:
                todo.append((n - 2, "previous step"))
            todo += [pl for pl in carry[i] if pl[0] not in {p for p, _ in todo}]
            assigned: dict[tuple[int, tuple[int, int, int]], list[tuple[int, str]]] = {sl: [] for sl in slots}
            accumulation = (acc_layer, probe_groups(g)[0]) if i == 0 and s == first_probe_step else None
            left = []
            for pos, label in todo:
                for sl in slots:
                    key = (sl[0], i, sl[1][0], pos)  # a key is planted once per (layer, seq, kv head)
                    if sl != accumulation and len(assigned[sl]) < NEEDLES_PER_PROBE and key not in used:
                        assigned[sl].append((pos, label))
                        used.add(key)
                        break
                else:
                    left.append((pos, label))
            carry[i] = [pl for pl in left if pl[1] not in ("newest", "first", "previous step")]
            if accumulation is not None:
                mid = rng.randrange(1, n - 1) if n > 2 else n - 1
                while (acc_layer, 0, acc_head, mid) in used and n > 3:
                    mid = rng.randrange(1, n - 1)
                assigned[accumulation] = [(mid, "needle over near-equal keys")]
                used.add((acc_layer, 0, acc_head, mid))
            for (layer, (h, q0, q1)), planted in assigned.items():
                if not planted:
                    continue
                _plant_probe(
                    hist_k[layer],
                    step_q[s][layer],
                    g,
                    seq=i,
                    head=h,
                    heads=(q0, q1),
                    n=n,
                    planted=planted,
                    generator=generator,
                )
                kind = "accumulation" if (layer, (h, q0, q1)) == accumulation else "needle"
                positions = tuple(p for p, _ in planted)
                labels = tuple(lab for _, lab in planted)
                inputs.probes.append(Probe(kind, s, layer, i, h, (q0, q1), positions, labels))


def probe_groups(g: AttentionGeometry) -> list[tuple[int, int, int]]:
    """``(kv head, first q head, end q head)`` of each probe slot: query heads in pairs within a group.

    Pairs (not whole groups) give a group of ``G`` query heads ``G/2`` probes of its own per step; the two
    heads of a pair get different query scales, so mixing them up shows too.
    """
    group = g.num_q_heads // g.num_kv_heads
    size = 2 if group >= 2 else 1
    return [
        (h, h * group + j, min(h * group + j + size, (h + 1) * group))
        for h in range(g.num_kv_heads)
        for j in range(0, group, size)
    ]


def _plant_probe(
    k: torch.Tensor,
    q: torch.Tensor,
    g: AttentionGeometry,
    *,
    seq: int,
    head: int,
    heads: tuple[int, int],
    n: int,
    planted: list[tuple[int, str]],
    generator: torch.Generator,
) -> None:
    """Set the heads' query to ``s_j · u`` and the planted keys' logits above the rest (in place)."""
    u = torch.randn(g.qk_head_dim, generator=generator)
    count = heads[1] - heads[0]
    spread = torch.linspace(0.9, 1.1, count)[torch.randperm(count, generator=generator)]
    q[seq, heads[0] : heads[1]] = spread[:, None] * u[None, :]
    positions = [p for p, _ in planted]
    logits = (k[seq, :n, head] @ u).double() * g.scale  # [n]
    mask = torch.ones(n, dtype=torch.bool)
    mask[positions] = False
    lse = float(torch.logsumexp(logits[mask], dim=0)) if bool(mask.any()) else 0.0
    uu = float(u.double() @ u.double())
    for j, p in enumerate(positions):
        w = torch.randn(g.qk_head_dim, generator=generator).double()
        w -= (w @ u.double()) / uu * u.double()  # orthogonal to u: no effect on the logit
        target = lse + _DELTAS[j % len(_DELTAS)]
        k[seq, p, head] = (target / (g.scale * uu) * u.double() + w).float()
