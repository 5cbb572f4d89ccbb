"""transformers' left-padded batches ↔ the right-padded, ragged batches attnbench backends take.

transformers pads batched prompts on the left (``padding_side="left"``) and marks the pads in the
attention mask; a backend's ``prefill`` takes prompts right-padded to ``max(num_new)`` with each
sequence's own length. At prefill the pads are stripped (``left_to_right``) and the output is put
back in transformers' layout (``right_to_left``); decode steps need neither (one token each).
"""

from __future__ import annotations

import torch

__all__ = ["left_to_right", "prompt_lengths", "right_to_left"]


def prompt_lengths(mask: torch.Tensor | None, *, batch: int, t: int, model: str) -> list[int]:
    """Each prompt's length from the 4D mask of the prefill (``None``: nothing padded); left padding only."""
    if mask is None:
        return [t] * batch
    if mask.dim() != 4 or mask.shape[0] != batch:
        raise ValueError(f"{model}: unexpected attention mask of shape {tuple(mask.shape)} at prefill")
    last = mask[:, 0, -1, -t:]  # [B, T]: the keys the last prompt token sees
    valid = last if last.dtype == torch.bool else last == 0
    lengths = [int(n) for n in valid.sum(-1)]
    want = (
        torch.arange(t, device=mask.device)[None, :]
        >= torch.tensor([t - n for n in lengths], device=mask.device)[:, None]
    )
    if not torch.equal(valid, want) or min(lengths) < 1:
        raise ValueError(
            f"{model}: the attention mask is not left-padded (each row: padding, then the prompt); "
            "set tokenizer.padding_side = 'left' for batched generation"
        )
    return lengths


def left_to_right(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``x [B, T, H, D]`` with ``shift[i]`` leading pad positions → right-padded, pad rows zero."""
    if not bool(shift.any()):
        return x.contiguous()
    t = x.shape[1]
    pos = torch.arange(t, device=x.device)[None, :] + shift[:, None]  # [B, T]
    keep = pos < t
    idx = pos.clamp_max(t - 1)[:, :, None, None].expand_as(x)
    return (x.gather(1, idx) * keep[:, :, None, None].to(x.dtype)).contiguous()


def right_to_left(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`left_to_right` for the output ``[B, T, H, Dv]`` (pad rows zero)."""
    if not bool(shift.any()):
        return x
    t = x.shape[1]
    pos = torch.arange(t, device=x.device)[None, :] - shift[:, None]
    keep = pos >= 0
    idx = pos.clamp_min(0)[:, :, None, None].expand_as(x)
    return x.gather(1, idx) * keep[:, :, None, None].to(x.dtype)
