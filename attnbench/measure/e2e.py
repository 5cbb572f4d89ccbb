"""End to end: a real Hugging Face decoder generates through each path — the user's number.

A *path* is how a model's attention runs:

- ``sdpa`` — transformers' stock path: ``attn_implementation="sdpa"`` with its default
  ``DynamicCache`` (K/V grown by concatenation);
- ``sdpa-static`` — the same with a ``StaticCache`` (preallocated, written in place);
- ``<backend>`` or ``<backend>[key=value,…]`` — attention through an attnbench backend and its own KV
  cache, via :func:`attnbench.integrations.transformers.use_backend` (its prefill: torch SDPA over the
  prompt, then one write into the backend's layout; its decode: the backend's kernel per layer).

Every path runs the same loop (gpt-fast's shape, greedy)::

    prefill:  logits = model(prompt [B, T], cache, logits_to_keep=1); token = argmax   → TTFT
    decode:   N - 1 times: logits = model(token [B, 1], cache, logits_to_keep=1); argmax → ITL each

so the prompt is prefilled once per path and ITL is timed over the decode steps that follow. The
time spent inside the model's attention calls is measured in the same steps (the registered
attention function is wrapped with a timer), which gives the attention share of a step. Before a
backend path is timed it passes the correctness gate (:func:`attnbench.correctness.gate.check`) at the run's
batch and context; its tokens are compared with the first stock path's. A warm-up generation on a
short prompt runs untimed before each path (kernel builds, first allocations).

:func:`run_paths` runs the paths of one (batch, prompt): each prefilled in turn, then their decode
steps interleaved (step ``i`` of every path, in a rotated order, before step ``i + 1`` of any), so
that the ITLs of the paths are compared side by side; :func:`run_path` runs one path;
:class:`PathRun` is its typed record (``to_dict``/``from_dict``).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache, StaticCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnbench.core.timing import synchronize
from attnbench.integrations.transformers import (
    ATTENTION_IMPLEMENTATION,
    bind_cache,
    register_attention,
    use_backend,
)
from attnbench.models.architectures import ARCHITECTURES, hf_config

__all__ = [
    "STOCK_PATHS",
    "GenerationPath",
    "PathRun",
    "load_hf_model",
    "parse_path",
    "run_path",
    "run_paths",
]

#: transformers' own paths: name → (attn_implementation, cache kind)
STOCK_PATHS: dict[str, tuple[str, str]] = {
    "sdpa": ("sdpa", "dynamic"),
    "sdpa-static": ("sdpa", "static"),
    "flash_attention_2": ("flash_attention_2", "dynamic"),  # CUDA with flash-attn installed
}


@dataclass(frozen=True)
class GenerationPath:
    """One way to run a model's attention: a stock transformers path or an attnbench backend."""

    name: str
    backend: str | None = None  # None: a stock path
    config: tuple[tuple[str, Any], ...] = ()

    @property
    def stock(self) -> bool:
        return self.backend is None

    @property
    def config_dict(self) -> dict[str, Any]:
        return dict(self.config)


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_path(text: str, *, backends: Sequence[str]) -> GenerationPath:
    """``"sdpa"``, ``"sdpa-static"``, ``"cpu_decode"`` or ``"cpu_decode[page_size=64,prefetch=2]"``.

    ``backends`` are the registered backend names; an unknown name is refused naming what is accepted.
    """
    text = text.strip()
    if text in STOCK_PATHS:
        return GenerationPath(text)
    name, _, rest = text.partition("[")
    if name not in backends:
        accepted = ", ".join([*STOCK_PATHS, *backends])
        raise ValueError(f"path {text!r}: unknown path or backend {name!r}; accepted: {accepted}")
    config: list[tuple[str, Any]] = []
    if rest:
        if not rest.endswith("]"):
            raise ValueError(f"path {text!r}: a config is written name[key=value,...]")
        for item in filter(None, rest[:-1].split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"path {text!r}: config item {item!r} is not key=value")
            config.append((key.strip(), _value(value.strip())))
    return GenerationPath(text, backend=name, config=tuple(config))


@dataclass
class PathRun:
    """What one path measured at one (batch, prompt length): one typed record, JSON via ``to_dict``.

    Times in seconds; ``itl_s`` and ``attention_s`` hold one value per decode step (``new_tokens - 1``);
    ``tokens`` ``[B][new_tokens]`` the greedy tokens (the first from the prefill).
    """

    path: str
    stock: bool
    backend: str | None
    config: dict[str, Any]
    implementation: str
    batch: int
    prompt_len: int
    new_tokens: int
    dtype: str
    ttft_s: float
    itl_s: list[float]
    attention_s: list[float]
    prefill_attention_s: float
    tokens: list[list[int]]
    gate: str | None = None  # the gate's summary (backend paths)
    tokens_match: bool | None = None  # against the reference path's tokens
    first_mismatch: int | None = None  # index of the first differing new token
    reference: str | None = None  # the path compared with
    prediction: dict[str, float] | None = None  # the cost model's figures (attnbench.cost.generation)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def itl_p50_s(self) -> float:
        return statistics.median(self.itl_s) if self.itl_s else float("nan")

    @property
    def itl_p90_s(self) -> float:
        if len(self.itl_s) < 2:
            return self.itl_p50_s
        return statistics.quantiles(self.itl_s, n=10, method="inclusive")[8]

    @property
    def itl_mean_s(self) -> float:
        return statistics.fmean(self.itl_s) if self.itl_s else float("nan")

    @property
    def e2e_s(self) -> float:
        """TTFT + every decode step: the time to all ``new_tokens`` tokens."""
        return self.ttft_s + sum(self.itl_s)

    @property
    def attention_share(self) -> float:
        """The share of the decode steps' time spent inside the attention calls."""
        total = sum(self.itl_s)
        return sum(self.attention_s) / total if total > 0 else float("nan")

    @property
    def context(self) -> int:
        """Tokens of context a middle decode step attends over (prompt + half the new tokens)."""
        return self.prompt_len + self.new_tokens // 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "itl_p50_s": self.itl_p50_s,
            "itl_p90_s": self.itl_p90_s,
            "itl_mean_s": self.itl_mean_s,
            "e2e_s": self.e2e_s,
            "attention_share": self.attention_share,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PathRun:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


# ---------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------
def load_hf_model(source: str, *, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> tuple[Any, str]:
    """A transformers causal LM in eval mode and its name, from a checkpoint directory (its weights),
    a ``config.json`` (random weights) or an architecture preset (random weights; see
    :func:`attnbench.models.architectures.hf_config`)."""

    path = Path(source)
    if path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        name = path.name
    else:
        if path.is_file():
            config = transformers.AutoConfig.from_pretrained(str(path))
            name = path.stem if path.name != "config.json" else path.parent.name or "config"
        elif source in ARCHITECTURES:
            config = hf_config(source)
            name = source
        else:
            raise ValueError(
                f"model {source!r}: not a checkpoint directory, a config.json or an architecture preset "
                f"({', '.join(ARCHITECTURES)})"
            )
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.eos_token_id = None  # random weights: generate every token, never stop early
    # transformers declares PreTrainedModel.to through functools.wraps, which mypy cannot bind as a method
    return model.to(device).eval(), name  # type: ignore[arg-type]  # see above


@contextlib.contextmanager
def timed_attention(implementation: str, sink: list[float]) -> Iterator[None]:
    """Wrap transformers' registered attention function ``implementation`` with a timer that adds
    each call's seconds to ``sink[0]`` (CPU: no device sync needed; on CUDA the wrapper syncs)."""

    inner = ALL_ATTENTION_FUNCTIONS[implementation]
    cuda = torch.cuda.is_available()

    def timed(*args: Any, **kwargs: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        sink[0] += time.perf_counter() - t0
        return out

    ALL_ATTENTION_FUNCTIONS[implementation] = timed
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = inner


class _Session:
    """One path set up on the model: the cache to pass and the attention implementation in use."""

    def __init__(self, model: Any, path: GenerationPath, *, batch: int, max_seq_len: int) -> None:
        self.model = model
        self.path = path
        self.backend_cache: Any = None
        if path.stock:
            impl, kind = STOCK_PATHS[path.name]
            model.set_attn_implementation(impl)
            self.implementation = impl
            self.kind = kind
            self.describe = f"transformers {impl} + {'StaticCache' if kind == 'static' else 'DynamicCache'}"
        else:
            self.backend_cache = use_backend(
                model, path.backend, config=path.config_dict, batch=batch, max_seq_len=max_seq_len
            )
            self.implementation = ATTENTION_IMPLEMENTATION
            self.kind = "backend"
            workload = self.backend_cache.kv.workload
            self.describe = self.backend_cache.backend.resolve(workload, path.config_dict).implementation
        self.max_seq_len = max_seq_len

    def activate(self) -> None:
        """Make this path the model's attention (several paths may alternate on one model)."""
        if self.kind == "backend":
            bind_cache(self.model, self.backend_cache)
        elif getattr(self.model.config, "_attn_implementation", None) != self.implementation:
            self.model.set_attn_implementation(self.implementation)

    def new_cache(self) -> Any:

        if self.kind == "dynamic":
            return DynamicCache(config=self.model.config)
        if self.kind == "static":
            return StaticCache(config=self.model.config, max_cache_len=self.max_seq_len)
        self.backend_cache.reset()
        return self.backend_cache

    def close(self) -> None:
        self.model.set_attn_implementation("sdpa")
        self.backend_cache = None


class _Running:
    """One path part-way through its generation: its session and cache, the prefill's figures, and the
    decode steps timed so far."""

    def __init__(self, session: _Session, cache: Any, *, new_tokens: int, gate: str | None) -> None:
        self.session, self.cache, self.gate = session, cache, gate
        self.tokens: torch.Tensor | None = None
        self.new_tokens = new_tokens
        self.ttft = self.prefill_attention = 0.0
        self.itl: list[float] = []
        self.attention: list[float] = []

    @property
    def done(self) -> bool:
        return len(self.itl) >= self.new_tokens - 1


def _forward(model: Any, run: _Running, input_ids: torch.Tensor, i: int, sink: list[float]) -> float:
    """``input_ids`` through the model into ``run``'s cache, the greedy choice as new token ``i``: the
    seconds it took (the switch to ``run``'s path is not timed; ``sink[0]``: the attention's share)."""
    assert run.tokens is not None
    run.session.activate()
    sink[0] = 0.0
    synchronize(input_ids.device)
    t0 = time.perf_counter()
    logits = model(input_ids=input_ids, past_key_values=run.cache, use_cache=True, logits_to_keep=1).logits
    run.tokens[:, i] = logits[:, -1].argmax(-1)
    synchronize(input_ids.device)
    return time.perf_counter() - t0


@torch.inference_mode()
def _prefill(model: Any, run: _Running, prompt: torch.Tensor, sink: list[float]) -> None:
    """The prompt through the model into ``run``'s cache; the first token; TTFT."""
    run.tokens = torch.empty(prompt.shape[0], run.new_tokens, dtype=torch.long, device=prompt.device)
    run.ttft = _forward(model, run, prompt, 0, sink)
    run.prefill_attention = sink[0]


@torch.inference_mode()
def _decode_step(model: Any, run: _Running, sink: list[float]) -> None:
    """One greedy decode step of ``run``, timed (the switch to its path is not)."""
    assert run.tokens is not None
    i = len(run.itl) + 1
    run.itl.append(_forward(model, run, run.tokens[:, i - 1 : i], i, sink))
    run.attention.append(sink[0])


def _record(run: _Running, path: GenerationPath, model: Any, prompt: torch.Tensor) -> PathRun:
    assert run.tokens is not None
    batch, prompt_len = prompt.shape
    session = run.session
    return PathRun(
        path=path.name,
        stock=path.stock,
        backend=path.backend,
        config=dict(session.backend_cache.kv.config) if not path.stock else {},
        implementation=session.describe,
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=run.new_tokens,
        dtype=str(model.dtype).removeprefix("torch."),
        ttft_s=run.ttft,
        itl_s=run.itl,
        attention_s=run.attention,
        prefill_attention_s=run.prefill_attention,
        tokens=run.tokens.tolist(),
        gate=run.gate,
    )


def run_paths(
    model: Any,
    paths: Sequence[GenerationPath],
    *,
    prompt: torch.Tensor,
    new_tokens: int,
    gate: Callable[[Any, dict[str, Any]], str] | None = None,
    warmup_tokens: int = 16,
    interleave: bool = True,
) -> tuple[list[PathRun], list[tuple[GenerationPath, Exception]]]:
    """Generate ``new_tokens`` greedy tokens after ``prompt [B, T]`` through each path, timed.

    Each path in turn: ``gate(backend, config)`` (backend paths; it returns the gate's summary or raises
    — such a path is returned under failures, never timed), an untimed warm-up generation
    (``warmup_tokens`` of the prompt, 2 new tokens), then its prefill (TTFT). Then the decode steps,
    with ``interleave`` *interleaved*: step ``i`` of every path before step ``i + 1`` of any, in an
    order rotated by one each step, so a drift of the machine's speed (a shared machine's memory
    bandwidth, its clock) reaches every path alike and the ratios of ITLs are measured side by side.
    Without it each path decodes all its steps before the next path's prefill. Every path's cache is
    held until all are done. Returns the records (in ``paths`` order, less the failed) and the failures.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens = {new_tokens} must be ≥ 2 (one prefill token, then decode steps)")
    batch, prompt_len = prompt.shape
    running: list[tuple[GenerationPath, _Running]] = []
    failed: list[tuple[GenerationPath, Exception]] = []
    sink = [0.0]
    implementations = {STOCK_PATHS[p.name][0] if p.stock else _backend_implementation() for p in paths}
    try:
        with contextlib.ExitStack() as timers:
            for impl in sorted(implementations):
                timers.enter_context(timed_attention(impl, sink))
            for path in paths:
                session = _Session(model, path, batch=batch, max_seq_len=prompt_len + new_tokens)
                try:
                    summary = None
                    if not path.stock and gate is not None:
                        summary = gate(session.backend_cache.backend, dict(session.backend_cache.kv.config))
                except Exception as err:  # the gate's refusal: reported, never timed
                    session.close()
                    failed.append((path, err))
                    continue
                warm = _Running(session, session.new_cache(), new_tokens=2, gate=None)
                _prefill(model, warm, prompt[:, : min(warmup_tokens, prompt_len)], sink)
                _decode_step(model, warm, sink)
                del warm
                gc.collect()
                run = _Running(session, session.new_cache(), new_tokens=new_tokens, gate=summary)
                _prefill(model, run, prompt, sink)
                running.append((path, run))
                if not interleave:
                    while not run.done:
                        _decode_step(model, run, sink)
            for step in range(new_tokens - 1):
                k = step % len(running) if running else 0
                for _path, run in running[k:] + running[:k]:
                    if not run.done:
                        _decode_step(model, run, sink)
        return [_record(run, path, model, prompt) for path, run in running], failed
    finally:
        for _path, run in running:
            run.cache = None
            run.session.close()
        gc.collect()


def _backend_implementation() -> str:
    register_attention()  # the attention function exists before its timer wraps it
    return ATTENTION_IMPLEMENTATION


def run_path(
    model: Any,
    path: GenerationPath,
    *,
    prompt: torch.Tensor,
    new_tokens: int,
    gate: Callable[[Any, dict[str, Any]], str] | None = None,
    warmup_tokens: int = 16,
) -> PathRun:
    """One path alone (:func:`run_paths`); the gate's refusal is raised."""
    runs, failed = run_paths(
        model, [path], prompt=prompt, new_tokens=new_tokens, gate=gate, warmup_tokens=warmup_tokens
    )
    if failed:
        raise failed[0][1]
    return runs[0]


def compare_tokens(run: PathRun, reference: PathRun) -> None:
    """Set ``run``'s token comparison against ``reference`` (same prompt, greedy)."""
    run.reference = reference.path
    differ = [
        i
        for a, b in zip(run.tokens, reference.tokens, strict=True)
        for i, (x, y) in enumerate(zip(a, b, strict=True))
        if x != y
    ]
    run.tokens_match = not differ
    run.first_mismatch = min(differ, default=None)
