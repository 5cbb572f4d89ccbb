"""What a backend would do with one workload: the :class:`Resolution`, and the :class:`Tunable` it lists.

Both are re-exported by :mod:`attnbench.core.backend`, where the protocol that produces them lives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnbench.core.workload import Workload

__all__ = ["Resolution", "Tunable"]


@dataclass(frozen=True)
class Tunable:
    """One tunable parameter of a backend, declared as data (like a ``triton.Config`` list)."""

    name: str
    choices: tuple[Any, ...]
    default: Any
    doc: str = ""

    def __post_init__(self) -> None:
        if self.default not in self.choices:
            raise ValueError(f"tunable {self.name!r}: default {self.default!r} not in choices {self.choices}")

    def narrowed(self, choices: Iterable[Any]) -> Tunable:
        """This tunable with only ``choices`` (a subset of its own, in the order given), the default
        kept: what ``tunables_for`` offers a workload where some choices cannot run or do not matter."""
        kept = tuple(choices)
        extra = [c for c in kept if c not in self.choices]
        if extra or self.default not in kept:
            raise ValueError(
                f"tunable {self.name!r}: narrowed choices {kept} must be among {self.choices} and keep the "
                f"default {self.default!r}"
            )
        return Tunable(self.name, kept, self.default, self.doc)


@dataclass(frozen=True)
class Resolution:
    """What a backend would do with one workload and config — asked once, then passed around.

    ``backend.resolve(workload, config)`` builds it; the gate, the tuner, ``select()``, ``bench`` and
    ``attnbench backends`` read it instead of asking the backend again.

    Fields:
        backend: the backend's registry name.
        workload: the workload it was resolved for.
        config: the full config (defaults filled in, validated); read-only.
        reasons: why it cannot run ``workload``; empty means it can (see :attr:`runnable`).
        implementation: what would actually run (e.g. ``"torch.sdpa[flash]"``, ``"triton[native]"``;
            ``"unavailable: <reasons>"`` when it cannot run).
        interpreted: its kernels would run in an interpreter: checked for correctness, never timed.
        tunables: the tunables that matter for ``workload`` (the tuner searches only these).
        kv_bytes_per_token: bytes one cached token takes over all of the shape's layers, as this
            backend's cache stores it (fp8 scales included), computed without allocating a cache.
        lossy: empty for an exact cache; else what is lost (``Backend.lossy``, e.g. ``"fp8 e4m3 K/V"``).
        kv_form: ``"expanded"`` or ``"latent"`` (``Backend.kv_form``).
    """

    backend: str
    workload: Workload
    config: Mapping[str, Any]
    reasons: tuple[str, ...] = ()
    implementation: str = ""
    interpreted: bool = False
    tunables: tuple[Tunable, ...] = ()
    kv_bytes_per_token: int = 0
    lossy: str = ""
    kv_form: str = "expanded"

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "reasons", tuple(self.reasons))
        object.__setattr__(self, "tunables", tuple(self.tunables))

    @property
    def runnable(self) -> bool:
        return not self.reasons

    def require(self) -> Resolution:
        """``self`` if runnable; else ``ValueError`` naming the backend, the workload and every reason."""
        if self.reasons:
            raise ValueError(
                f"backend {self.backend!r} cannot run {self.workload.describe()}: {'; '.join(self.reasons)}"
            )
        return self

    def matches(self, workload: Workload, config: Mapping[str, Any] | None = None) -> bool:
        """True when this answers ``workload`` (and ``config``, if given, once defaults are filled)."""
        return self.workload == workload and (config is None or dict(config).items() <= self.config.items())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``workload`` left out; :meth:`from_dict` takes it back as an argument)."""
        return {
            "backend": self.backend,
            "config": dict(self.config),
            "reasons": list(self.reasons),
            "implementation": self.implementation,
            "interpreted": self.interpreted,
            "tunables": [[t.name, list(t.choices), t.default, t.doc] for t in self.tunables],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "lossy": self.lossy,
            "kv_form": self.kv_form,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, workload: Workload) -> Resolution:
        fields = dict(data)
        fields["tunables"] = tuple(Tunable(n, tuple(c), d, doc) for n, c, d, doc in fields["tunables"])
        return cls(workload=workload, **fields)

    def refused(self, *reasons: str, implementation: str = "error") -> Resolution:
        """A copy that cannot run, for the reasons given (a plugin that hung or raised)."""
        return replace(self, reasons=reasons, implementation=implementation, interpreted=False, tunables=())
