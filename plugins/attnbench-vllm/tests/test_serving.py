"""vLLM's engine serving through attnbench's cpu_decode (``ATTNBENCH_VLLM=1``): the same greedy tokens
and logprobs as vLLM's own CPU_ATTN, through mixed prefill/decode steps; a layer with a feature the
kernel does not run falls back to vLLM's own with one log line; the switch refuses a bad value.

Each engine runs in a fresh process (``vllm_generate.py``): vLLM loads its plugins once per process.
The decoder is a transformers Llama with wide random weights (``initializer_range`` 0.2, so the
attention is far from uniform and a wrong key moves the logits), saved and loaded as a checkpoint,
without a tokenizer. Needs vLLM's CPU build: skipped with the reason where it is missing, failed
under ``ATTNBENCH_REQUIRE_VLLM=1`` (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_required import require_vllm

require_vllm()

from attnbench_vllm import serving  # noqa: E402

HERE = Path(__file__).resolve().parent
#: a ragged batch around 1k tokens; 512-token steps split the long prompts into chunks after a cached
#: prefix, and the short one decodes beside the others' prefill chunks
LENS = "1000,700,1000,33"


def _save_llama(path: Path, **config: Any) -> Path:
    import torch
    import transformers

    torch.manual_seed(1234)
    fields: dict[str, Any] = dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA groups of 4
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    fields.update(config)
    arch = transformers.MistralForCausalLM if "sliding_window" in config else transformers.LlamaForCausalLM
    cfg_cls = transformers.MistralConfig if "sliding_window" in config else transformers.LlamaConfig
    arch(cfg_cls(**fields)).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The saved Llama and what vLLM's own engine generates from it (fp32), shared by this module's tests."""
    model = _save_llama(tmp_path_factory.mktemp("llama") / "llama")
    off, _ = _generate(model, "float32", served=False)
    return model, off


def _generate(model: Path, dtype: str, *, served: bool, **extra_env: str) -> tuple[dict[str, Any], str]:
    env = (
        os.environ
        | extra_env
        | {
            # an empty results location: no tuned table, so select() answers with its roofline fallback
            "ATTNBENCH_RESULTS_DIR": str(model.parent),
            "ATTNBENCH_VLLM": "1" if served else "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: the counters see it
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), str(model), dtype, LENS],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), proc.stdout + proc.stderr  # vLLM logs to stdout


def _assert_same(off: dict[str, Any], on: dict[str, Any], atol: float) -> None:
    for i, (a, b) in enumerate(zip(off["outputs"], on["outputs"], strict=True)):
        assert a["tokens"] == b["tokens"], f"request {i}: {a['tokens']} != {b['tokens']}"
        for step, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"], strict=True)):
            for tok, value in la.items():
                assert abs(value - lb[tok]) <= atol, (i, step, tok, value, lb[tok])


def test_the_engine_generates_the_same_tokens_through_cpu_decode(llama: tuple[Path, dict[str, Any]]) -> None:
    model, off = llama
    on, log = _generate(model, "float32", served=True)
    calls = on["calls"]
    # cpu_decode ran every layer of every step: decode rows, prefill chunks, and steps mixing both
    assert calls["decode_rows"] == 2 * 4 * 23, calls  # 2 layers x 4 requests x 23 decode steps
    assert calls["prefill_chunks"] >= 2 * 6 and calls["mixed_steps"] >= 1, calls
    assert calls["prefixed_chunks"] >= 2 * 2, calls  # chunks after their cached prefix (512-token steps)
    assert calls["writes"] == calls["layer_steps"], calls
    assert calls["planned_writes"] == calls["writes"], calls  # every layer's writes came from the step's plan
    assert "attnbench (ATTNBENCH_VLLM=1): 2 of 2 attention layers on cpu_decode.c[" in log, log[-3000:]
    # the choice at engine start, explained: no tuned table here, so the roofline fallback, said so
    assert "chosen: cpu_decode" in log and "[heuristic]" in log and "no tuned entry" in log, log[-3000:]
    # fp32: the same greedy tokens, and the top-3 logprobs within fp32 summation-order noise
    _assert_same(off, on, atol=2e-4)


def test_bf16_attention_in_the_engine_passes_the_gate_on_the_engines_own_cache(
    llama: tuple[Path, dict[str, Any]],
) -> None:
    """bf16: every decode call of every layer, judged by attnbench's correctness gate (float64 attention,
    the dtype's calibrated bounds) on the step's queries and the K/V read back from vLLM's KV tensor;
    the same judgement refuses a planted wrong answer on the same inputs."""
    model, _ = llama
    on, _ = _generate(model, "bfloat16", served=True, ATTNBENCH_TEST_GATE="1")
    assert on["calls"]["gate_calls"] >= 2 * 23, on["calls"]  # 2 layers x at least 23 decode steps
    assert on["gate"]["torch.bfloat16"] == [], on["gate"]
    assert on["gate"]["torch.bfloat16/planted"], on["gate"]  # the planted bug is caught


def test_an_fp8_kv_cache_runs_cpu_decode_fp8_and_passes_its_gate(llama: tuple[Path, dict[str, Any]]) -> None:
    """``--kv-cache-dtype fp8``: cpu_decode_fp8 on vLLM's KV tensor (e4m3 bytes, a scale per token and KV
    head beside it), every decode call judged as the fp8 backend is judged (exact attention over the
    K/V the model wrote, and the K/V as stored); a planted wrong answer refused. On a CPU without the
    fp8 kernel's vector variant, the fallback's line instead."""
    from attnbench.backends.cpu_decode_fp8 import measured_variant
    from attnbench.backends.cpu_kernel import load_kernel

    model, _ = llama
    on, log = _generate(
        model, "bfloat16", served=True, ATTNBENCH_TEST_GATE="1", ATTNBENCH_TEST_KV_DTYPE="fp8"
    )
    kernel = load_kernel()
    assert not isinstance(kernel, str), kernel
    if measured_variant(kernel) is None:
        assert on["calls"].get("layer_steps", 0) == 0, on["calls"]
        assert "an fp8 KV cache on a CPU without AVX512_BF16 and AVX512_VBMI" in log, log[-3000:]
        return
    assert "2 of 2 attention layers on cpu_decode_fp8.c[" in log, log[-3000:]
    assert on["calls"]["gate_calls"] >= 2 * 23, on["calls"]
    # against the K/V as stored, every bound; against exact attention (the fp8 rounding itself) the
    # relative ones: the absolute max_abs of the fp8 backend's exact bound (0.5) is set for the gate's
    # unit-normal inputs, and this wide-weight model's attention outputs reach 12.6 (its worst error
    # there, 2.96, is within rel_l2 0.2 and cosine 0.98 of exact attention)
    failures = on["gate"]["torch.bfloat16/fp8"]
    assert [f for f in failures if not f.startswith("max_abs")] == [], on["gate"]
    assert on["gate"]["torch.bfloat16/fp8/planted"], on["gate"]
    assert any(f.startswith("vs stored K/V") for f in on["gate"]["torch.bfloat16/fp8/planted"]), on["gate"]


def test_a_sliding_window_falls_back_to_vllms_own_with_one_line(tmp_path: Path) -> None:
    model = _save_llama(tmp_path / "mistral", sliding_window=256)
    off, _ = _generate(model, "float32", served=False)
    on, log = _generate(model, "float32", served=True)
    assert on["calls"].get("layer_steps", 0) == 0, on["calls"]  # vLLM's kernel ran every layer
    lines = [x for x in log.splitlines() if "which cpu_decode does not run exactly" in x]
    assert len(lines) == 2, log[-3000:]  # one line per layer, once
    assert "a sliding window of 256" in lines[0] and "vLLM's CPU_ATTN runs it" in lines[0]
    assert "attnbench (ATTNBENCH_VLLM=1): 0 of 2 attention layers" in log, log[-3000:]
    _assert_same(off, on, atol=0.0)


def test_where_the_choice_is_vllms_own_kernel_vllm_runs_every_layer(
    llama: tuple[Path, dict[str, Any]],
) -> None:
    model, off = llama
    on, log = _generate(model, "float32", served=True, ATTNBENCH_TEST_CHOICE="vllm_cpu")
    assert on["calls"].get("layer_steps", 0) == 0, on["calls"]
    assert "attnbench (ATTNBENCH_VLLM=1): 0 of 2 attention layers" in log and "chosen: vllm_cpu" in log
    assert "does not run exactly" not in log  # not a feature it refuses: the choice, said once
    _assert_same(off, on, atol=0.0)


def test_a_choice_that_fails_keeps_vllms_own_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from attnbench_vllm import cpu_attn

    import attnbench

    def broken(**_: Any) -> Any:
        raise OSError("results location unreadable")

    monkeypatch.setattr(attnbench, "select", broken)
    decision = cpu_attn.choose(
        num_heads=8, num_kv_heads=2, head_size=64, num_layers=2, dtype=torch.float32, context=2048
    )
    assert not decision.serves
    assert decision.why_not == "attnbench.select() could not choose (OSError: results location unreadable)"


def test_the_switch_names_what_it_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(serving.SWITCH, value)
        assert serving.enabled() is on
    monkeypatch.delenv(serving.SWITCH)
    assert serving.enabled() is False
    monkeypatch.setenv(serving.SWITCH, "yes")
    with pytest.raises(ValueError, match=r"ATTNBENCH_VLLM='yes': expected 1 .* or 0"):
        serving.enabled()
