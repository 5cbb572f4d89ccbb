"""transformers models generate through attnbench backends (``attnbench.integrations.transformers``).

Tiny random-initialised models (fp32, hidden 64, 2 layers, vocab 128) of eight architectures plus
DeepSeek-V3's expanded MLA form. Two prompts of different lengths (8 and 5 tokens) go through one
left-padded batch with an attention mask; each sequence's 32 greedy tokens must equal transformers'
own (``sdpa``, fp32) for that prompt alone. Every registered backend runs every model it supports;
backends whose kernels run interpreted here (Triton on a CPU) run on two of them only, to keep CI
short. A lossy cache (fp8) is held to naive attention over K/V as it stores them.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import transformers
from helpers.tiny_hf import TINY_COMMON, seeded, tiny_deepseek

import attnbench
from attnbench.backends.naive import NaiveBackend
from attnbench.cli import main
from attnbench.core.backend import Backend, KVCache, StepPlan
from attnbench.core.shapes import ShapeError, load_shape
from attnbench.core.workload import Workload
from attnbench.integrations.transformers import (
    BackendCache,
    TransformersDecodeModel,
    cache_kwarg,
    shape_of,
    use_backend,
)
from attnbench.measure.decode import generate
from attnbench.models import UnsupportedModelError

LONG, SHORT = 8, 5  # prompt lengths; the short one is left-padded to LONG
NEW_TOKENS = 32
MAX_SEQ_LEN = LONG + NEW_TOKENS

_COMMON = TINY_COMMON
_GQA = dict(num_attention_heads=4, num_key_value_heads=2, **_COMMON)


def _llama() -> transformers.PreTrainedModel:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=16, rope_parameters=rope, **_GQA))


ARCHITECTURES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "llama": _llama,  # GQA, Llama-3 rope scaling
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=64, **_GQA)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(  # MQA, q/k/v biases, tied embeddings
        transformers.Qwen2Config(
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, **_COMMON
        )
    ),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(head_dim=16, **_GQA)
    ),  # q/k norms
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**_GQA)),  # fused qkv projection
    "granite": lambda: transformers.GraniteForCausalLM(  # softmax scale 0.5 != 1/sqrt(16)
        transformers.GraniteConfig(
            attention_multiplier=0.5,
            embedding_multiplier=2.0,
            residual_multiplier=0.7,
            logits_scaling=0.5,
            **_GQA,
        )
    ),
    "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**_GQA)),  # post-norms, q/k norms
    "gemma3": lambda: transformers.Gemma3ForCausalLM(  # scale 1/sqrt(8) != 1/sqrt(16); windows ≥ the run
        transformers.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=8, sliding_window=64, **_GQA)
    ),
    "deepseek-v3-expanded": tiny_deepseek,
}
#: The architectures interpreted (slow) backends run on.
INTERPRETED_ON = ("llama", "qwen3")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def hf_model(arch: str) -> transformers.PreTrainedModel:
    """A seeded tiny model, norm weights and biases randomised too (they are 1 / 0 at initialisation)."""
    hf = seeded(ARCHITECTURES[arch])
    hf.set_attn_implementation("sdpa")
    return hf


def batch_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [2, LONG]`` (sequence 1 left-padded with 0s) and the attention mask."""
    ids = torch.randint(0, 128, (2, LONG), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, : LONG - SHORT] = 0
    ids[1, : LONG - SHORT] = 0
    return ids, mask


@functools.cache
def reference_tokens(arch: str) -> torch.Tensor:
    """transformers' own greedy tokens ``[2, NEW_TOKENS]``, each prompt run alone (sdpa, fp32)."""
    hf = hf_model(arch)
    hf.set_attn_implementation("sdpa")
    ids, mask = batch_inputs()
    rows = []
    for i in range(2):
        prompt = ids[i : i + 1, LONG - int(mask[i].sum()) :]
        rows.append(hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1] :])
    return torch.stack(rows)


@contextlib.contextmanager
def attention_through(
    hf: transformers.PreTrainedModel, backend: Backend | str, **kwargs: object
) -> Iterator[BackendCache]:
    """``use_backend(hf, backend, **kwargs)`` for the block; transformers' own sdpa again after it."""
    try:
        yield use_backend(hf, backend, **kwargs)  # type: ignore[arg-type]
    finally:
        hf.set_attn_implementation("sdpa")


def generate_through(arch: str, backend: Backend | str, *, config: dict | None = None) -> torch.Tensor:
    """Greedy tokens ``[2, NEW_TOKENS]`` of the padded batch with attention through ``backend``."""
    hf = hf_model(arch)
    ids, mask = batch_inputs()
    with attention_through(hf, backend, config=config, batch=2, max_seq_len=MAX_SEQ_LEN) as cache:
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **{cache_kwarg(hf): cache}
        )
    return out[:, LONG:]


class StoredKVNaiveBackend(NaiveBackend):
    """Test-only: naive attention over K/V exactly as ``lossy`` stores them (its ``reference_kv``)."""

    name = "test_stored_kv_naive"

    def __init__(self, lossy: Backend) -> None:
        self.lossy = lossy

    def _stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self.lossy.reference_kv(k, v, config=self.lossy.default_config())
        return ks.to(k.dtype), vs.to(v.dtype)

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().append(cache, plan, layer=layer, k=self._stored(k, v)[0], v=self._stored(k, v)[1])

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):  # type: ignore[no-untyped-def]
        ks, vs = self._stored(k[:, None], v[:, None])
        return super().decode(cache, plan, layer=layer, q=q, k=ks[:, 0], v=vs[:, 0])


def _lossy(backend: Backend) -> bool:
    k = torch.randn(1, 3, 2, 16)
    return backend.reference_kv(k, k.clone(), config=backend.default_config()) is not None


def _cases() -> list:
    cases = []
    for entry in attnbench.load_registry():
        if entry.cls.kv_form != "expanded":
            continue  # the latent form runs in attnbench.models (DeepSeek); refused here, tested below
        probe = entry.cls()
        interpreted = probe.interpreted(Workload.uniform("tiny-gqa", batch=2, context=64, dtype="fp32"))
        for arch in ARCHITECTURES:
            if interpreted and arch not in INTERPRETED_ON:
                continue
            cases.append(pytest.param(arch, entry.name, id=f"{arch}-{entry.name}"))
    return cases


# ---------------------------------------------------------------------------------------------------
# greedy tokens: every architecture × every registered backend that supports it
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("arch", "backend_name"), _cases())
def test_greedy_tokens_equal_transformers(arch: str, backend_name: str) -> None:
    backend = attnbench.load_registry().get(backend_name)
    workload = Workload.uniform(shape_of(hf_model(arch)), batch=2, context=MAX_SEQ_LEN, dtype="fp32")
    reasons = backend.supports(workload)
    if reasons:  # the backend's own refusal of this shape (e.g. flash with Dk != Dv); anything else fails
        pytest.skip(f"backend {backend_name!r} refuses {arch}: {'; '.join(reasons)}")
    tokens = generate_through(arch, backend)
    if _lossy(backend):  # fp8: exact tokens of naive attention over the K/V it stores
        want, against = generate_through(arch, StoredKVNaiveBackend(backend)), "naive over its stored K/V"
    else:
        want, against = reference_tokens(arch), "transformers (sdpa, each prompt alone)"
    same = [int((tokens[i] == want[i]).sum()) for i in range(2)]
    print(
        f"\n{arch} × {backend_name} [{backend.implementation(workload)}]: tokens {same} of {NEW_TOKENS} equal {against}'s"
    )
    for i in range(2):
        assert torch.equal(tokens[i], want[i]), (
            f"sequence {i}: {same[i]}/{NEW_TOKENS} tokens equal {against}'s"
        )


def test_fp8_triton_path() -> None:
    """fp8's Triton kernel (its torch path is the CPU default), interpreted here, through the integration."""
    fp8 = attnbench.load_registry().get("fp8")
    triton_fp8 = type("FP8TritonPath", (type(fp8),), {"kernel": "triton"})()
    hf = hf_model("llama")
    with attention_through(hf, triton_fp8, batch=2, max_seq_len=MAX_SEQ_LEN) as cache:
        path = cache.kv.implementation  # the declared attribute of fp8's cache
    assert path == "triton", f"expected the Triton path, ran {path}"
    want = generate_through("llama", StoredKVNaiveBackend(triton_fp8))
    assert torch.equal(generate_through("llama", triton_fp8), want)


def test_enough_architectures_run_through_naive() -> None:
    """At least six architectures, and every one of them, match transformers through ``naive``."""
    matched = [
        arch for arch in ARCHITECTURES if torch.equal(generate_through(arch, "naive"), reference_tokens(arch))
    ]
    assert matched == list(ARCHITECTURES) and len(matched) >= 6


class WrongBackend(NaiveBackend):
    """Planted bug: the decode output of each query head is swapped with its neighbour's."""

    name = "test_wrong"

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):  # type: ignore[no-untyped-def]
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v).roll(1, dims=1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_planted_wrong_backend_changes_the_tokens(arch: str) -> None:
    """The model's attention really runs through the backend: a wrong one gives other tokens."""
    assert torch.equal(generate_through(arch, NaiveBackend()), reference_tokens(arch))
    assert not torch.equal(generate_through(arch, WrongBackend()), reference_tokens(arch))


class CountingBackend(NaiveBackend):
    name = "test_counting"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def plan(self, cache: KVCache, *, num_new):  # type: ignore[no-untyped-def]
        self.calls.append(f"plan{list(num_new)}")
        return super().plan(cache, num_new=num_new)

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.calls.append(f"append{layer}")
        super().append(cache, plan, layer=layer, k=k, v=v)

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):  # type: ignore[no-untyped-def]
        self.calls.append(f"decode{layer}")
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_one_plan_per_step_one_write_per_token_and_ragged_lengths() -> None:
    """Prefill plans the ragged lengths (pads stripped), then one plan per step for both layers; the
    backend's cache holds each sequence's own length, transformers' view holds nothing."""
    backend = CountingBackend()
    hf = hf_model("llama")
    ids, mask = batch_inputs()
    with attention_through(hf, backend, batch=2, max_seq_len=MAX_SEQ_LEN) as cache:
        hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **{cache_kwarg(hf): cache})
    step = ["plan[1, 1]", "decode0", "decode1"]
    assert backend.calls == [f"plan[{LONG}, {SHORT}]", "append0", "append1", *step * 3]
    assert isinstance(cache, BackendCache)
    assert cache.kv.seq_lens == (LONG + 3, SHORT + 3)  # the last new token is never fed back
    assert cache.get_seq_length() == LONG + 3
    assert all(getattr(layer, "keys", None) is None for layer in cache.layers)  # no second copy


def test_a_choice_from_select_runs(tmp_path: Path) -> None:
    hf = hf_model("qwen2")
    shape = shape_of(hf)
    choice = attnbench.select(
        Workload.uniform(shape, batch=2, context=MAX_SEQ_LEN, dtype="fp32"),
        results_dir=tmp_path,
        bandwidth=1e10,
    )
    backend = choice.build()
    want = (
        generate_through("qwen2", StoredKVNaiveBackend(backend))
        if _lossy(backend)
        else reference_tokens("qwen2")
    )
    assert torch.equal(generate_through("qwen2", choice), want), f"choice {choice.backend} {choice.config}"


def test_a_choice_for_another_shape_is_refused_naming_both(tmp_path: Path) -> None:
    """A choice carries its workload: a model whose attention is not the shape it was made for is
    refused in one line that names both geometries."""
    choice = attnbench.select(
        Workload.uniform("llama-3.1-8b", batch=1, context=256, dtype="fp32"),
        results_dir=tmp_path,
        bandwidth=1e10,
    )
    with pytest.raises(UnsupportedModelError, match=r"not the shape this choice was made for") as err:
        use_backend(hf_model("qwen2"), choice, batch=1, max_seq_len=MAX_SEQ_LEN)
    message = str(err.value)
    assert "32 query / 8 KV heads of 128" in message and "llama-3.1-8b" in message and "\n" not in message


def test_shape_read_from_the_model() -> None:
    shape = shape_of(hf_model("llama"))
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 2, 16)
    mla = shape_of(hf_model("deepseek-v3-expanded"))
    assert mla.is_mla and mla.geometry("expanded").v_head_dim == 16 and mla.head_dim == 32


def test_decode_loop_times_a_transformers_model() -> None:
    """The DecodeModel adapter: attnbench.measure.decode.generate's tokens equal transformers' (equal-length prompts)."""
    hf = hf_model("olmo2")
    ids = torch.randint(0, 128, (2, LONG), generator=torch.Generator().manual_seed(3))
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)[:, LONG:]
    try:
        model = TransformersDecodeModel(hf, "naive", batch=2)
        run = generate(model, prompt=ids, new_tokens=12)
    finally:
        hf.set_attn_implementation("sdpa")
    assert torch.equal(run.tokens, want)
    assert run.ttft_s > 0 and len(run.itl_samples_s) == 11 and run.kv_bytes_per_step > 0


# ---------------------------------------------------------------------------------------------------
# refusals: one error naming the feature, the layer and the backend
# ---------------------------------------------------------------------------------------------------
def _per_layer_heads() -> transformers.PreTrainedModel:
    """A Llama whose layer 1 has one KV head where layer 0 has two."""
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=16, **_GQA))
    attn = hf.model.layers[1].self_attn
    attn.k_proj = torch.nn.Linear(64, 16, bias=False)
    attn.v_proj = torch.nn.Linear(64, 16, bias=False)
    attn.num_key_value_groups = 4
    return hf


_BERT = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
)
REFUSED = {
    "gemma2-softcap": (
        lambda: transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(head_dim=16, sliding_window=64, **_GQA)
        ),
        r"attention logit soft-capping \(attn_logit_softcapping = 50\.0\): every layer",
    ),
    "gpt-oss-sinks": (
        lambda: transformers.GptOssForCausalLM(
            transformers.GptOssConfig(
                head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=64, **_GQA
            )
        ),
        r"attention sinks \(s_aux\): layers 0, 1",
    ),
    "falcon-alibi": (
        lambda: transformers.FalconForCausalLM(
            transformers.FalconConfig(
                vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True
            )
        ),
        r"ALiBi position biases: every layer",
    ),
    "gemma3-bidirectional": (  # EmbeddingGemma-style: every layer attends both ways
        lambda: transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(
                head_dim=16, sliding_window=64, use_bidirectional_attention=True, **_GQA
            )
        ),
        r"non-causal \(bidirectional\) attention: layers 0, 1",
    ),
    "bert-cross-attention": (
        lambda: transformers.BertLMHeadModel(
            transformers.BertConfig(is_decoder=True, add_cross_attention=True, **_BERT)
        ),
        r"cross-attention \(an encoder-decoder or add_cross_attention model\)",
    ),
    "mistral-short-window": (
        lambda: transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=16, **_GQA)),
        rf"sliding-window attention \(window 16 < the run's {MAX_SEQ_LEN} tokens.*\): layers 0, 1",
    ),
    "per-layer-heads": (
        _per_layer_heads,
        r"per-layer different head counts \(layer 0: 4 query / 2 KV heads .*layer 1: 4 / 1 .*\): layer 1",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_features_name_the_feature_layer_and_backend(case: str) -> None:
    build, message = REFUSED[case]
    torch.manual_seed(0)
    hf = build().eval()
    with pytest.raises(UnsupportedModelError, match=rf"cannot run through backend 'naive': .*{message}"):
        use_backend(hf, "naive", batch=2, max_seq_len=MAX_SEQ_LEN)


def test_the_latent_mla_form_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"backend 'mla' uses the MLA latent cache"):
        use_backend(hf_model("deepseek-v3-expanded"), "mla", batch=2, max_seq_len=MAX_SEQ_LEN)


def test_a_window_as_long_as_the_run_is_accepted() -> None:
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=16, **_GQA)).eval()
    with attention_through(hf, "naive", batch=1, max_seq_len=16) as cache:
        assert isinstance(cache, BackendCache)


def test_generating_without_the_cache_is_a_clear_error() -> None:
    hf = hf_model("llama")
    ids, mask = batch_inputs()
    with (
        attention_through(hf, "naive", batch=2, max_seq_len=MAX_SEQ_LEN),
        pytest.raises(RuntimeError, match=r"layer 0: the model did not hand its K/V to this cache"),
    ):
        hf.generate(ids, attention_mask=mask, max_new_tokens=2)  # transformers' own cache instead


def test_right_padding_is_refused() -> None:
    hf = hf_model("llama")
    ids, mask = batch_inputs()
    with (
        attention_through(hf, "naive", batch=2, max_seq_len=MAX_SEQ_LEN) as cache,
        pytest.raises(ValueError, match=r"attention mask is not left-padded"),
    ):
        hf.generate(ids, attention_mask=mask.flip(1), max_new_tokens=2, **{cache_kwarg(hf): cache})


# ---------------------------------------------------------------------------------------------------
# --model DIR: shapes and `attnbench decode` on a checkpoint directory
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def small_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private device-profile cache whose bandwidth measurement uses a small buffer (fast)."""
    from attnbench.core import device as device_mod

    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", str(2**20))
    real = device_mod.measure_bandwidth
    monkeypatch.setattr(
        device_mod, "measure_bandwidth", lambda device="cpu", *, nbytes=None: real(device, nbytes=2**22)
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    hf_model("qwen3").save_pretrained(tmp_path / "tiny-qwen3")
    return tmp_path / "tiny-qwen3"


def test_load_shape_reads_a_checkpoint_directory(checkpoint: Path) -> None:
    shape = load_shape(checkpoint)
    assert shape.name == "tiny-qwen3"
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 2, 16)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "num_key_value_heads",
            "eight",
            r"field 'num_key_value_heads' = 'eight': must be a positive integer",
        ),
        ("head_dim", 0, r"field 'head_dim' = 0: must be a positive integer"),
        ("num_hidden_layers", None, r"field 'num_hidden_layers' is missing"),
    ],
)
def test_bad_config_fields_are_one_line_errors(
    checkpoint: Path, field: str, value: object, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ShapeError, match=message):
        load_shape(checkpoint)
    assert main(["decode", "--model", str(checkpoint), "-p", "4", "-n", "3"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and field in err


def test_a_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match=r"directory has no config\.json"):
        load_shape(tmp_path)


def test_decode_command_runs_the_real_model(checkpoint: Path, small_profile: None, cli_json) -> None:  # type: ignore[no-untyped-def]
    r = cli_json("decode", "--model", str(checkpoint), "-p", "6", "-n", "5", "-b", "2", "--dtype", "fp32")
    assert r["model_kind"].startswith("transformers") and r["decode_steps"] == 4 and r["batch"] == 2
    assert r["ttft_s"] > 0 and r["e2e_check_s"] == pytest.approx(r["ttft_s"] + 4 * r["itl_mean_s"])
    assert r["check"]["passed"] and r["num_layers"] == 2


def test_estimate_accepts_a_checkpoint_directory(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["estimate", "--model", str(checkpoint), "--gpu", "h100", "-c", "1k", "-n", "32", "--json"]) == 0
    )
    assert "tiny-qwen3" in capsys.readouterr().out


def test_the_docs_example_runs(tmp_path: Path, small_profile: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/real-models.md's example, from select() to generate(), runs as written."""
    import runpy

    (tmp_path / "results").mkdir()  # an existing, empty results folder: select() answers untuned
    monkeypatch.setenv("ATTNBENCH_RESULTS_DIR", str(tmp_path / "results"))
    text = (Path(__file__).parents[2] / "docs" / "real-models.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "example.py"
    script.write_text(example)
    namespace = runpy.run_path(str(script))
    out, cache = namespace["out"], namespace["cache"]
    assert out.shape == (2, 8 + 32) and cache.kv.seq_lens == (39, 36)


def test_decode_command_runs_deepseek_latent_form(tmp_path: Path, small_profile: None, cli_json) -> None:  # type: ignore[no-untyped-def]
    """With the MLA latent cache (``mla``) a DeepSeek checkpoint runs in the latent decoder instead."""
    hf_model("deepseek-v3-expanded").save_pretrained(tmp_path / "tiny-ds")
    argv = ["decode", "--model", str(tmp_path / "tiny-ds"), "-p", "4", "-n", "3", "--dtype", "fp32"]
    r = cli_json(*argv, "--backend", "mla")
    assert r["model_kind"].startswith("DeepSeek latent decoder") and r["check"]["passed"]
