"""Real decoders against transformers: greedy tokens and logits, per registered backend.

Tiny random-initialised transformers models (fp32, 2 layers, hidden 64): Llama with GQA and Llama-3
rope scaling, Qwen2 with q/k/v biases, DeepSeek-V3 with all-dense layers (MLA). For every backend in
the registry (collected at import time, so backends added later join automatically) the attnbench
decoder must produce exactly transformers' ``generate(do_sample=False)`` tokens for 32 new tokens,
with logits within the backend's declared tolerance. A backend whose ``supports()`` refuses the
shape is skipped with its reason; at least one backend must run each model. A backend with a lossy
cache (fp8) is held instead to naive attention over K/V as it stores them (see the main test).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

import attnbench
from attnbench.backend import Backend, KVCache, StepPlan, Tolerance
from attnbench.backends.naive import NaiveBackend
from attnbench.decode import DecodeModel, generate
from attnbench.gate import within
from attnbench.models import (
    DeepseekDecoder,
    LlamaDecoder,
    RopeSpec,
    UnsupportedModelError,
    from_transformers,
    load_model,
)
from attnbench.reference import compare

PROMPT_LEN = 8
NEW_TOKENS = 32
BATCH = 2


class LatentNaiveBackend(NaiveBackend):
    """Test-only: naive attention over the MLA latent form (one shared KV head ``[c | k_pe]``, ``v = c``)."""

    name = "test_latent_naive"
    description = "naive attention on the MLA latent form (tests only)"
    kv_form = "latent"


def _backends() -> dict[str, type[Backend]]:
    found = {entry.name: entry.cls for entry in attnbench.load_registry()}
    found.setdefault(LatentNaiveBackend.name, LatentNaiveBackend)
    return found


BACKENDS = _backends()

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # wide logits: top-1 well clear of top-2, so fp32 rounding cannot flip a token
    bos_token_id=None,
    eos_token_id=None,  # never stop early: all 32 tokens are compared
    pad_token_id=None,
)


def _llama() -> transformers.PreTrainedModel:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,  # short, so that all three frequency bands occur
    }
    cfg = transformers.LlamaConfig(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=rope, **_COMMON
    )
    return transformers.LlamaForCausalLM(cfg)


def _qwen2() -> transformers.PreTrainedModel:
    # MQA, q/k/v biases, tied embeddings (as the small Qwen2.5 models)
    cfg = transformers.Qwen2Config(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, **_COMMON
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _mistral() -> transformers.PreTrainedModel:
    cfg = transformers.MistralConfig(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=64, **_COMMON
    )
    return transformers.MistralForCausalLM(cfg)


def _deepseek(**overrides: object) -> transformers.PreTrainedModel:
    fields = dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,  # Dk = 32 != Dv = 16, as in the real model (192 / 128)
        first_k_dense_replace=2,  # = num_hidden_layers: all layers dense
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        **_COMMON,
    )
    fields.update(overrides)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields))


def _deepseek_variant() -> transformers.PreTrainedModel:
    return _deepseek(q_lora_rank=None, rope_interleave=False, v_head_dim=32, attention_bias=True)


BUILDERS = {
    "llama-gqa-rope3": _llama,
    "qwen2-bias": _qwen2,
    "deepseek-v3-dense": _deepseek,
    "mistral": _mistral,
    "deepseek-v3-variant": _deepseek_variant,
}
#: The models the issue names; every registered backend runs each of them.
MAIN_MODELS = ("llama-gqa-rope3", "qwen2-bias", "deepseek-v3-dense")


@dataclass(frozen=True)
class Reference:
    hf: transformers.PreTrainedModel
    prompt: torch.Tensor  # [B, PROMPT_LEN]
    tokens: torch.Tensor  # [B, NEW_TOKENS]
    logits: torch.Tensor  # [B, NEW_TOKENS, V]: the logits generate() chose each token from


@functools.cache
def reference(name: str) -> Reference:
    """A seeded tiny model (norm weights and biases randomised too) and transformers' greedy output."""
    torch.manual_seed(1234)
    hf = BUILDERS[name]().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif pname.endswith(".bias"):  # zero-initialised; make them matter
                p.copy_(0.5 * torch.randn_like(p))
    prompt = torch.randint(
        0, hf.config.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(7)
    )
    out = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, PROMPT_LEN:]
    assert tokens.shape == (BATCH, NEW_TOKENS)
    return Reference(hf, prompt, tokens, torch.stack(out.logits, dim=1).float())


def logits_tolerance(tol: Tolerance, ref: torch.Tensor) -> Tolerance:
    """The backend's attention tolerance applied to logits: ``max_abs`` scaled by the logits' magnitude
    (the declared bound is for O(1) outputs); ``rel_l2`` and cosine as declared."""
    scale = max(1.0, float(ref.abs().max()))
    return Tolerance(max_abs=tol.max_abs * scale, rel_l2=tol.rel_l2, min_cosine=tol.min_cosine)


def run_greedy(
    name: str, backend: Backend, *, source: object | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """attnbench's greedy run of model ``name``: ``(tokens [B, N], logits [B, N, V])``; skips if refused."""
    ref = reference(name)
    model = load_model(
        ref.hf if source is None else source, backend=backend, dtype=torch.float32, batch=BATCH
    )
    reasons = model.unsupported(max_seq_len=PROMPT_LEN + NEW_TOKENS)
    if reasons:
        pytest.skip(f"backend {backend.name!r} refuses {name}: {'; '.join(reasons)}")
    run = generate(model, prompt=ref.prompt, new_tokens=NEW_TOKENS, keep_logits=True)
    return run.tokens.cpu(), torch.stack(run.logits, dim=1).cpu()


def teacher_forced_logits(name: str, backend: Backend) -> torch.Tensor:
    """Logits ``[B, N, V]`` when fed transformers' own tokens (so a lossy backend's error does not compound)."""
    ref = reference(name)
    model = load_model(ref.hf, backend=backend, dtype=torch.float32, batch=BATCH)
    model.setup(PROMPT_LEN, NEW_TOKENS)
    out = [model.prefill(ref.prompt)]
    out += [model.decode_step(ref.tokens[:, j]) for j in range(NEW_TOKENS - 1)]
    return torch.stack(out, dim=1).cpu()


class StoredKVNaiveBackend(NaiveBackend):
    """Test-only: naive attention over K/V exactly as ``lossy`` stores them (its ``reference_kv``).

    Appended and decoded K/V pass through ``lossy.reference_kv`` before they are cached; prefill
    attends on the given K/V (the protocol's default), as the lossy backend's prefill does.
    """

    name = "test_stored_kv_naive"
    description = "naive attention over another backend's stored (e.g. fp8) K/V (tests only)"

    def __init__(self, lossy: Backend) -> None:
        self.lossy = lossy
        self.lossy_config = lossy.default_config()

    def _stored(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self.lossy.reference_kv(k, v, config=self.lossy_config)
        return ks.to(k.dtype), vs.to(v.dtype)

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = self._stored(k, v)
        super().append(cache, plan, layer=layer, k=k, v=v)

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        ks, vs = self._stored(k[:, None], v[:, None])
        return super().decode(cache, plan, layer=layer, q=q, k=ks[:, 0], v=vs[:, 0])


def stores_kv_inexactly(backend: Backend) -> bool:
    """True when the backend declares a lossy cache (``reference_kv`` is not ``None``), e.g. fp8."""
    k = torch.randn(1, 3, 2, 16)
    return backend.reference_kv(k, k.clone(), config=backend.default_config()) is not None


# ---------------------------------------------------------------------------------------------------
# greedy tokens and logits, every registered backend × the three named models
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("model_name", MAIN_MODELS)
def test_greedy_tokens_and_logits_match_transformers(model_name: str, backend_name: str) -> None:
    """Exact backends: tokens equal transformers' greedy tokens, logits within the backend's tolerance.

    A backend that stores K/V inexactly (fp8) cannot reproduce fp32 greedy tokens in general (its
    quantisation error is far larger than the top-1/top-2 gaps of a random model); it must instead
    give exactly the tokens of naive attention over K/V as it stores them, with logits within its
    declared stored-K/V tolerance. Its distance from transformers is printed (teacher-forced).
    """
    backend = BACKENDS[backend_name]()
    ref = reference(model_name)
    tokens, logits = run_greedy(model_name, backend)
    matched = int((tokens == ref.tokens).sum())
    lossy = stores_kv_inexactly(backend)
    if lossy:
        forced = compare(teacher_forced_logits(model_name, backend), ref.logits.double())
        want_tokens, want_logits = run_greedy(model_name, StoredKVNaiveBackend(backend))
        tol = logits_tolerance(backend.stored_tolerance(torch.float32), want_logits)
        against = "naive over the backend's stored K/V"
    else:
        want_tokens, want_logits = ref.tokens, ref.logits
        tol = logits_tolerance(backend.tolerance(torch.float32), ref.logits)
        against = "transformers"
    stats = compare(logits, want_logits.double())
    same = int((tokens == want_tokens).sum())
    workload = load_model(ref.hf, backend=backend, batch=BATCH).workload(max_seq_len=PROMPT_LEN + NEW_TOKENS)
    print(
        f"\n{model_name} × {backend_name} [{backend.kv_form}; {backend.implementation(workload)}]: tokens {matched}/{ref.tokens.numel()} equal "
        f"transformers'; logits vs {against}: max_abs {stats.max_abs:.2e} (|logits| ≤ "
        f"{float(want_logits.abs().max()):.2f}), rel_l2 {stats.rel_l2:.2e}, cosine {stats.cosine:.9f}"
    )
    if lossy:
        top2 = ref.logits.topk(2, dim=-1).values
        gap = top2[..., 0] - top2[..., 1]  # [B, N]
        differ = [
            int((row != want).nonzero()[0]) if (row != want).any() else None
            for row, want in zip(tokens, ref.tokens, strict=True)
        ]
        print(
            f"  lossy cache: tokens {same}/{want_tokens.numel()} equal {against}'s; teacher-forced logits vs "
            f"transformers: max_abs {forced.max_abs:.2e}, rel_l2 {forced.rel_l2:.2e}, cosine {forced.cosine:.6f}; "
            f"transformers' top-1/top-2 logit gap median {float(gap.median()):.3f}, min {float(gap.min()):.4f}; "
            f"first new token differing from transformers' per sequence: {differ}"
        )
    assert torch.equal(tokens, want_tokens), f"{same}/{want_tokens.numel()} tokens equal {against}'s"
    failures = within(stats, tol)
    assert not failures, f"logits vs {against}: {'; '.join(failures)} (tolerance {tol})"


def _other_implementation(backend_name: str) -> Backend:
    """The path a backend does not take by default on a CPU test run (its Triton kernel or its torch path)."""
    cls = BACKENDS[backend_name]
    if backend_name == "fp8":  # auto = torch on the CPU; the Triton path is chosen by a class attribute
        return type("FP8TritonPath", (cls,), {"kernel": "triton"})()
    return cls()


@pytest.mark.parametrize(
    ("model_name", "backend_name", "config", "path"),
    [("deepseek-v3-dense", "mla", {"kernel": "torch"}, "torch"), ("llama-gqa-rope3", "fp8", {}, "triton")],
    ids=["deepseek-mla-torch", "llama-fp8-triton"],
)
def test_non_default_kernel_paths(model_name: str, backend_name: str, config: dict, path: str) -> None:
    """The built-ins' other implementation (mla's torch path, fp8's interpreted Triton kernel) on a real model."""
    if backend_name not in BACKENDS:
        pytest.skip(f"backend {backend_name!r} is not registered")
    backend = _other_implementation(backend_name)
    ref = reference(model_name)
    model = load_model(ref.hf, backend=backend, backend_config=config, dtype=torch.float32, batch=BATCH)
    assert not model.unsupported(max_seq_len=PROMPT_LEN + NEW_TOKENS)
    run = generate(model, prompt=ref.prompt, new_tokens=NEW_TOKENS, keep_logits=True)
    tokens, logits = run.tokens.cpu(), torch.stack(run.logits, dim=1).cpu()
    if stores_kv_inexactly(backend):
        want_tokens, want_logits = run_greedy(model_name, StoredKVNaiveBackend(backend))
        tol = logits_tolerance(backend.stored_tolerance(torch.float32), want_logits)
    else:
        want_tokens, want_logits = ref.tokens, ref.logits
        tol = logits_tolerance(backend.tolerance(torch.float32), ref.logits)
    stats = compare(logits, want_logits.double())
    assert model.cache is not None
    impl = str(model.cache.config.get("implementation") or getattr(model.cache, "path", "?"))
    print(
        f"\n{model_name} × {backend_name} {config} [{impl}]: logits max_abs {stats.max_abs:.2e}, rel_l2 {stats.rel_l2:.2e}"
    )
    assert impl == path, f"expected the {path} path, ran {impl}"
    assert torch.equal(tokens, want_tokens)
    assert not within(stats, tol)


@pytest.mark.parametrize("model_name", MAIN_MODELS)
def test_some_backend_runs_each_model(model_name: str) -> None:
    """The parametrised test above may skip a backend; here at least one must accept each model."""
    ref = reference(model_name)
    runnable = []
    for name, cls in BACKENDS.items():
        model = load_model(ref.hf, backend=cls(), dtype=torch.float32, batch=BATCH)
        if not model.unsupported(max_seq_len=PROMPT_LEN + NEW_TOKENS):
            runnable.append(name)
    assert runnable, f"no backend accepts {model_name}"
    assert "naive" in runnable


@pytest.mark.parametrize(
    ("model_name", "backend_name"),
    [
        ("mistral", "naive"),
        ("deepseek-v3-variant", "naive"),
        ("deepseek-v3-variant", LatentNaiveBackend.name),
    ],
)
def test_more_variants_match_transformers(model_name: str, backend_name: str) -> None:
    """Mistral (sliding window wider than the sequence); DeepSeek without q LoRA, non-interleaved RoPE,
    Dk == Dv and attention biases."""
    backend = BACKENDS[backend_name]()
    ref = reference(model_name)
    tokens, logits = run_greedy(model_name, backend)
    assert torch.equal(tokens, ref.tokens)
    tol = logits_tolerance(backend.tolerance(torch.float32), ref.logits)
    assert not within(compare(logits, ref.logits.double()), tol)


def test_decoders_are_decode_models() -> None:
    model = load_model(reference("llama-gqa-rope3").hf, backend="naive", dtype=torch.float32)
    assert isinstance(model, LlamaDecoder)
    assert isinstance(model, DecodeModel)
    mla = load_model(reference("deepseek-v3-dense").hf, backend="naive", dtype=torch.float32)
    assert isinstance(mla, DeepseekDecoder)
    assert mla.shape.is_mla and mla.shape.kv_lora_rank == 32
    qwen = reference("qwen2-bias").hf  # tied embeddings: counted once
    assert load_model(qwen, backend="naive").shape.num_params == sum(p.numel() for p in qwen.parameters())


# ---------------------------------------------------------------------------------------------------
# ragged prompts, checkpoints, config formats
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model_name", "backend_name"),
    [
        ("llama-gqa-rope3", "naive"),
        ("deepseek-v3-dense", "naive"),
        ("deepseek-v3-dense", LatentNaiveBackend.name),
    ],
)
def test_ragged_prompts_match_per_sequence_generate(model_name: str, backend_name: str) -> None:
    """Right-padded prompts of different lengths in one batch: each sequence's tokens equal
    transformers' greedy tokens for that prompt alone (RoPE positions and cache lengths per sequence)."""
    ref = reference(model_name)
    model = load_model(ref.hf, backend=BACKENDS[backend_name](), dtype=torch.float32, batch=2)
    lengths = [PROMPT_LEN, 3]
    prompt = ref.prompt.clone()
    prompt[1, lengths[1] :] = 0  # padding: must not leak into sequence 1
    model.setup(PROMPT_LEN, 12)
    logits = model.prefill(prompt, lengths=lengths)
    ours = []
    for _ in range(12):
        token = logits.argmax(-1)
        ours.append(token)
        logits = model.decode_step(token)
    ours_t = torch.stack(ours, dim=1)
    for i, n in enumerate(lengths):
        alone = ref.hf.generate(prompt[i : i + 1, :n], max_new_tokens=12, do_sample=False)[0, n:]
        assert torch.equal(ours_t[i], alone), f"sequence {i} (prompt {n} tokens)"


@pytest.mark.parametrize("model_name", ["llama-gqa-rope3", "qwen2-bias", "deepseek-v3-dense"])
def test_checkpoint_directory_gives_same_tokens(model_name: str, tmp_path: Path) -> None:
    ref = reference(model_name)
    ref.hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    tokens, _ = run_greedy(model_name, NaiveBackend(), source=tmp_path)
    assert torch.equal(tokens, ref.tokens)


def test_sharded_checkpoint_directory(tmp_path: Path) -> None:
    ref = reference("deepseek-v3-dense")
    ref.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    tokens, _ = run_greedy("deepseek-v3-dense", LatentNaiveBackend(), source=tmp_path)
    assert torch.equal(tokens, ref.tokens)


def test_older_config_format_rope_scaling(tmp_path: Path) -> None:
    """A config.json with top-level ``rope_theta`` + ``rope_scaling`` (the pre-v5 form) reads the same."""
    ref = reference("llama-gqa-rope3")
    ref.hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    path.write_text(json.dumps(config))
    tokens, _ = run_greedy("llama-gqa-rope3", NaiveBackend(), source=tmp_path)
    assert torch.equal(tokens, ref.tokens)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_frequencies_equal_transformers(params: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        head_dim=128,
        rope_parameters=dict(params),
        max_position_embeddings=131072,
    )
    ours = RopeSpec.from_config(cfg.to_dict(), model="test").inv_freq(128)
    if params["rope_type"] == "default":
        theirs, _ = (
            transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        )
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg)
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------------
# clear errors for what is not supported
# ---------------------------------------------------------------------------------------------------
def _config_and_weights(name: str) -> tuple[dict, dict]:
    return from_transformers(reference(name).hf)


def test_moe_layers_are_refused() -> None:
    torch.manual_seed(0)
    hf = _deepseek(first_k_dense_replace=1)
    with pytest.raises(UnsupportedModelError, match=r"MoE layers are not supported: layers 1\.\.1 of 2"):
        load_model(hf, backend="naive")


def test_yarn_rope_is_refused() -> None:
    config, weights = _config_and_weights("deepseek-v3-dense")
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    with pytest.raises(UnsupportedModelError, match=r"rope scaling type 'yarn' is not supported"):
        DeepseekDecoder.from_weights(config, weights, backend=NaiveBackend())


def test_mscale_that_changes_the_softmax_scale_is_refused() -> None:
    config, weights = _config_and_weights("deepseek-v3-dense")
    config["rope_parameters"] = {
        "rope_type": "linear",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "mscale_all_dim": 1.0,
    }
    with pytest.raises(UnsupportedModelError, match=r"mscale.*softmax scale"):
        DeepseekDecoder.from_weights(config, weights, backend=NaiveBackend())


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_other_rope_scalings_are_refused(rope_type: str) -> None:
    config, weights = _config_and_weights("llama-gqa-rope3")
    config["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match=rf"rope scaling type '{rope_type}' is not supported"):
        LlamaDecoder.from_weights(config, weights, backend=NaiveBackend())


def test_incomplete_llama3_rope_scaling_is_refused() -> None:
    config, weights = _config_and_weights("llama-gqa-rope3")
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    with pytest.raises(UnsupportedModelError, match=r"llama3 rope scaling needs field 'low_freq_factor'"):
        LlamaDecoder.from_weights(config, weights, backend=NaiveBackend())


def test_unknown_architecture_is_refused() -> None:
    config, weights = _config_and_weights("llama-gqa-rope3")
    config["model_type"] = "gpt2"
    with pytest.raises(
        UnsupportedModelError,
        match=r"model_type 'gpt2' is not supported by this decoder; supported: llama, mistral, qwen2",
    ):
        LlamaDecoder.from_weights(config, weights, backend=NaiveBackend())


def test_unknown_architecture_in_checkpoint_is_refused(tmp_path: Path) -> None:
    ref = reference("llama-gqa-rope3")
    ref.hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "mixtral"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"model_type 'mixtral'.*supported: llama, mistral, qwen2, deepseek_v3"
    ):
        load_model(tmp_path, backend="naive")


def test_unused_weights_are_refused() -> None:
    config, weights = _config_and_weights("llama-gqa-rope3")
    weights["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.randn(4, 4)
    with pytest.raises(
        UnsupportedModelError, match=r"weights this decoder does not use: model\.layers\.0\.mlp\.experts"
    ):
        LlamaDecoder.from_weights(config, weights, backend=NaiveBackend())


def test_weight_shape_mismatch_is_refused() -> None:
    config, weights = _config_and_weights("llama-gqa-rope3")
    config["num_key_value_heads"] = 4
    with pytest.raises(
        UnsupportedModelError, match=r"k_proj\.weight' has shape \(32, 64\); the config implies \(64, 64\)"
    ):
        LlamaDecoder.from_weights(config, weights, backend=NaiveBackend())


def test_sliding_window_shorter_than_the_sequence_is_refused() -> None:
    model = load_model(reference("mistral").hf, backend="naive", dtype=torch.float32)
    assert not model.unsupported(max_seq_len=64)
    with pytest.raises(
        UnsupportedModelError, match=r"sliding-window attention \(window 64\) is not supported"
    ):
        model.setup(60, 5)


def test_latent_backend_on_a_non_mla_model_is_refused() -> None:
    model = load_model(reference("llama-gqa-rope3").hf, backend=LatentNaiveBackend(), dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match=r"MLA latent cache; .* is not an MLA model"):
        model.setup(4, 4)


def test_unsupported_activation_is_refused() -> None:
    config, weights = _config_and_weights("qwen2-bias")
    config["hidden_act"] = "quick_gelu"
    with pytest.raises(UnsupportedModelError, match=r"hidden_act 'quick_gelu' is not supported"):
        LlamaDecoder.from_weights(config, weights, backend=NaiveBackend())


def test_decode_before_setup_is_a_clear_error() -> None:
    model = load_model(reference("qwen2-bias").hf, backend="naive", dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"call setup\(\)"):
        model.decode_step(torch.zeros(1, dtype=torch.long))


def test_not_a_checkpoint_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights \(found pytorch_model\.bin"):
        load_model(tmp_path, backend="naive")


def test_logits_tolerance_scales_only_max_abs() -> None:
    tol = Tolerance(max_abs=1e-5, rel_l2=1e-5, min_cosine=0.99)
    assert logits_tolerance(tol, torch.tensor([0.5])) == tol
    assert math.isclose(logits_tolerance(tol, torch.tensor([-8.0])).max_abs, 8e-5)
