"""The running batch of the embedded server and the cache surgery that keeps it continuous.

Rows are left-padded and share one transformers DynamicCache. Joining and leaving are pure
tensor bookkeeping, kept apart from the model so `ModelRunner` reads as prefill/decode/sample:
a prefilled batch joins by left-padding the shorter cache and concatenating along rows, and
finished rows leave at once, taking with them the columns that no remaining row uses. Rows that
share a prompt are prefilled once and repeated (`unique_prompts`, `repeat_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from arealite.server.sampling import SamplingTensors


@dataclass
class RunningBatch:
    """The rows decoded together: row i of every tensor and of the cache belongs to seqs[i]."""

    seqs: list  # model_runner.Sequence (not imported: model_runner imports this module)
    cache: object  # transformers DynamicCache
    attention_mask: torch.Tensor  # [B, L] long, 0 on left padding
    positions: torch.Tensor  # [B] position id of each row's pending (last sampled) token
    last_tokens: torch.Tensor  # [B]
    sampling: SamplingTensors | None = None


def merge_batches(a: RunningBatch, b: RunningBatch) -> RunningBatch:
    """Concatenate two batches along rows, left-padding the shorter cache with masked zeros."""
    width = max(a.attention_mask.shape[1], b.attention_mask.shape[1])

    def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
        missing = width - t.shape[-dim_from_end]
        if missing == 0:
            return t
        spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
        return F.pad(t, spec)

    for la, lb in zip(a.cache.layers, b.cache.layers):
        la.keys = torch.cat([pad(la.keys, 2), pad(lb.keys, 2)])
        la.values = torch.cat([pad(la.values, 2), pad(lb.values, 2)])
    return RunningBatch(
        seqs=a.seqs + b.seqs,
        cache=a.cache,
        attention_mask=torch.cat([pad(a.attention_mask, 1), pad(b.attention_mask, 1)]),
        positions=torch.cat([a.positions, b.positions]),
        last_tokens=torch.cat([a.last_tokens, b.last_tokens]),
    )


def keep_rows(batch: RunningBatch, keep_list: list[int], trim_padding: bool) -> RunningBatch:
    """The batch with only rows `keep_list` (its cache is narrowed in place). With
    `trim_padding` (plain full-attention caches only), columns that are padding for every
    remaining row are dropped too, so a long finished prompt stops costing attention."""
    keep = torch.tensor(keep_list, device=batch.attention_mask.device)
    mask = batch.attention_mask[keep]
    start = int(mask.any(dim=0).int().argmax()) if trim_padding else 0
    batch.cache.batch_select_indices(keep)
    if start > 0:  # drop columns that are padding for every remaining row
        for layer in batch.cache.layers:
            layer.keys = layer.keys[:, :, start:]
            layer.values = layer.values[:, :, start:]
    return RunningBatch(
        seqs=[batch.seqs[i] for i in keep_list],
        cache=batch.cache,
        attention_mask=mask[:, start:],
        positions=batch.positions[keep],
        last_tokens=batch.last_tokens[keep],
    )


def unique_prompts(seqs: list) -> tuple[list, torch.Tensor | None]:
    """The first row of each distinct prompt and, when some repeat, the index of each row's
    prompt among them (None when all differ)."""
    first: dict[tuple[int, ...], int] = {}
    unique, row_of = [], []
    for s in seqs:
        key = tuple(s.req.input_ids)
        if key not in first:
            first[key] = len(unique)
            unique.append(s)
        row_of.append(first[key])
    if len(unique) == len(seqs):
        return seqs, None
    return unique, torch.tensor(row_of)


def repeat_rows(batch: RunningBatch, seqs: list, row_of: torch.Tensor) -> RunningBatch:
    """A batch prefilled for distinct prompts, its rows (and cache rows) repeated so that row i
    is seqs[i]."""
    batch.cache.batch_select_indices(row_of)
    return RunningBatch(
        seqs=seqs,
        cache=batch.cache,
        attention_mask=batch.attention_mask[row_of],
        positions=batch.positions[row_of],
        last_tokens=batch.last_tokens[row_of],
    )
