"""Run vLLM's engine on a saved tiny decoder and print its greedy tokens and top logprobs as JSON.

``python vllm_generate.py MODEL_DIR DTYPE LENS`` (LENS: prompt lengths, comma-separated). Run by
test_serving.py twice, with ``ATTNBENCH_VLLM`` 0 and 1, in fresh processes (vLLM's plugins are loaded
once per process). With ``ATTNBENCH_VLLM=1`` it also counts the calls of attnbench's per-layer work and
prints them, so a test can tell that cpu_decode ran and not vLLM's kernel. With ``ATTNBENCH_TEST_GATE=1``
it also judges every decode call of every layer with attnbench's correctness gate (the ``Judge`` of
``attnbench.correctness.gate``: float64 attention and the calibrated bounds of the dtype) on the
engine's own inputs — the step's queries and the K/V read back from vLLM's KV tensor — and prints the
gate's failures and how many calls it judged.
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

        import torch

        from attnbench.backends.cpu_decode import CpuDecodeBackend
        from attnbench.backends.cpu_decode_fp8 import CpuDecodeFp8Backend
        from attnbench.correctness.gate import Judge

        judges: dict = {}  # one gate per dtype (and its planted twin), over every judged call
        #: fp8: the K/V each slot was given before quantisation, per layer (the exact history)
        written: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = collections.defaultdict(dict)

        def history(impl, plan, kv_cache, i, n):  # type: ignore[no-untyped-def]
            """Row i's K/V as the gate takes them: exact (as written) for fp8, read back otherwise."""
            if not impl.fp8:
                return served.read_prefix(kv_cache, plan.decode_block_table[i], n)
            ps, pos = kv_cache.shape[2], torch.arange(n)
            slots = (plan.decode_block_table[i].long()[pos // ps] * ps + pos % ps).tolist()
            rows = [written[kv_cache.data_ptr()][slot] for slot in slots]
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

        def judge(key, backend, dtype, scale):  # type: ignore[no-untyped-def]
            if key not in judges:
                judges[key] = Judge(backend, {}, dtype, scale, backend.error_multiple(dtype))
            return judges[key]

        def gate(impl, plan, query, kv_cache, output):  # type: ignore[no-untyped-def]
            rows = plan.decode_rows
            if not rows.numel():
                return
            lens = [int(n) for n in plan.decode_seq_lens]
            hkv, d = impl.num_kv_heads, impl.head_size
            hk = torch.zeros(len(lens), max(lens), hkv, d, dtype=query.dtype)
            hv = torch.zeros_like(hk)
            for i, n in enumerate(lens):
                hk[i, :n], hv[i, :n] = history(impl, plan, kv_cache, i, n)
            q = query.index_select(0, rows).view(len(lens), impl.num_heads, d)
            out = output.view(-1, impl.num_heads, d).index_select(0, rows)
            # fp8: judged as cpu_decode_fp8 is, against exact attention and the K/V as stored
            backend = CpuDecodeFp8Backend() if impl.fp8 else CpuDecodeBackend()
            key = str(query.dtype) + ("/fp8" if impl.fp8 else "")
            judge(key, backend, query.dtype, impl.scale).add(out, q, hk, hv, tuple(lens))
            # the same judgement of a planted wrong answer (the last head of the first row attends only
            # to its first key), which the gate must refuse: it can fail on these inputs
            planted = out.clone()
            planted[0, -1] = hv[0, 0, -1]
            judge(key + "/planted", backend, query.dtype, impl.scale).add(planted, q, hk, hv, tuple(lens))
            calls["gate_calls"] += 1

        def counted_attend(impl, plan, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls["layer_steps"] += 1
            calls["decode_rows"] += int(plan.decode_rows.numel())
            calls["prefill_chunks"] += 0 if plan.prefill is None else len(plan.prefill.seq_lens)
            calls["mixed_steps"] += int(plan.prefill is not None and bool(plan.decode_rows.numel()))
            calls["prefixed_chunks"] += 0 if plan.prefill is None else len(plan.prefill.prefix_slots)
            result = attend(impl, plan, *args, **kwargs)
            if os.environ.get("ATTNBENCH_TEST_GATE") == "1":
                query, _key, _value, kv_cache, output = args
                gate(impl, plan, query, kv_cache, output)
            return result

        def counted_write(kv_cache, key, value, slot_mapping, scales=None, writes=None):  # type: ignore[no-untyped-def]
            calls["writes"] += 1
            calls["planned_writes"] += int(writes is not None and writes.matches(slot_mapping))
            if scales is not None and os.environ.get("ATTNBENCH_TEST_GATE") == "1":
                layer = written[kv_cache.data_ptr()]
                for j, slot in enumerate(slot_mapping[: key.shape[0]].tolist()):
                    if slot >= 0:
                        layer[slot] = key[j].to(torch.bfloat16).clone(), value[j].to(torch.bfloat16).clone()
            return write(kv_cache, key, value, slot_mapping, scales, writes)

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
        kv_cache_dtype=os.environ.get("ATTNBENCH_TEST_KV_DTYPE", "auto"),
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
    gate: dict[str, list[str]] = {}
    if os.environ.get("ATTNBENCH_VLLM") == "1":
        gate = {key: judge.failures()[0] for key, judge in judges.items()}
        gate |= {key + "/ref_max": [f"{judge.exact.ref_max:.3g}"] for key, judge in judges.items()}
    print("RESULT " + json.dumps({"outputs": result, "calls": dict(calls), "gate": gate}))


if __name__ == "__main__":
    main()
