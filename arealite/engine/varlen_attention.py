"""Exact, memory-lean attention for packed sequences on any device: `sdpa_varlen`.

A packed row holds several sequences that must not attend to each other. On GPU, flash
attention's varlen kernel does this from `cu_seqlens`; sdpa/eager instead need a dense
[T, T] block-diagonal mask, whose cost grows with the square of the whole micro-batch
(T = thousands of tokens) although only each sequence's own square is useful.

`sdpa_varlen` sorts the sequences by length and runs one causal sdpa call per *group* of
similar lengths, each sequence right-padded to its group's longest. Causal attention over a
right-padded row is exact for the real positions (a real query only sees keys at or before
it, all real), so padding costs compute, never correctness. The grouping minimises a cost
model: per call a fixed overhead, per sequence its padded length and its square (a DP over
the sorted lengths; cached per length profile). 32 GRPO samples of ~25 tokens become one
call instead of 32; lengths spread over 64..512 become a few calls of similar lengths. On
CPU attention runs in fp32 (`hardware.attention_dtype`) with the flash kernel, faster there
than the math kernel at every length measured. Registered with transformers'
AttentionInterface under this name; `attn_impl: sdpa_varlen` selects it. A row holding each shared prompt once
(packing.SharedPrompts) comes with its plan attached to `cu_seq_lens_q` (`_arealite_plan`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, AttentionMaskInterface

from arealite.utils.hardware import attention_dtype, sdpa_without_cudnn

NAME = "sdpa_varlen"

# Cost model of one sdpa call over n sequences padded to M (units: attention pairs).
CALL_OVERHEAD = 128 * 128
PER_TOKEN = 64


def group_cost(n: int, longest: int) -> int:
    return CALL_OVERHEAD + n * (longest * longest + PER_TOKEN * longest)


@functools.lru_cache(maxsize=256)
def plan_groups(lengths: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Sequence indices per sdpa call: a partition of the length-sorted sequences into
    contiguous runs minimising the summed `group_cost` (O(n^2) DP, n = sequences)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    best = [0] + [None] * len(order)  # best[i]: cost of the first i sorted sequences
    cut = [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        for j in range(i):  # last group = order[j:i], its longest is order[j]
            c = best[j] + group_cost(i - j, lengths[order[j]])
            if best[i] is None or c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], len(order)
    while i > 0:
        groups.append(tuple(order[cut[i] : i]))
        i = cut[i]
    return tuple(reversed(groups))


@functools.lru_cache(maxsize=256)
def _gather_plan(lengths: tuple[int, ...], device: torch.device):
    """Per group (token index [n, M] into the packed row, flat index of its real tokens in
    the [n*M] padded layout), and the permutation from group order back to packed order
    (None when groups already come in packed order: one copy less on the hot path)."""
    return _build_plan(lengths, device)


def shared_prompt_gather_plan(lengths: tuple[int, ...], shared, device: torch.device):
    """`_gather_plan` for a row that holds each shared prompt once (packing.SharedPrompts):
    every sequence still attends over its whole length, reading its prompt's keys and values
    through `shared.expand`; a prompt's outputs come from its first sequence only."""
    return _build_plan(lengths, device, shared.expand.cpu(), shared.owned.cpu())


def _build_plan(lengths, device, src=None, owned=None):
    """`src[t]`: where token t of the sequences sits in the computed row (None: at t);
    `owned[t]`: whether token t's output is the one the row keeps (None: all are)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    groups, order = [], []
    for members in plan_groups(lengths):
        longest = max(lengths[i] for i in members)
        pos = torch.arange(longest)
        first = torch.tensor([starts[i] for i in members])[:, None]
        lens = torch.tensor([lengths[i] for i in members])[:, None]
        real = pos[None] < lens
        index = torch.where(real, first + pos[None], first)  # pads re-read a real token
        emit = real if owned is None else real & owned[index]
        if src is not None:
            index = src[index]
        groups.append((index.to(device), emit.flatten().nonzero()[:, 0].to(device), longest))
        order.append(index[emit])
    order = torch.cat(order)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[order] = torch.arange(len(order))
    if torch.equal(inverse, torch.arange(len(order))):
        return groups, None
    return groups, inverse.to(device)


def packed_lengths(cu_seq_lens: torch.Tensor) -> tuple[int, ...]:
    """The packed sequences' lengths, read from the device once per micro-batch: every layer
    receives the same `cu_seq_lens_q` tensor, so the first layer caches them on it (a
    `.tolist()` per layer would synchronise the GPU once per layer)."""
    lengths = getattr(cu_seq_lens, "_arealite_lengths", None)
    if lengths is None:
        lengths = tuple(cu_seq_lens.diff().tolist())
        cu_seq_lens._arealite_lengths = lengths
    return lengths


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
    groups, inverse = getattr(cu_seq_lens_q, "_arealite_plan", None) or _gather_plan(
        packed_lengths(cu_seq_lens_q), query.device
    )
    # [T, H, D] token-major views: a group's rows are one index_select away.
    compute_dtype = attention_dtype(query.dtype, query.device.type)
    q, k, v = (x[0].transpose(0, 1).to(compute_dtype) for x in (query, key, value))
    dropout_p = dropout if module.training else 0.0
    outs = []
    for index, emit, _longest in groups:
        qg, kg, vg = (_rows(x, index).transpose(1, 2) for x in (q, k, v))  # [n, H, M, D]
        with _kernel_for(query.device):
            og = F.scaled_dot_product_attention(
                qg, kg, vg, is_causal=True, scale=scaling, dropout_p=dropout_p, enable_gqa=True
            )
        outs.append(_rows(og.transpose(1, 2).flatten(0, 1), emit))  # kept tokens, [sum L, H, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    out = out if inverse is None else _rows(out, inverse)
    return out.to(query.dtype)[None], None


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[index]` for a LongTensor `index` of any shape, via index_select: its backward
    (index_add) is several times faster on CPU than advanced indexing's (index_put with
    accumulate) and the result is the same."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _kernel_for(device: torch.device):
    if device.type == "cpu":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return sdpa_without_cudnn()


def _no_mask(*args, **kwargs) -> None:
    """The kernel masks by construction; never materialise a [T, T] mask."""
    return None


def register() -> None:
    AttentionInterface.register(NAME, sdpa_varlen_attention)
    AttentionMaskInterface.register(NAME, _no_mask)


register()
