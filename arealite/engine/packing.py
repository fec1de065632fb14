"""Packed micro-batches: several sequences in one row of T real tokens, no padding.

Alignment. Every per-token result is aligned with `input_ids`: `logprobs[i]` is
log p(input_ids[i] | input_ids[:i]), i.e. computed from the logits at position i-1, and is 0
at each sequence's first token. This is what an inference server reports for generated
tokens, and `loss_mask[i] = 1` means "token i is a target". Values (critic) and entropies use
the same shift.

Masks. Packed sequences must never attend to each other: sdpa_varlen / flash_attention_2 take
`cu_seqlens`; sdpa / eager need `block_causal_mask` (position_ids alone are NOT enough with
sdpa/eager: checked on transformers 5.23, logits then differ by O(1)).
"""

from __future__ import annotations

from typing import Any

import torch

from arealite.utils.logprobs import gather_logprobs, gather_logprobs_entropy


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """0, 1, ... restarting at every sequence start, [T]."""
    lens = cu_seqlens.diff().long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lens)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[1, 1, T, T] mask letting token q see token k iff same sequence and k <= q.

    dtype=None gives a bool mask (True = attend; sdpa); a float dtype gives the additive form
    (0 / dtype min) that eager attention adds to its scores."""
    lens = cu_seqlens.diff().long()
    T = int(cu_seqlens[-1])
    seg = torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens.device), lens)
    idx = torch.arange(T, device=cu_seqlens.device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    if dtype is None:
        return allowed[None, None]
    mask = torch.zeros(T, T, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def shift_right_packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """out[i] = x[i-1] within each packed sequence, 0 at each sequence's first token: turns
    "computed at position i-1 about token i" into "aligned with token i"."""
    out = torch.roll(x, 1, dims=0)
    starts = cu_seqlens[:-1].long()
    first = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    first[starts[starts < x.shape[0]]] = True
    return torch.where(first.view(-1, *([1] * (x.ndim - 1))), torch.zeros_like(out), out)


def packed_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs [T] (and entropies) of packed `input_ids` under `logits` [T, V] at
    `temperature`, aligned with input_ids (see module docstring); differentiable."""
    labels = torch.roll(input_ids, -1)  # label of position j is token j+1
    if with_entropy:
        logp, ent = gather_logprobs_entropy(logits, labels, temperature)
        return shift_right_packed(logp, cu_seqlens), shift_right_packed(ent, cu_seqlens)
    return shift_right_packed(gather_logprobs(logits, labels, temperature), cu_seqlens)


def target_mask(mb: dict[str, Any]) -> torch.Tensor:
    """A packed micro-batch's `loss_mask` as bool, minus sequence starts: nothing predicts a
    sequence's first token, so it can never be a target."""
    mask = mb["loss_mask"].bool().clone()
    starts = mb["cu_seqlens"][:-1].long()
    mask[starts[starts < mask.numel()]] = False
    return mask
