"""Prefill attention (attnbench.core.prefill): float64 agreement for ragged, chunked and appended
prompts on both of SDPA's CPU paths, planted prefill bugs caught by the conformance check, and the
memory a long prefill takes (O(T · chunk), never O(T²))."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from attnbench.backends.naive import NaiveBackend
from attnbench.core.prefill import prefill_attention, sdpa_flash_error
from attnbench.correctness.reference import compare, reference_decode
from attnbench.testing import CASES, run_prefill_turns


def _reference(q, k, v, lengths, prefix):
    """Each prompt row as a float64 decode query over the prefix and the prompt up to itself."""
    b, t, hq, _ = q.shape
    out = torch.zeros(b, t, hq, v.shape[-1], dtype=torch.float64)
    for i, n in enumerate(lengths):
        pk, pv = prefix[i] if prefix and prefix[i] is not None else (k[i, :0], v[i, :0])
        hk, hv = torch.cat([pk, k[i, :n]]), torch.cat([pv, v[i, :n]])
        p = pk.shape[0]
        lens = [p + r + 1 for r in range(n)]
        out[i, :n] = reference_decode(
            q[i, :n], hk.expand(n, *hk.shape), hv.expand(n, *hv.shape), lens, scale=0.125
        )
    return out


@pytest.mark.parametrize("dims", [(64, 64), (48, 32)], ids=["fused", "math"])  # Dk != Dv: SDPA's math path
@pytest.mark.parametrize("budget", [None, 2048], ids=["whole", "chunked"])
@pytest.mark.parametrize("with_prefix", [False, True], ids=["empty", "prefix"])
def test_matches_float64(dims, budget, with_prefix) -> None:
    dk, dv = dims
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    lengths, hq, hkv = [37, 5, 64], 6, 2
    t = max(lengths)
    q = torch.randn(3, t, hq, dk, generator=gen)
    k = torch.randn(3, t, hkv, dk, generator=gen)
    v = torch.randn(3, t, hkv, dv, generator=gen)
    prefix = None
    if with_prefix:
        prefix = [
            (torch.randn(n, hkv, dk, generator=gen), torch.randn(n, hkv, dv, generator=gen)) if n else None
            for n in (50, 0, 17)
        ]
    kw = {} if budget is None else {"budget_bytes": budget}
    out = prefill_attention(q, k, v, lengths=lengths, scale=0.125, prefix=prefix, **kw)
    ref = _reference(q, k, v, lengths, prefix)
    stats = compare(out, ref)
    assert stats.rel_l2 < 2e-6 and stats.max_abs < 1e-5, stats
    assert not out[1, 5:].any(), "rows past a prompt's length must be zero"
    fused = sdpa_flash_error("cpu", torch.float32, dk == dv) is None
    assert fused == (dk == dv), "the fused/math split this test relies on has changed"


def test_bf16_uniform_batch_is_one_call() -> None:
    """Uniform prompts on an empty cache: one batched causal call, bf16 within bf16's rounding."""
    q, k, v = (torch.randn(2, 96, h, 64).bfloat16() for h in (8, 2, 2))
    out = prefill_attention(q, k, v, lengths=[96, 96], scale=0.125)
    ref = _reference(q.double(), k.double(), v.double(), [96, 96], None)
    assert compare(out, ref).rel_l2 < 8e-3


def test_refuses_bad_lengths() -> None:
    q = torch.randn(2, 4, 2, 16)
    with pytest.raises(ValueError, match=r"lengths \[4, 5\] must hold 2 values in 0..4"):
        prefill_attention(q, q, q, lengths=[4, 5], scale=0.25)


class IgnoresPrefix(NaiveBackend):
    """Planted bug: a second prompt attends only to itself, not to the cached first."""

    name = "ignores_prefix"

    def prefill(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
        out = prefill_attention(q, k, v, lengths=plan.num_new, scale=cache.geometry.scale)
        self.append(cache, plan, layer=layer, k=k, v=v)
        return out


class SeesTheFuture(NaiveBackend):
    """Planted bug: every prompt row sees its prompt's next token too (an off-by-one causal mask)."""

    name = "sees_the_future"

    def prefill(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        for i, n in enumerate(plan.num_new):
            keys = cache.read(layer, i, plan.positions[i]) if plan.positions[i] else None
            kk = k[i, :n] if keys is None else torch.cat([keys[0], k[i, :n]])
            vv = v[i, :n] if keys is None else torch.cat([keys[1], v[i, :n]])
            p = kk.shape[0] - n
            mask = torch.arange(kk.shape[0])[None, :] <= (p + torch.arange(n) + 1)[:, None]
            o = torch.nn.functional.scaled_dot_product_attention(
                q[i, :n].transpose(0, 1),
                kk.transpose(0, 1),
                vv.transpose(0, 1),
                attn_mask=mask,
                enable_gqa=True,
            )
            out[i, :n] = o.transpose(0, 1)
        self.append(cache, plan, layer=layer, k=k, v=v)
        return out


@pytest.mark.parametrize("planted", [IgnoresPrefix, SeesTheFuture])
def test_planted_prefill_bugs_are_caught(planted) -> None:
    case = next(c for c in CASES if c.id == "gqa")
    with pytest.raises(AssertionError, match="prefill"):
        run_prefill_turns(planted(), case, dtype="bf16")
    run_prefill_turns(NaiveBackend(), case, dtype="bf16")  # the correct one passes the same check


_PEAK = textwrap.dedent(
    """
    import json, resource, sys, torch
    from attnbench.core.prefill import prefill_attention
    t, dk, dv, prefix = (int(a) for a in sys.argv[1:5])
    torch.set_num_threads(2)
    q = torch.randn(1, t, 1, dk); k = torch.randn(1, t, 1, dk); v = torch.randn(1, t, 1, dv)
    pre = [(torch.randn(prefix, 1, dk), torch.randn(prefix, 1, dv))] if prefix else None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = prefill_attention(q, k, v, lengths=[t], scale=dk ** -0.5, prefix=pre, budget_bytes=64 * 2**20)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_growth_mib": (after - before) / 1024, "finite": bool(out.isfinite().all())}))
    """
)


@pytest.mark.parametrize(
    "dims,prefix", [((16, 16), 0), ((16, 16), 1024), ((24, 16), 0)], ids=["fused", "fused-prefix", "math"]
)
def test_16k_prefill_memory_is_linear_in_length(dims, prefix) -> None:
    """A 16,384-token prefill (one head, fp32): the T×T scores alone would be 1 GiB. Peak resident
    memory, measured in a fresh process around the call, grows by O(T · chunk) — here under 200 MiB
    with a 64 MiB budget per call (the inputs themselves are 12 MiB)."""
    t = 16384
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, str(t), str(dims[0]), str(dims[1]), str(prefix)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finite"]
    assert result["peak_growth_mib"] < 200, result
