"""Batch plumbing: padded TensorDicts <-> packed (padding-free) tensors <-> micro-batches.

Convention: a batch is a TensorDict with batch size `[B]` whose *sequence* entries are `[B, L]`
(or `[B, L, ...]`) right-padded tensors with an `attention_mask [B, L]` marking real tokens.
Any entry whose second dimension equals `L` is treated as a sequence entry; everything else is
per-sequence data (`[B]` or `[B, ...]`) carried along unchanged.

Non-tensor per-sequence entries: a row value that is a dict (e.g. a VLM's images,
`{"pixel_values": [n_patches, D], "image_grid_thw": [n_images, 3]}`, whose sizes vary per
sequence) becomes a `NonTensorStack` with batch size `[B]`; indexing, splitting, concatenation
and packing keep one item per sequence (packed micro-batches get a plain list, in order).

The trainer packs sequences into one row (`cu_seqlens` marks the boundaries) and splits a batch
into micro-batches under a token budget; `MicroBatchList` keeps the permutation so results can be
put back in the original order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

# --------------------------------------------------------------------------- padding


def _as_1d_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def stack_non_tensor(values: Sequence[Any]) -> NonTensorStack:
    """One non-tensor item per sequence, as a TensorDict entry of batch size [len(values)]."""
    return NonTensorStack.from_list(list(values))


def is_non_tensor_key(data: TensorDict, key: str) -> bool:
    return not isinstance(data.get(key), torch.Tensor)


def non_tensor_list(data: TensorDict, key: str) -> list[Any]:
    """The per-sequence items of a non-tensor entry, as a plain list of length B."""
    return list(data.get(key).tolist())


def pad_sequences_to_tensors(rows: Sequence[dict[str, Any]], pad_value: float = 0.0) -> TensorDict:
    """Stack per-sample dicts of variable-length sequences into a right-padded TensorDict.

    Each row maps keys to 1-D sequences of equal length (or `[n, ...]` tensors), or to scalars
    (per-sequence values). Adds `attention_mask` when absent.
    """
    if len(rows) == 0:
        return TensorDict({}, batch_size=[0])
    keys = list(rows[0].keys())
    for i, r in enumerate(rows):
        if list(r.keys()) != keys:
            raise ValueError(f"row {i} has keys {sorted(r)}, expected {sorted(keys)}")
    non_tensor = [k for k in keys if isinstance(rows[0][k], dict)]
    seq_keys = [k for k in keys if k not in non_tensor and _as_1d_tensor(rows[0][k]).ndim >= 1]
    lengths = []
    for i, r in enumerate(rows):
        lens = {k: len(_as_1d_tensor(r[k])) for k in seq_keys}
        if len(set(lens.values())) > 1:
            raise ValueError(f"row {i}: sequence fields have different lengths {lens}")
        lengths.append(next(iter(lens.values()), 0))
    max_len = max(lengths, default=0)
    out = {}
    for k in keys:
        if k in non_tensor:
            out[k] = stack_non_tensor([r[k] for r in rows])
            continue
        vals = [_as_1d_tensor(r[k]) for r in rows]
        if k not in seq_keys:
            out[k] = torch.stack(vals)
            continue
        padded = vals[0].new_full((len(rows), max_len, *vals[0].shape[1:]), pad_value)
        for i, v in enumerate(vals):
            padded[i, : len(v)] = v
        out[k] = padded
    if "attention_mask" not in out:
        lens_t = torch.tensor(lengths)
        out["attention_mask"] = (torch.arange(max_len)[None, :] < lens_t[:, None]).to(torch.bool)
    return TensorDict(out, batch_size=[len(rows)])


def seq_len_of(data: TensorDict) -> int:
    return data["attention_mask"].shape[1]


def is_sequence_key(data: TensorDict, key: str) -> bool:
    v = data[key]
    return isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == seq_len_of(data)


def concat_padded_tensors(tds: Sequence[TensorDict], pad_value: float = 0.0) -> TensorDict:
    """Concatenate padded batches along B, right-padding every sequence entry to the longest L."""
    tds = [td for td in tds if td is not None and td.batch_size[0] > 0]
    if not tds:
        return TensorDict({}, batch_size=[0])
    max_len = max(seq_len_of(td) for td in tds)
    keys = list(tds[0].keys())
    for i, td in enumerate(tds):
        if set(td.keys()) != set(keys):
            raise ValueError(f"batch {i} has keys {sorted(td.keys())}, expected {sorted(keys)}")
    out = {}
    for k in keys:
        if is_non_tensor_key(tds[0], k):
            out[k] = stack_non_tensor([x for td in tds for x in non_tensor_list(td, k)])
            continue
        parts = []
        for td in tds:
            v = td[k]
            if is_sequence_key(td, k) and v.shape[1] < max_len:
                fill = 0 if k == "attention_mask" else pad_value
                pad = v.new_full((v.shape[0], max_len - v.shape[1], *v.shape[2:]), fill)
                v = torch.cat([v, pad], dim=1)
            parts.append(v)
        out[k] = torch.cat(parts, dim=0)
    return TensorDict(out, batch_size=[sum(td.batch_size[0] for td in tds)])


# --------------------------------------------------------------------------- packing


def lengths_of(data: TensorDict) -> torch.Tensor:
    """Real (unpadded) length of each sequence. Right padding is assumed."""
    return data["attention_mask"].sum(dim=1).to(torch.int64)


def cu_seqlens_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def pack_tensor_dict(data: TensorDict) -> dict[str, Any]:
    """Padding-free form: each sequence entry becomes `[T, ...]` (T = total real tokens);
    adds `cu_seqlens [B+1]` (int32), `max_seqlen` and `seq_keys` (names of the packed entries).
    Per-sequence entries are kept as is."""
    lengths = lengths_of(data)
    mask = data["attention_mask"].bool()
    packed: dict[str, Any] = {}
    seq_keys = []
    for k in data.keys():
        if k == "attention_mask":
            continue
        if is_sequence_key(data, k):
            packed[k] = data[k][mask]
            seq_keys.append(k)
        elif is_non_tensor_key(data, k):
            packed[k] = non_tensor_list(data, k)
        else:
            packed[k] = data[k]
    packed["seq_keys"] = tuple(seq_keys)
    packed["cu_seqlens"] = cu_seqlens_of(lengths)
    packed["max_seqlen"] = int(lengths.max()) if len(lengths) else 0
    return packed


def unpack_sequence(x: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed `[T, ...]` tensor back into per-sequence tensors."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return list(torch.split(x, lens, dim=0))


def pad_packed(
    x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int | None = None, pad_value: float = 0.0
) -> torch.Tensor:
    """Inverse of packing one entry: `[T, ...]` -> right-padded `[B, L, ...]`."""
    seqs = unpack_sequence(x, cu_seqlens)
    L = max_len if max_len is not None else max((len(s) for s in seqs), default=0)
    out = x.new_full((len(seqs), L, *x.shape[1:]), pad_value)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def unpack_tensor_dict(packed: dict[str, Any], max_len: int | None = None) -> TensorDict:
    """Inverse of `pack_tensor_dict` (sequence entries are those listed in `seq_keys`)."""
    cu = packed["cu_seqlens"]
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    L = max_len if max_len is not None else (int(lens.max()) if len(lens) else 0)
    out = {}
    for k, v in packed.items():
        if k in ("cu_seqlens", "max_seqlen", "seq_keys"):
            continue
        if k in packed["seq_keys"]:
            out[k] = pad_packed(v, cu, L)
        else:
            out[k] = stack_non_tensor(v) if isinstance(v, list) else v
    out["attention_mask"] = torch.arange(L)[None, :] < lens[:, None]
    return TensorDict(out, batch_size=[len(lens)])


# --------------------------------------------------------------------------- splitting


def split_padded_tensor_dict(data: TensorDict, n: int) -> list[TensorDict]:
    """Split along B into `n` contiguous, near-equal parts (e.g. PPO minibatches)."""
    B = data.batch_size[0]
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    sizes = [B // n + (1 if i < B % n else 0) for i in range(n)]
    parts, start = [], 0
    for s in sizes:
        parts.append(data[start : start + s])
        start += s
    return parts


def allocate_balanced_mbs(
    lengths: Sequence[int], max_tokens_per_mb: int | None, min_n_mbs: int = 1
) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `max_tokens_per_mb` tokens with
    balanced totals.

    Longest first, each sequence goes to the lightest micro-batch that still has room (a new one
    when none has); starts from the lower bound on the count, so the result is both within budget
    and close to equal-sized. A sequence longer than the budget gets a micro-batch of its own.
    """
    n = len(lengths)
    if n == 0:
        return []
    total = sum(lengths)
    budget = max_tokens_per_mb if max_tokens_per_mb else max(total, 1)
    k = min(n, max(min_n_mbs, -(-total // budget)))
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, i) for i in range(k)]  # (tokens, bin index)
    for idx in sorted(range(n), key=lambda i: -lengths[i]):
        placed = []
        while heap:
            load, b = heapq.heappop(heap)
            if load + lengths[idx] <= budget or load == 0:
                bins[b].append(idx)
                heapq.heappush(heap, (load + lengths[idx], b))
                break
            placed.append((load, b))
        else:
            bins.append([idx])
            heapq.heappush(heap, (lengths[idx], len(bins) - 1))
        for item in placed:
            heapq.heappush(heap, item)
    return [sorted(b) for b in bins if b]


@dataclass
class MicroBatchList:
    """Micro-batches of one batch and the permutation that restores the original order."""

    mbs: list[TensorDict]
    group_indices: list[list[int]]
    # forward_indices[i] = original index of the i-th sequence in mb order;
    # backward_indices undoes it: results_in_mb_order[backward_indices] -> original order.
    forward_indices: list[int]
    backward_indices: list[int]

    def __len__(self) -> int:
        return len(self.mbs)

    def __iter__(self):
        return iter(self.mbs)


def split_padded_tensor_dict_into_mb_list(
    data: TensorDict, max_tokens_per_mb: int | None = None, n_mbs: int = 1
) -> MicroBatchList:
    """Split a padded batch into token-balanced micro-batches (each trimmed to its own max L)."""
    lengths = lengths_of(data).tolist()
    groups = allocate_balanced_mbs(lengths, max_tokens_per_mb, n_mbs)
    mbs = []
    for g in groups:
        mb = data[torch.tensor(g, dtype=torch.long)]
        mbs.append(trim_padding(mb))
    forward = [i for g in groups for i in g]
    backward = [0] * len(forward)
    for pos, orig in enumerate(forward):
        backward[orig] = pos
    return MicroBatchList(mbs, groups, forward, backward)


def trim_padding(data: TensorDict) -> TensorDict:
    """Drop trailing all-padding columns so a micro-batch is only as long as its longest row."""
    L = seq_len_of(data)
    new_L = int(lengths_of(data).max()) if data.batch_size[0] else 0
    if new_L == L:
        return data
    out = {k: (v[:, :new_L] if is_sequence_key(data, k) else v) for k, v in data.items()}
    return TensorDict(out, batch_size=data.batch_size)


def reorder_list(xs: list, indices: Sequence[int]) -> list:
    return [xs[i] for i in indices]
