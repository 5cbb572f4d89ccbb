"""The backend protocol: what an attention backend must provide.

A backend owns the layout of the KV cache and the attention computation over it. One decode step is
split into host-side planning and per-layer work (the FlashInfer ``plan()``/``run()`` split)::

    cache = backend.create_cache(workload, config=config, num_layers=L, max_seq_len=S)
    plan = backend.plan(cache, num_new=[T] * B)             # host work, once per step; may allocate
    for layer in range(L): out = backend.prefill(cache, plan, layer=layer, q=q, k=k, v=v)  # [B, T, Hq, Dk]
    cache.commit(plan)
    plan = backend.plan(cache, num_new=[1] * B)             # every decode step
    for layer in range(L): out = backend.decode(cache, plan, layer=layer, q=q, k=k, v=v)  # -> [B, Hq, Dv]
    cache.commit(plan)

``plan()`` builds everything a step needs that is shared by all layers (lengths, block tables, split
plans) and may allocate; ``decode()`` and ``append()`` do no host-side planning, so on CUDA a decode
step (all layers) can be captured in a graph once its plan exists. Tensor conventions (``B`` batch, ``T`` new tokens, ``S`` cached tokens):

- ``q``: ``[B, Hq, Dk]`` in decode, ``[B, T, Hq, Dk]`` in prefill (right-padded to ``max(num_new)``)
- ``k``: ``[B, Hkv, Dk]`` / ``[B, T, Hkv, Dk]``; ``v``: ``[B, Hkv, Dv]`` / ``[B, T, Hkv, Dv]``
- for the MLA latent form (``kv_form = "latent"``) ``Hkv = 1``, ``k`` is ``[latent | rope]`` and ``v``
  is the latent, i.e. ``v == k[..., :Dv]``; a latent cache stores ``k`` once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch

from attnbench.core.prefill import PREFILL_BUDGET_BYTES, prefill_attention
from attnbench.core.resolution import Resolution, Tunable
from attnbench.core.shapes import AttentionGeometry, KVForm
from attnbench.core.workload import Workload

__all__ = [
    "DEFAULT_ERROR_MULTIPLE",
    "PLUGIN_API_VERSION",
    "Backend",
    "ConfigError",
    "KVCache",
    "Resolution",
    "StepPlan",
    "Tolerance",
    "Tunable",
    "causal_attention",
]

#: Version of the backend/plugin contract. Bumped on incompatible changes to this module.
PLUGIN_API_VERSION = 1


class ConfigError(ValueError):
    """A backend config names an unknown tunable or a value outside its choices."""


@dataclass(frozen=True)
class Tolerance:
    """Largest error a backend declares against the float64 reference."""

    max_abs: float
    rel_l2: float
    min_cosine: float


#: The correctness gate's default error multiple (see :meth:`Backend.error_multiple`).
DEFAULT_ERROR_MULTIPLE = 2.0

#: Default tolerances by compute dtype (random N(0, 1) inputs). ``max_abs`` covers one output rounding
#: at |out| ≈ 3-4, which prefill rows attending to one or two tokens reach (bf16 ulp there is 1/64,
#: fp16's 1/512, plus the rounding of the probabilities); ``rel_l2`` and ``cosine`` are the sharp tests.
DEFAULT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(max_abs=2e-5, rel_l2=1e-5, min_cosine=0.999_999),
    torch.float16: Tolerance(max_abs=5e-3, rel_l2=3e-3, min_cosine=0.999_9),
    torch.bfloat16: Tolerance(max_abs=4e-2, rel_l2=2e-2, min_cosine=0.999),
}


_Plan = TypeVar("_Plan", bound="StepPlan")


@dataclass
class StepPlan:
    """Per-step metadata shared by every layer. Backends subclass it (a typed dataclass each) for theirs.

    ``positions[i]`` is where sequence ``i``'s new tokens start; ``seq_lens_after[i]`` its length
    once the step is committed (host copies, for host work). ``device_lens`` and ``device_positions``
    are the cache's own buffers (:attr:`KVCache.device_lens`), filled in place by every plan, so a
    CUDA graph captured with one step's plan reads the next step's lengths. Tensor fields whose
    ``metadata`` has ``scratch=True`` are workspace (kept storage, undefined contents).
    """

    num_new: tuple[int, ...]
    positions: tuple[int, ...]
    seq_lens_after: tuple[int, ...]
    device_lens: torch.Tensor  # [B] int32, == seq_lens_after, on the cache's device
    device_positions: torch.Tensor  # [B] int64, == positions, on the cache's device

    @property
    def max_new(self) -> int:
        return max(self.num_new)

    def extend(self, cls: type[_Plan], **extra: Any) -> _Plan:
        """This plan as a ``cls`` (a subclass that adds fields): every field copied, ``extra`` set."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(self)}, **extra)


class KVCache:
    """Base of every cache: knows its geometry, lengths and config; subclasses own the buffers."""

    def __init__(
        self,
        *,
        workload: Workload,
        geometry: AttentionGeometry,
        config: Mapping[str, Any],
        num_layers: int,
        max_seq_len: int,
    ) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers = {num_layers} must be > 0")
        self.workload = workload
        self.geometry = geometry
        self.config = dict(config)
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.batch = workload.batch
        self.dtype = workload.dtype
        self.device = torch.device(workload.device)
        self.seq_lens: tuple[int, ...] = (0,) * workload.batch
        # the plan's length buffers, allocated once and filled in place by every plan (base_plan)
        self.device_lens = torch.zeros(workload.batch, dtype=torch.int32, device=self.device)
        self.device_positions = torch.zeros(workload.batch, dtype=torch.int64, device=self.device)
        #: this cache's decode path replays as a CUDA graph across steps (set by the backend that
        #: gives it plan buffers and a grid fixed per context bucket; see ``Backend.capturable``)
        self.capturable = False

    def commit(self, plan: StepPlan) -> None:
        """Make the tokens written under ``plan`` part of every sequence (after the last layer)."""
        self.seq_lens = plan.seq_lens_after

    def reset(self) -> None:
        self.seq_lens = (0,) * self.batch

    def write(self, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k [B, T, Hkv, Dk]``, ``v [B, T, Hkv, Dv]`` at ``plan.positions`` (a layout implements it)."""
        raise NotImplementedError(
            f"{type(self).__qualname__} has no write(): give the cache one or override the backend's append()"
        )

    def read(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` cached tokens of sequence ``seq`` in ``layer``, as values in the cache's
        compute dtype: ``k [length, Hkv, Dk]``, ``v [length, Hkv, Dv]`` (dequantised for a lossy cache).

        What a prompt appended to a non-empty cache attends to (:meth:`Backend.prefill`). Host work;
        may allocate. A layout implements it.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__} has no read(): a prompt cannot be appended to a non-empty cache "
            "(give the cache a read(), or start every prompt on an empty cache)"
        )

    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies over all layers of this cache (including any scales)."""
        g = self.geometry
        per_layer = g.num_kv_heads * (g.qk_head_dim + g.v_head_dim) * self.dtype.itemsize
        return per_layer * self.num_layers

    def nbytes(self) -> int:
        """Bytes of device memory the cache holds (0 if unknown)."""
        return 0


#: The plugin contract's four hooks, which the default :meth:`Backend.resolve` combines.
_HOOKS = ("supports", "implementation", "interpreted", "tunables_for")


class Backend(ABC):
    """An attention backend. Subclass it, declare the class attributes, implement the methods.

    Class attributes:
        name: registry name (lowercase, ``[a-z0-9_]``).
        description: one line for ``attnbench backends``.
        tunables: the search space, as data; ``default_config()`` takes each default.
        kv_form: ``"expanded"`` (per-head K/V) or ``"latent"`` (MLA absorbed, one shared KV head).
        plugin_api: the ``PLUGIN_API_VERSION`` the backend was written for.
        lossy: empty for an exact cache; else what is lost, e.g. ``"fp8 e4m3 K/V"``. A lossy backend
            competes only when the user allows it (``--allow-lossy``, ``select(allow_lossy=True)``),
            and everything that reports it says so.
        capturable: a decode step replays as a CUDA graph across steps (see the attribute).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    tunables: ClassVar[tuple[Tunable, ...]] = ()
    kv_form: ClassVar[KVForm] = "expanded"
    plugin_api: ClassVar[int] = PLUGIN_API_VERSION
    lossy: ClassVar[str] = ""
    #: tunables that change how fast the backend runs and never a bit of what it computes (a prefetch
    #: distance): ``tune`` gates one config per combination of the others and reuses that verdict for
    #: the rest, each still timed and its timed step checked (a test must show the outputs equal)
    result_neutral: ClassVar[tuple[str, ...]] = ()
    #: tunables a cache's layout and contents never depend on (how the kernel walks it: KV splits, a
    #: prefetch distance): ``tune`` fills one cache per combination of the others and times a config
    #: that differs only in these on it, rewound to its fill and handed the config by
    #: :meth:`reconfigure_cache`. Declaring them promises that the cache's state is its ``seq_lens``
    #: and what was written at each position (writing a position again overwrites it)
    cache_neutral: ClassVar[tuple[str, ...]] = ()
    #: True when a whole decode step (``decode()`` of every layer, after ``plan()``) can be captured
    #: as a CUDA graph once and replayed for later steps of the same batch and context bucket: the
    #: plan lives in buffers the cache owns and no host integer that changes per step is baked in
    capturable: ClassVar[bool] = False
    #: files besides the class's module whose contents define what it computes (a compiled kernel's
    #: sources): part of its code hash, so a tuned row and a gate verdict go stale when they change
    code_files: ClassVar[tuple[str, ...]] = ()
    #: what one attention call of the default :meth:`prefill` may allocate (a chunk's mask or scores);
    #: not a ClassVar: the conformance check (attnbench.testing) sets it on one backend object
    prefill_budget_bytes: int = PREFILL_BUDGET_BYTES

    #: set on a class that overrides :meth:`resolve` and none of the four hooks: they read from it
    _answers_in_resolve: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        hooks = [h for h in _HOOKS if h in vars(cls)]
        if "resolve" in vars(cls) and not hooks:
            _hooks_from_resolve(cls)
        elif hooks and cls._answers_in_resolve and "resolve" not in vars(cls):
            raise TypeError(
                f"{cls.__qualname__} overrides {', '.join(hooks)} of a backend that answers in resolve(): "
                "override resolve() instead (the hooks read from it)"
            )

    # -- what it can do --------------------------------------------------------------------------
    def resolve(self, workload: Workload, config: Mapping[str, Any] | None = None) -> Resolution:
        """Everything about running ``workload`` with ``config``, in one object (see :class:`Resolution`).

        Callers ask once per (workload, config) and pass the answer on. This default combines the
        four hooks below (:meth:`supports`, :meth:`implementation`, :meth:`interpreted`,
        :meth:`tunables_for`) and :meth:`kv_bytes_per_token`, so a plugin may implement just those. A
        backend that works its answers out in one pass overrides this instead, building the answer
        with :meth:`resolution`; the four hooks then read from it, so they can never disagree with it.
        A bad config raises :class:`ConfigError`.
        """
        cfg = self.resolve_config(config)  # a bad config raises before any hook runs
        reasons = tuple(self.supports(workload))
        if reasons:  # a refused workload's other hooks are not asked
            return self.resolution(workload, cfg, reasons=reasons, implementation="")
        return self.resolution(
            workload,
            cfg,
            implementation=self.implementation(workload),
            interpreted=bool(self.interpreted(workload)),
            tunables=self.tunables_for(workload),
        )

    def resolution(
        self,
        workload: Workload,
        config: Mapping[str, Any] | None,
        *,
        reasons: Sequence[str] = (),
        implementation: str,
        interpreted: bool = False,
        tunables: Sequence[Tunable] = (),
    ) -> Resolution:
        """A :class:`Resolution` for an overridden :meth:`resolve`: fills in the name, the config, KV
        bytes and lossiness; a refused one gets no tunables and says why."""
        cfg = self.resolve_config(config)
        return Resolution(
            backend=self.name,
            workload=workload,
            config=cfg,
            reasons=tuple(reasons),
            implementation=_unavailable(reasons) if reasons else implementation,
            interpreted=interpreted and not reasons,
            tunables=() if reasons else tuple(tunables),
            kv_bytes_per_token=self.kv_bytes_per_token(workload, config=cfg),
            lossy=self.lossy,
            kv_form=self.kv_form,
        )

    def kv_bytes_per_token(self, workload: Workload, *, config: Mapping[str, Any]) -> int:
        """Bytes one token takes in this backend's cache over all the shape's layers (no allocation).

        Default: the shape's K/V count in the workload dtype and this backend's form. A cache that
        stores more (scales, padding, another dtype) overrides this; it must equal what
        ``create_cache(...).bytes_per_token()`` reports for the shape's layer count.
        """
        shape = workload.shape
        form = self.kv_form if shape.is_mla else "expanded"
        return shape.kv_bytes_per_token(workload.dtype, form)

    def supports(self, workload: Workload) -> list[str]:
        """Reasons this backend cannot run ``workload``; an empty list means it can."""
        return []

    def implementation(self, workload: Workload) -> str:
        """The implementation that would actually run (e.g. ``"torch.sdpa[flash]"``)."""
        return type(self).__qualname__

    def interpreted(self, workload: Workload) -> bool:
        """True when the kernels would run in an interpreter: checked for correctness, never timed."""
        return False

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """How many times the calibration reference's error the correctness gate accepts, per metric.

        The calibration reference rounds as carefully as ``dtype`` allows (scores, softmax and P·V in
        float32, one rounding of the output). The default, 2, lets no 1 % error through at any context;
        a backend that rounds more (scores or P in the cache dtype) may declare more, with the reason
        in its docstring.
        """
        return DEFAULT_ERROR_MULTIPLE

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        """A fixed error bound against float64 for compute dtype ``dtype``.

        The decode gate bounds exact backends by calibration instead (``error_multiple``); this fixed
        bound applies where nothing calibrates it — prefill rows in the conformance suite, logits in
        real-model checks — and, for a lossy cache, is its declared bound against exact attention.
        """
        return DEFAULT_TOLERANCES[dtype]

    def reference_kv(self, k: torch.Tensor, v: torch.Tensor, *, config: Mapping[str, Any]) -> tuple | None:
        """K/V as this backend stores them (e.g. quantised then dequantised), or ``None`` if exact.

        When not ``None`` the gate also compares against a reference built from these, with a bound
        calibrated on the same stored K/V (and :meth:`tolerance` against exact attention).
        """
        return None

    def stored_tolerance(self, dtype: torch.dtype) -> Tolerance:
        return DEFAULT_TOLERANCES[dtype]

    def tunables_for(self, workload: Workload) -> tuple[Tunable, ...]:
        """The tunables that matter for ``workload`` (default: all); the tuner searches only these."""
        return self.tunables

    def canonical_config(self, workload: Workload, config: Mapping[str, Any]) -> dict[str, Any]:
        """The config of :meth:`tunables_for`'s space that runs ``workload`` as ``config`` does, where a
        value there means another one (default: ``config`` itself, its defaults filled in)."""
        return self.resolve_config(config)

    # -- configs ---------------------------------------------------------------------------------
    @classmethod
    def default_config(cls) -> dict[str, Any]:
        return {t.name: t.default for t in cls.tunables}

    @classmethod
    def resolve_config(cls, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Fill defaults and validate; an error names the tunable, the value and the choices."""
        resolved = cls.default_config()
        by_name = {t.name: t for t in cls.tunables}
        for key, value in (config or {}).items():
            if key not in by_name:
                accepted = ", ".join(by_name) or "none"
                raise ConfigError(f"backend {cls.name!r} has no tunable {key!r}; tunables: {accepted}")
            if value not in by_name[key].choices:
                raise ConfigError(
                    f"backend {cls.name!r}: {key} = {value!r} not in {tuple(by_name[key].choices)}"
                )
            resolved[key] = value
        return resolved

    # -- the cache and the step ------------------------------------------------------------------
    @abstractmethod
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> KVCache:
        """Allocate an empty cache for ``workload.batch`` sequences of up to ``max_seq_len`` tokens."""

    def cache_fields(
        self, workload: Workload, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> dict[str, Any]:
        """The arguments every :class:`KVCache` takes: ``workload`` (in this backend's KV form), ``config``
        and the sizes ``create_cache`` was given; a cache class adds its own."""
        g = workload.geometry(self.kv_form)
        return dict(
            workload=workload, geometry=g, config=config, num_layers=num_layers, max_seq_len=max_seq_len
        )

    def reconfigure_cache(self, cache: KVCache, config: Mapping[str, Any]) -> None:
        """Make ``cache``, made for a config that differs from ``config`` only in :attr:`cache_neutral`
        tunables, run ``config`` (a backend that declares ``cache_neutral`` implements it)."""
        raise NotImplementedError(
            f"backend {self.name!r} declares cache_neutral {self.cache_neutral} but no reconfigure_cache()"
        )

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> StepPlan:
        """Build the step's shared metadata (host work, once per step). Override to add fields.

        A capturable backend (``capturable = True``) writes its plan into buffers its cache allocated
        once and allocates nothing on the device here; the base plan fills the cache's length buffers.
        """
        return base_plan(cache, num_new)

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new K/V of ``layer`` (``[B, T, Hkv, D]``, right-padded) at ``plan.positions``.

        Default: the cache's own :meth:`KVCache.write`; override when the backend stores K/V otherwise.
        """
        cache.write(plan, layer=layer, k=k, v=v)

    @abstractmethod
    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Append one token per sequence to ``layer`` and attend: ``q [B, Hq, Dk]`` → ``[B, Hq, Dv]``.

        Capturable: no host-side planning, no host-device sync.
        """

    def prefill(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write a prompt into the cache and return causal attention over it (and any cached prefix).

        ``q [B, T, Hq, Dk]`` → ``[B, T, Hq, Dv]``; rows past ``plan.num_new[i]`` are zero. Sequence
        ``i``'s new tokens start at ``plan.positions[i]``: a non-empty cache (the second turn of a
        chat) is read back through :meth:`KVCache.read` and the prompt attends to it and to itself.
        The default runs :func:`attnbench.core.prefill.prefill_attention` — torch SDPA's fused kernel, ragged
        prompts without padding, chunked past a memory budget — then writes the prompt's K/V with
        :meth:`append` (one vectorised write into this backend's layout). A backend with its own
        prefill kernel may override it. Host work; may allocate; not capturable.
        """
        prefix = None
        if any(plan.positions):
            prefix = [cache.read(layer, i, p) if p else None for i, p in enumerate(plan.positions)]
        out = prefill_attention(
            q,
            k,
            v,
            lengths=plan.num_new,
            scale=cache.geometry.scale,
            prefix=prefix,
            budget_bytes=self.prefill_budget_bytes,
        )
        self.append(cache, plan, layer=layer, k=k, v=v)
        return out


def _hooks_from_resolve(cls: type[Backend]) -> None:
    """Make the four hooks of a backend that answers in :meth:`Backend.resolve` read from it."""

    def supports(self: Backend, workload: Workload) -> list[str]:
        return list(self.resolve(workload).reasons)

    def implementation(self: Backend, workload: Workload) -> str:
        return self.resolve(workload).implementation

    def interpreted(self: Backend, workload: Workload) -> bool:
        return self.resolve(workload).interpreted

    def tunables_for(self: Backend, workload: Workload) -> tuple[Tunable, ...]:
        return self.resolve(workload).tunables

    for hook in (supports, implementation, interpreted, tunables_for):
        setattr(cls, hook.__name__, hook)
    cls._answers_in_resolve = True


def _unavailable(reasons: Sequence[str]) -> str:
    return "unavailable: " + "; ".join(reasons)


def base_plan(cache: KVCache, num_new: Sequence[int]) -> StepPlan:
    """The shared part of every plan: lengths checked, and written into the cache's length buffers in
    place (one host-to-device copy each; no device allocation)."""
    num_new = tuple(int(n) for n in num_new)
    if len(num_new) != cache.batch:
        raise ValueError(f"plan: num_new has {len(num_new)} entries; the cache holds {cache.batch} sequences")
    after = tuple(p + n for p, n in zip(cache.seq_lens, num_new, strict=True))
    if max(after) > cache.max_seq_len:
        raise ValueError(
            f"plan: a sequence would reach {max(after)} tokens; cache max_seq_len is {cache.max_seq_len}"
        )
    cache.device_lens.copy_(torch.tensor(after, dtype=torch.int32))
    cache.device_positions.copy_(torch.tensor(cache.seq_lens, dtype=torch.int64))
    return StepPlan(
        num_new=num_new,
        positions=cache.seq_lens,
        seq_lens_after=after,
        device_lens=cache.device_lens,
        device_positions=cache.device_positions,
    )


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], *, scale: float
) -> torch.Tensor:
    """Causal attention of right-padded prompts on an empty cache (:func:`attnbench.core.prefill.prefill_attention`).

    ``q [B, T, Hq, Dk]``, ``k [B, T, Hkv, Dk]``, ``v [B, T, Hkv, Dv]`` → ``[B, T, Hq, Dv]``; rows past
    ``lengths[i]`` are zero. torch SDPA (its flash kernel where the platform has one), GQA without
    repeating K/V, memory O(T · chunk).
    """
    return prefill_attention(q, k, v, lengths=lengths, scale=scale)
