"""A workload: a model shape at a batch size and per-sequence context lengths, in a dtype, on a device."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from attnbench.core.shapes import AttentionGeometry, KVForm, ModelShape, dtype_name, load_shape, parse_dtype
from attnbench.core.traffic import kv_bytes_per_step

__all__ = ["Workload", "bucket", "parse_int_list", "parse_tokens"]

_SUFFIX = {"": 1, "k": 1024, "m": 1024 * 1024}
#: Dtypes a decode step computes in (``fp8`` is a KV-cache format, not a compute dtype).
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def parse_tokens(text: str | int, *, field: str = "context") -> int:
    """``"8k"`` → 8192, ``"1m"`` → 1048576, ``"300"`` → 300."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
        if not m:
            raise ValueError(
                f"{field} {text!r} is not a token count; accepted: an integer, optionally with k or m"
            )
        value = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{field} {text!r} must be > 0")
    return value


def parse_int_list(text: str | Sequence[int | str], *, field: str) -> list[int]:
    """``"1,8"`` or ``"1k,8k"`` → ``[1, 8]`` / ``[1024, 8192]``."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return [parse_tokens(item, field=field) for item in items if str(item).strip()]


def bucket(value: int) -> int:
    """The power of two nearest to ``value`` in log space (tuning keys bucket batch and context)."""
    if value <= 0:
        raise ValueError(f"bucket of {value} is undefined; need > 0")
    return 1 << round(math.log2(value))


@dataclass(frozen=True)
class Workload:
    """What one decode step must do: ``batch`` sequences of ``shape``, each with its own context.

    ``context_lens[i]`` is the number of tokens already cached for sequence ``i`` when the step
    starts. ``dtype`` is the compute/KV dtype; backends with a quantised cache (fp8) say so in their
    own config.
    """

    shape: ModelShape
    context_lens: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.context_lens:
            raise ValueError("workload: field 'context_lens' is empty; need one length per sequence")
        lens = self.context_lens
        if set(map(type, lens)) != {int} or min(lens) < 0:  # checked in C; the loop only names the culprit
            for i, n in enumerate(lens):
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"workload: context_lens[{i}] = {n!r} must be an integer ≥ 0")
        dtype = parse_dtype(self.dtype)
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"workload: field 'dtype' = {dtype_name(dtype)!r}: compute dtype must be one of bf16, fp16, fp32 "
                "(an fp8 KV cache is the 'fp8' backend, which computes in one of these)"
            )
        object.__setattr__(self, "dtype", dtype)
        try:
            kind = torch.device(self.device).type
        except RuntimeError as err:
            raise ValueError(f"workload: field 'device' = {self.device!r}: {err}") from None
        if kind == "cuda" and not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(
                f"workload: field 'device' = {self.device!r}: {why} (torch {torch.__version__}); "
                "use --device cpu, or install a CUDA build of torch on a machine with an NVIDIA GPU"
            )

    @classmethod
    def uniform(
        cls,
        model: str | ModelShape,
        *,
        batch: int,
        context: int | str,
        dtype: str | torch.dtype = "bf16",
        device: str = "cpu",
    ) -> Workload:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"workload: field 'batch' = {batch!r} must be an integer > 0")
        ctx = parse_tokens(context)
        return cls(load_shape(model), (ctx,) * batch, parse_dtype(dtype), device)

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    @property
    def context(self) -> int:
        """Longest context in the batch."""
        return max(self.context_lens)

    @property
    def total_tokens(self) -> int:
        return sum(self.context_lens)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def geometry(self, form: KVForm = "expanded") -> AttentionGeometry:
        return self.shape.geometry(form)

    def cpu_reasons(self, kernel: str) -> list[str]:
        """Why a host kernel cannot take this workload (``kernel``: "the cpu_decode kernel runs", the
        subject of "... on the cpu only"): a device other than the cpu, a dtype not fp32, fp16 or bf16."""
        reasons = []
        if torch.device(self.device).type != "cpu":
            reasons.append(f"device {self.device}: {kernel} on the cpu only")
        if self.dtype not in COMPUTE_DTYPES:
            reasons.append(f"dtype {self.dtype_name} not in (fp32, fp16, bf16)")
        return reasons

    def kv_bytes_per_step(
        self, form: KVForm | Literal["auto"] = "auto", *, kv_dtype: torch.dtype | str | None = None
    ) -> int:
        """Bytes of KV cache one decode step reads over all layers (each cached token once)."""

        per_token = self.shape.kv_bytes_per_token(kv_dtype or self.dtype, form)
        return int(kv_bytes_per_step(per_token, tokens=self.total_tokens + self.batch))

    def describe(self) -> str:
        ctx = str(self.context_lens[0]) if len(set(self.context_lens)) == 1 else f"ragged≤{self.context}"
        return f"{self.shape.name} b={self.batch} ctx={ctx} {self.dtype_name} {self.device}"


def workload_to_dict(workload: Workload) -> dict[str, Any]:
    """A workload as JSON-able data (what a child process or a results file receives)."""
    return {
        "shape": workload.shape.fields(),
        "context_lens": list(workload.context_lens),
        "dtype": workload.dtype_name,
        "device": workload.device,
    }


def workload_from_dict(data: dict[str, Any]) -> Workload:
    """The inverse of :func:`workload_to_dict`."""
    fields = dict(data["shape"])
    shape = ModelShape.from_dict(fields, name=fields.pop("name"))
    return Workload(shape, tuple(data["context_lens"]), data["dtype"], data.get("device", "cpu"))
