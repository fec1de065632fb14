"""Exact, memory-lean attention for packed sequences on any device: `sdpa_varlen`.

A packed row holds several sequences that must not attend to each other. On GPU, flash
attention's varlen kernel does this from `cu_seqlens`; sdpa/eager instead need a dense
[T, T] block-diagonal mask, whose cost grows with the square of the whole micro-batch
(T = thousands of tokens) although only each sequence's own square is useful. `sdpa_varlen`
runs causal sdpa once per sequence (split at `cu_seq_lens_q`), so attention costs the sum of
L_i^2 and no mask is built. Registered with transformers' AttentionInterface under this name;
`attn_impl: sdpa_varlen` selects it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface

NAME = "sdpa_varlen"


def sdpa_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    if cu_seq_lens_q is None:
        raise ValueError(f"attn_impl={NAME} needs cu_seq_lens_q (packed inputs)")
    if query.shape[0] != 1:
        raise ValueError(f"attn_impl={NAME} expects one packed row, got batch {query.shape[0]}")
    bounds = cu_seq_lens_q.tolist()
    n_rep = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out[:, :, start:end] = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0
        )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """The kernel masks by construction; never materialise a [T, T] mask."""
    return None


def register() -> None:
    AttentionInterface.register(NAME, sdpa_varlen_attention)
    AttentionMaskInterface.register(NAME, _no_mask)


register()
