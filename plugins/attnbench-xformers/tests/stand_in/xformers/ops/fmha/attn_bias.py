"""Stand-in for ``xformers.ops.fmha.attn_bias`` (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class _SeqLenInfo:
    seqlen_py: list[int]
    padding: int = 0


@dataclass
class BlockDiagonalCausalWithOffsetPaddedKeysMask:
    q_seqinfo: _SeqLenInfo
    k_seqinfo: _SeqLenInfo

    @classmethod
    def from_seqlens(
        cls,
        q_seqlen: Sequence[int],
        kv_padding: int,
        kv_seqlen: Sequence[int],
        causal_diagonal: object = None,
    ) -> BlockDiagonalCausalWithOffsetPaddedKeysMask:
        assert len(q_seqlen) == len(kv_seqlen) and max(kv_seqlen) <= kv_padding, (
            q_seqlen,
            kv_seqlen,
            kv_padding,
        )
        return cls(_SeqLenInfo(list(q_seqlen)), _SeqLenInfo(list(kv_seqlen), kv_padding))

    def to(self, device: object) -> BlockDiagonalCausalWithOffsetPaddedKeysMask:
        return self
