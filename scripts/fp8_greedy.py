"""Greedy tokens and logits of a tiny Llama with the fp8 KV cache, against transformers in bf16.

A seeded random tiny Llama (GQA, 2 layers, hidden 64; built by transformers, no download) generates
64 tokens greedily in transformers (bf16, sdpa) and in the same transformers model with its attention
routed through the ``fp8`` backend (``attnbench.integrations.transformers``), and through ``naive``
(bf16 cache) for comparison. Reported per backend: the share of the
64 × batch tokens equal to transformers', the first step where each sequence diverges, and the logit
error teacher-forced (fed transformers' own tokens, so one flipped token does not compound).
Usage::

    python scripts/fp8_greedy.py --out results/cpu/accuracy/bench-cpu-fp8-greedy.json
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import transformers

from attnbench.backends.fp8 import FP8Backend
from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import Backend
from attnbench.core.device import fingerprint
from attnbench.correctness.reference import compare
from attnbench.integrations.transformers import TransformersDecodeModel, greedy_reference
from attnbench.measure.decode import generate

PROMPT_LEN = 8
NEW_TOKENS = 64
BATCH = 4


def tiny_llama(seed: int = 1234) -> transformers.LlamaForCausalLM:
    """A random Llama (GQA 4/2 heads, head_dim 16) with randomised norm weights, in float32."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return hf


def compare_greedy(
    *, backends: dict[str, Backend] | None = None, new_tokens: int = NEW_TOKENS, batch: int = BATCH
) -> dict[str, Any]:
    """transformers bf16 greedy output vs attnbench bf16 with each backend (default: fp8 and naive)."""
    backends = backends or {"fp8": FP8Backend(), "naive": NaiveBackend()}
    prompt = torch.randint(0, 128, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    hf16 = tiny_llama().to(torch.bfloat16)
    hf16.set_attn_implementation("sdpa")
    ref_tokens, ref_logits = greedy_reference(hf16, prompt, new_tokens=new_tokens)
    ref_logits = ref_logits.double()  # [B, N, V]
    report: dict[str, Any] = {"new_tokens": new_tokens, "batch": batch, "backends": {}}
    for name, backend in backends.items():
        model = TransformersDecodeModel(hf16, backend, batch=batch)
        run = generate(model, prompt=prompt, new_tokens=new_tokens)
        same = run.tokens.cpu() == ref_tokens
        first_diff = [int(row.logical_not().nonzero()[0]) if not row.all() else None for row in same]
        model.setup(PROMPT_LEN, new_tokens)  # teacher-forced: transformers' tokens as inputs
        forced = [model.prefill(prompt)]
        forced += [model.decode_step(ref_tokens[:, j]) for j in range(new_tokens - 1)]
        stats = compare(torch.stack(forced, dim=1), ref_logits)
        hf16.set_attn_implementation("sdpa")
        report["backends"][name] = {
            "equal_tokens": int(same.sum()),
            "total_tokens": same.numel(),
            "share_equal": float(same.float().mean()),
            "first_divergence": first_diff,
            "logits_vs_transformers_bf16": stats.as_dict(),
            "max_abs_logit": float(ref_logits.abs().max()),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="write the report as JSON here")
    args = parser.parse_args()
    report = compare_greedy()
    for name, r in report["backends"].items():
        e = r["logits_vs_transformers_bf16"]
        print(
            f"{name:6s} tokens equal to transformers bf16: {r['equal_tokens']}/{r['total_tokens']} "
            f"({r['share_equal']:.1%}), first divergence per sequence {r['first_divergence']}; "
            f"teacher-forced logits: max_abs {e['max_abs']:.3f} (|logits| ≤ {r['max_abs_logit']:.1f}), "
            f"rel_l2 {e['rel_l2']:.2e}, cosine {e['cosine']:.6f}"
        )
    if args.out:
        doc = {
            "command": f"python scripts/fp8_greedy.py --out {args.out}",
            "machine": fingerprint("cpu"),
            "loadavg": os.getloadavg(),
            **report,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
