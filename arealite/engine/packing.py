"""Packed micro-batches: several sequences in one row of T real tokens, no padding.

Alignment. Every per-token result is aligned with `input_ids`: `logprobs[i]` is
log p(input_ids[i] | input_ids[:i]), i.e. computed from the logits at position i-1, and is 0
at each sequence's first token. This is what an inference server reports for generated
tokens, and `loss_mask[i] = 1` means "token i is a target". Values (critic) and entropies use
the same shift.

Masks. Packed sequences must never attend to each other: sdpa_varlen / flash_attention_2 take
`cu_seqlens`; sdpa / eager need `block_causal_mask` (position_ids alone are NOT enough with
sdpa/eager: checked on transformers 5.23, logits then differ by O(1)).

Shared prompts. A GRPO group packs n samples of one prompt: the prompt's tokens, up to the first
target, are the same in all n and, attention being causal, so are their hidden states and
logits. `SharedPrompts` computes each such prefix once: the model runs on the kept tokens only
(a prompt once per group, every response), sdpa_varlen attends each sequence to its own prompt
through an index, and the logits are expanded back to the packed layout, so everything
downstream (logprobs, losses, values) is unchanged and exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from arealite.engine import tensor_parallel
from arealite.engine.logprobs import gather_logprobs, gather_logprobs_entropy


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
    if tensor_parallel.is_vocab_parallel(logits):  # never gathers the vocabulary
        out = tensor_parallel.vocab_parallel_logprobs(logits, labels, temperature, with_entropy)
        if with_entropy:
            return shift_right_packed(out[0], cu_seqlens), shift_right_packed(out[1], cu_seqlens)
        return shift_right_packed(out, cu_seqlens)
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


@dataclass
class SharedPrompts:
    """Which packed tokens the model computes when sequences share their prompt.

    `kept[c]`: the packed index of computed token c (a shared prompt's tokens are those of its
    first sequence); `expand[t]`: the computed token whose result packed token t takes."""

    kept: torch.Tensor  # [T'] long
    expand: torch.Tensor  # [T] long

    @property
    def owned(self) -> torch.Tensor:
        """[T] bool: packed token t is the one its computed token was taken from."""
        return self.kept[self.expand] == torch.arange(len(self.expand), device=self.kept.device)


def shared_prompt_plan(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor
) -> SharedPrompts | None:
    """The plan for a packed micro-batch, or None when no two sequences share a prompt (the
    tokens before a sequence's first target)."""
    ids, targets, cu = input_ids.tolist(), loss_mask.tolist(), cu_seqlens.tolist()
    first_of: dict[tuple[int, ...], int] = {}  # prompt -> packed start of its first sequence
    kept: list[int] = []
    expand = [0] * len(ids)
    for a, b in zip(cu[:-1], cu[1:]):
        n_prompt = next((j for j in range(a + 1, b) if targets[j]), b) - a
        owner = first_of.setdefault(tuple(ids[a : a + n_prompt]), a)
        own_from = a if owner == a else a + n_prompt
        if owner != a:
            expand[a:own_from] = expand[owner : owner + n_prompt]
        expand[own_from:b] = range(len(kept), len(kept) + b - own_from)
        kept.extend(range(own_from, b))
    if len(kept) == len(ids):
        return None
    device = input_ids.device
    return SharedPrompts(torch.tensor(kept, device=device), torch.tensor(expand, device=device))
