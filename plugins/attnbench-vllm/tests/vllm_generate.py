"""Run vLLM's engine on a saved tiny decoder and print its greedy tokens and top logprobs as JSON.

``python vllm_generate.py MODEL_DIR DTYPE LENS`` (LENS: prompt lengths, comma-separated). Run by
test_serving.py twice, with ``ATTNBENCH_VLLM`` 0 and 1, in fresh processes (vLLM's plugins are loaded
once per process). With ``ATTNBENCH_VLLM=1`` it also counts the calls of attnbench's per-layer work and
prints them, so a test can tell that cpu_decode ran and not vLLM's kernel.
"""

from __future__ import annotations

import collections
import json
import os
import sys


def main() -> None:
    calls: collections.Counter[str] = collections.Counter()
    if os.environ.get("ATTNBENCH_VLLM") == "1":
        import attnbench_vllm.cpu_attn as served

        attend, write = served.attend, served.write_slots

        def counted_attend(impl, plan, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls["layer_steps"] += 1
            calls["decode_rows"] += int(plan.decode_rows.numel())
            calls["prefill_chunks"] += 0 if plan.prefill is None else len(plan.prefill.seq_lens)
            calls["mixed_steps"] += int(plan.prefill is not None and bool(plan.decode_rows.numel()))
            calls["prefixed_chunks"] += 0 if plan.prefill is None else len(plan.prefill.prefix_slots)
            return attend(impl, plan, *args, **kwargs)

        def counted_write(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls["writes"] += 1
            return write(*args, **kwargs)

        served.attend, served.write_slots = counted_attend, counted_write
        forced = os.environ.get("ATTNBENCH_TEST_CHOICE")
        if forced:  # the test's stand-in for a tuned table that picks vLLM's own kernel
            why = f"attnbench.select() chose {forced} for this geometry"
            served.choose = lambda **_: served.Decision(False, why, f"chosen: {forced} (planted by the test)")

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, dtype, lens = sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3].split(",")]
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=2048,
        block_size=128,
        seed=0,
        max_num_batched_tokens=512,  # chunked prefill: chunks after a cached prefix, mixed with decodes
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        TokensPrompt(prompt_token_ids=torch.randint(0, 1024, (n,), generator=gen).tolist()) for n in lens
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=3)
    outs = llm.generate(prompts, params)
    result = [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs],
        }
        for o in outs
    ]
    print("RESULT " + json.dumps({"outputs": result, "calls": dict(calls)}))


if __name__ == "__main__":
    main()
