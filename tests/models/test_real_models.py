"""The DeepSeek-V3 latent-form decoder against transformers: greedy tokens and logits, per latent backend.

Tiny random-initialised DeepSeek-V3 models (fp32, 2 layers, hidden 64, all-dense layers). For every
registered backend with the MLA latent cache (collected at import time, so backends added later join
automatically), plus a test-only naive attention over the latent form, the decoder must produce
exactly transformers' ``generate(do_sample=False)`` tokens for 32 new tokens, with logits within the
backend's declared tolerance. The other architectures (and DeepSeek's expanded form) run through
transformers' own modules: ``tests/integrations/test_integration_transformers.py``.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from helpers.tiny_hf import seeded, tiny_deepseek

import attnbench
from attnbench.backends.cpu_decode_mla import CpuDecodeMLABackend
from attnbench.backends.cpu_kernel import ISA_CODES, load_kernel
from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import Backend, Tolerance
from attnbench.correctness.gate import within
from attnbench.correctness.reference import compare
from attnbench.integrations.transformers import greedy_reference
from attnbench.measure.decode import DecodeModel, generate
from attnbench.models import DeepseekDecoder, RopeSpec, UnsupportedModelError, from_transformers, load_model

PROMPT_LEN = 8
NEW_TOKENS = 32
BATCH = 2


class LatentNaiveBackend(NaiveBackend):
    """Test-only: naive attention over the MLA latent form (one shared KV head ``[c | k_pe]``, ``v = c``)."""

    name = "test_latent_naive"
    description = "naive attention on the MLA latent form (tests only)"
    kv_form = "latent"


class LatentScalarCpuDecode(CpuDecodeMLABackend):
    """Test-only: cpu_decode_mla's plain-C variant, forced (its AMX and AVX-512 BF16 variants take bf16
    only; these models run in fp32, and the bf16 variant's run is test_cpu_decode_mla_in_bf16 below)."""

    name = "test_cpu_decode_mla_scalar"
    force_isa = "c-scalar"


def _backends() -> dict[str, type[Backend]]:
    found = {entry.name: entry.cls for entry in attnbench.load_registry() if entry.cls.kv_form == "latent"}
    found.setdefault(LatentNaiveBackend.name, LatentNaiveBackend)
    found.setdefault(LatentScalarCpuDecode.name, LatentScalarCpuDecode)
    return found


BACKENDS = _backends()


pytestmark = pytest.mark.usefixtures("one_thread")


def _deepseek_variant() -> transformers.PreTrainedModel:
    return tiny_deepseek(q_lora_rank=None, rope_interleave=False, v_head_dim=32, attention_bias=True)


BUILDERS = {"deepseek-v3-dense": tiny_deepseek, "deepseek-v3-variant": _deepseek_variant}
#: Every latent backend runs each of them.
MAIN_MODELS = tuple(BUILDERS)


@dataclass(frozen=True)
class Reference:
    hf: transformers.PreTrainedModel
    prompt: torch.Tensor  # [B, PROMPT_LEN]
    tokens: torch.Tensor  # [B, NEW_TOKENS]
    logits: torch.Tensor  # [B, NEW_TOKENS, V]: the logits generate() chose each token from


@functools.cache
def reference(name: str) -> Reference:
    """A seeded tiny model (norm weights and biases randomised too) and transformers' greedy output."""
    hf = seeded(BUILDERS[name])
    prompt = torch.randint(
        0, hf.config.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(7)
    )
    tokens, logits = greedy_reference(hf, prompt, new_tokens=NEW_TOKENS)
    assert tokens.shape == (BATCH, NEW_TOKENS)
    return Reference(hf, prompt, tokens, logits.float())


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


# ---------------------------------------------------------------------------------------------------
# greedy tokens and logits, every latent backend × both DeepSeek variants
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend_name", list(BACKENDS))
@pytest.mark.parametrize("model_name", MAIN_MODELS)
def test_greedy_tokens_and_logits_match_transformers(model_name: str, backend_name: str) -> None:
    """Tokens equal transformers' greedy tokens, logits within the backend's declared tolerance."""
    backend = BACKENDS[backend_name]()
    ref = reference(model_name)
    tokens, logits = run_greedy(model_name, backend)
    tol = logits_tolerance(backend.tolerance(torch.float32), ref.logits)
    stats = compare(logits, ref.logits.double())
    same = int((tokens == ref.tokens).sum())
    workload = load_model(ref.hf, backend=backend, batch=BATCH).workload(max_seq_len=PROMPT_LEN + NEW_TOKENS)
    print(
        f"\n{model_name} × {backend_name} [{backend.kv_form}; {backend.implementation(workload)}]: tokens "
        f"{same}/{ref.tokens.numel()} equal transformers'; logits max_abs {stats.max_abs:.2e} (|logits| ≤ "
        f"{float(ref.logits.abs().max()):.2f}), rel_l2 {stats.rel_l2:.2e}, cosine {stats.cosine:.9f}"
    )
    assert torch.equal(tokens, ref.tokens), f"{same}/{ref.tokens.numel()} tokens equal transformers'"
    failures = within(stats, tol)
    assert not failures, f"logits vs transformers: {'; '.join(failures)} (tolerance {tol})"


def test_mla_torch_path() -> None:
    """The mla backend's torch path (its Triton kernel is the default, interpreted here) on a real model."""
    if "mla" not in BACKENDS:
        pytest.skip("backend 'mla' is not registered")
    ref = reference("deepseek-v3-dense")
    model = load_model(
        ref.hf,
        backend=BACKENDS["mla"](),
        backend_config={"kernel": "torch"},
        dtype=torch.float32,
        batch=BATCH,
    )
    assert not model.unsupported(max_seq_len=PROMPT_LEN + NEW_TOKENS)
    run = generate(model, prompt=ref.prompt, new_tokens=NEW_TOKENS, keep_logits=True)
    assert model.cache is not None
    impl = model.cache.implementation  # the declared attribute of mla's cache
    assert impl == "torch", f"expected the torch path, ran {impl}"
    assert torch.equal(run.tokens.cpu(), ref.tokens)
    tol = logits_tolerance(model.backend.tolerance(torch.float32), ref.logits)
    assert not within(compare(torch.stack(run.logits, dim=1).cpu(), ref.logits.double()), tol)


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
    assert LatentNaiveBackend.name in runnable


def test_decoders_are_decode_models() -> None:
    mla = load_model(reference("deepseek-v3-dense").hf, backend=LatentNaiveBackend(), dtype=torch.float32)
    assert isinstance(mla, DeepseekDecoder) and isinstance(mla, DecodeModel)
    assert mla.shape.is_mla and mla.shape.kv_lora_rank == 32
    hf = reference("deepseek-v3-variant").hf
    assert load_model(hf, backend="mla").shape.num_params == sum(p.numel() for p in hf.parameters())


# ---------------------------------------------------------------------------------------------------
# ragged prompts, checkpoints, config formats
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_name", MAIN_MODELS)
@pytest.mark.parametrize("backend_name", [LatentNaiveBackend.name])
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


@pytest.mark.parametrize("model_name", MAIN_MODELS)
def test_checkpoint_directory_gives_same_tokens(model_name: str, tmp_path: Path) -> None:
    ref = reference(model_name)
    ref.hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    tokens, _ = run_greedy(model_name, LatentNaiveBackend(), source=tmp_path)
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
    ref = reference("deepseek-v3-dense")
    ref.hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    if "rope_parameters" in config:  # transformers 5 writes the new form; transformers 4 the old one already
        rope = dict(config.pop("rope_parameters"))
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
    path.write_text(json.dumps(config))
    tokens, _ = run_greedy("deepseek-v3-dense", LatentNaiveBackend(), source=tmp_path)
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

    if int(transformers.__version__.split(".")[0]) >= 5:
        rope: dict = {"rope_parameters": dict(params)}
    else:  # transformers 4: top-level rope_theta, rope_scaling without the theta
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        rope = {"rope_theta": params["rope_theta"], "rope_scaling": scaling if len(scaling) > 1 else None}
    cfg = transformers.LlamaConfig(
        hidden_size=1024, num_attention_heads=8, head_dim=128, max_position_embeddings=131072, **rope
    )
    ours = RopeSpec.from_config(cfg.to_dict(), model="test").inv_freq(128)
    init = ROPE_INIT_FUNCTIONS.get(params["rope_type"])
    if init is None:  # transformers 5 computes the default frequencies in the rotary module
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding
        theirs, _ = rotary.compute_default_rope_parameters(cfg)
    elif "device" in inspect.signature(init).parameters:  # transformers 4
        theirs, _ = init(cfg, None)
    else:
        theirs, _ = init(cfg)
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------------
# clear errors for what is not supported
# ---------------------------------------------------------------------------------------------------
def _config_and_weights(name: str) -> tuple[dict, dict]:
    return from_transformers(reference(name).hf)


def test_moe_layers_are_refused() -> None:
    torch.manual_seed(0)
    hf = tiny_deepseek(first_k_dense_replace=1)
    with pytest.raises(UnsupportedModelError, match=r"MoE layers are not supported: layers 1\.\.1 of 2"):
        load_model(hf, backend="mla")


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        pytest.param(
            {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            r"rope scaling type 'yarn' is not supported",
            id="yarn",
        ),
        pytest.param(  # an mscale that changes the softmax scale
            {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0, "mscale_all_dim": 1.0},
            r"mscale.*softmax scale",
            id="mscale",
        ),
        *(
            pytest.param(
                {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0},
                rf"rope scaling type '{rope_type}' is not supported",
                id=rope_type,
            )
            for rope_type in ("dynamic", "longrope")
        ),
        pytest.param(
            {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0},
            r"llama3 rope scaling needs field 'low_freq_factor'",
            id="incomplete-llama3",
        ),
    ],
)
def test_unsupported_rope_scalings_are_refused(rope: dict, message: str) -> None:
    config, weights = _config_and_weights("deepseek-v3-dense")
    config["rope_parameters"] = rope
    with pytest.raises(UnsupportedModelError, match=message):
        DeepseekDecoder.from_weights(config, weights, backend=LatentNaiveBackend())


def test_unknown_architecture_is_refused() -> None:
    config, weights = _config_and_weights("deepseek-v3-dense")
    config["model_type"] = "gpt2"
    with pytest.raises(
        UnsupportedModelError,
        match=r"model_type 'gpt2' is not supported by this decoder; supported: deepseek_v3",
    ):
        DeepseekDecoder.from_weights(config, weights, backend=LatentNaiveBackend())


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_other_architectures_in_a_checkpoint_point_to_the_integration(
    model_type: str, tmp_path: Path
) -> None:
    ref = reference("deepseek-v3-dense")
    ref.hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError,
        match=rf"model_type '{model_type}'.*no hand-written decoder \(supported: deepseek_v3\); run it through "
        r"transformers' own modeling code with attnbench\.integrations\.transformers\.use_backend",
    ):
        load_model(tmp_path, backend="mla")


def test_unused_weights_are_refused() -> None:
    config, weights = _config_and_weights("deepseek-v3-dense")
    weights["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.randn(4, 4)
    with pytest.raises(
        UnsupportedModelError, match=r"weights this decoder does not use: model\.layers\.0\.mlp\.experts"
    ):
        DeepseekDecoder.from_weights(config, weights, backend=LatentNaiveBackend())


def test_weight_shape_mismatch_is_refused() -> None:
    config, weights = _config_and_weights("deepseek-v3-dense")
    config["kv_lora_rank"] = 16
    with pytest.raises(
        UnsupportedModelError,
        match=r"kv_a_proj_with_mqa\.weight' has shape \(48, 64\); the config implies \(32, 64\)",
    ):
        DeepseekDecoder.from_weights(config, weights, backend=LatentNaiveBackend())


def test_an_expanded_backend_is_pointed_to_the_integration() -> None:
    model = load_model(reference("deepseek-v3-dense").hf, backend="naive", dtype=torch.float32)
    with pytest.raises(
        UnsupportedModelError,
        match=r"backend 'naive' keeps the expanded per-head cache; this decoder runs DeepSeek's absorbed "
        r"latent form only .* attnbench\.integrations\.transformers\.use_backend",
    ):
        model.setup(4, 4)


def test_unsupported_activation_is_refused() -> None:
    config, weights = _config_and_weights("deepseek-v3-dense")
    config["hidden_act"] = "quick_gelu"
    with pytest.raises(UnsupportedModelError, match=r"hidden_act 'quick_gelu' is not supported"):
        DeepseekDecoder.from_weights(config, weights, backend=LatentNaiveBackend())


def test_decode_before_setup_is_a_clear_error() -> None:
    model = load_model(reference("deepseek-v3-dense").hf, backend="mla", dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"call setup\(\)"):
        model.decode_step(torch.zeros(1, dtype=torch.long))


def test_not_a_checkpoint_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights \(found pytorch_model\.bin"):
        load_model(tmp_path, backend="mla")


def test_logits_tolerance_scales_only_max_abs() -> None:
    tol = Tolerance(max_abs=1e-5, rel_l2=1e-5, min_cosine=0.99)
    assert logits_tolerance(tol, torch.tensor([0.5])) == tol
    assert math.isclose(logits_tolerance(tol, torch.tensor([-8.0])).max_abs, 8e-5)


def _forced_logits(model: DecodeModel, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, N, V]`` of ``model`` fed transformers' own greedy ``tokens`` (teacher forcing: the
    runs compared never diverge on a rounding-close argmax)."""
    model.setup(prompt.shape[1], tokens.shape[1])
    out = [model.prefill(prompt, lengths=[prompt.shape[1]] * prompt.shape[0])]
    for i in range(tokens.shape[1] - 1):
        out.append(model.decode_step(tokens[:, i]))
    return torch.stack(out, dim=1).cpu().double()


def test_cpu_decode_mla_in_bf16() -> None:
    """cpu_decode_mla's bf16 variant (AMX where granted, else AVX-512 BF16) drives the hand-written
    DeepSeek-V3 decoder in bf16 (a latent row of 96 = rank 64 + rope 32, which both take). Fed
    transformers' fp32 greedy tokens, its logits are no further from transformers' fp32 logits than
    those of the same bf16 decoder with naive attention (scores, softmax and P·V in bf16 torch ops), and
    within bf16's tolerance of them."""
    kernel = load_kernel()
    if isinstance(kernel, str) or kernel.isa < ISA_CODES["c-avx512bf16"]:
        pytest.skip("neither AVX-512 BF16 nor AMX-BF16 on this CPU (or no kernel)")
    variant = "c-amx" if kernel.fp8_level >= 2 else "c-avx512bf16"
    hf = seeded(lambda: tiny_deepseek(kv_lora_rank=64, qk_rope_head_dim=32))
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, hf.config.vocab_size, (BATCH, PROMPT_LEN), generator=gen)
    tokens, ref = greedy_reference(hf, prompt, new_tokens=NEW_TOKENS)
    ref = ref.double()
    stats = {}
    for name, backend in (("kernel", CpuDecodeMLABackend()), ("naive", LatentNaiveBackend())):
        model = load_model(hf, backend=backend, dtype=torch.bfloat16, batch=BATCH)
        assert not model.unsupported(max_seq_len=PROMPT_LEN + NEW_TOKENS)
        stats[name] = compare(_forced_logits(model, prompt, tokens), ref)
        if name == "kernel":
            assert model.cache is not None and getattr(model.cache, "isa", None) == variant
    assert stats["kernel"].rel_l2 <= 1.5 * stats["naive"].rel_l2, stats
    tol = logits_tolerance(Tolerance(max_abs=6e-2, rel_l2=3e-2, min_cosine=0.999), ref)
    assert not within(stats["kernel"], tol), (stats, tol)
