"""The tuning key: what one Optuna study (and one row of a results table) is about.

A key is the device fingerprint, the model shape (name plus a hash of its fields), the dtype, and the
batch and context buckets (powers of two, :func:`attnbench.core.workload.bucket`). Every workload that
falls in the same buckets on the same device shares the key, so a tuned row answers for all of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from attnbench.core.workload import Workload, bucket

__all__ = ["TuningKey", "bucket_distance"]


@dataclass(frozen=True)
class TuningKey:
    """Device + shape + dtype + batch bucket + context bucket.

    ``device`` is the id of the full device fingerprint (hardware *and* library versions), so a study
    never mixes measurements taken under two torch versions. ``context_bucket`` buckets the longest
    context in the batch.
    """

    device: str
    model: str
    shape_hash: str
    dtype: str
    batch_bucket: int
    context_bucket: int

    @classmethod
    def for_workload(cls, workload: Workload, *, device: str) -> TuningKey:
        return cls(
            device=device,
            model=workload.shape.name,
            shape_hash=workload.shape.fingerprint(),
            dtype=workload.dtype_name,
            batch_bucket=bucket(workload.batch),
            context_bucket=bucket(workload.context),
        )

    @property
    def row(self) -> str:
        """The key inside one device's results table: ``llama-3.1-8b@3f2a…/bf16/b8/ctx4096``."""
        return f"{self.model}@{self.shape_hash}/{self.dtype}/b{self.batch_bucket}/ctx{self.context_bucket}"

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], *, device: str) -> TuningKey:
        """The key of a table entry from its structured fields (``model``, ``shape_hash``, ``dtype``,
        ``batch_bucket``, ``context_bucket``, as every entry holds them); a missing or mistyped one
        raises ``ValueError`` naming it. The row string (:attr:`row`) is only a name, never parsed."""
        kinds = {"model": str, "shape_hash": str, "dtype": str, "batch_bucket": int, "context_bucket": int}
        for name, kind in kinds.items():
            value = fields.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"tuning key field {name!r} = {value!r}: expected {kind.__name__}")
        return cls(device=device, **{name: fields[name] for name in kinds})

    def study_name(self, space_id: str) -> str:
        """One study per key *and* search space (backends, their tunables and their code)."""
        return f"attnbench/{self.row}@{self.device}/space-{space_id}"

    def representative(self, workload: Workload) -> Workload:
        """The workload the study measures: ``workload``'s shape and dtype at the bucket values."""
        return Workload(
            shape=workload.shape,
            context_lens=(self.context_bucket,) * self.batch_bucket,
            dtype=workload.dtype,
            device=workload.device,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return self.row


def bucket_distance(a: TuningKey, *, batch: int, context: int) -> float:
    """Distance in octaves between a key's buckets and a (batch, context) point (context weighs 1, batch 1)."""
    return abs(math.log2(a.batch_bucket / batch)) + abs(math.log2(a.context_bucket / context))
