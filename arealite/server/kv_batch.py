"""The running batch of the embedded server and the cache surgery that keeps it continuous.

Rows are left-padded and share one transformers DynamicCache whose full-attention layers keep
spare rows and columns (`SlackLayer`), so a decoding step writes its token in place. Joining and
leaving are pure tensor bookkeeping, kept apart from the model so `ModelRunner` reads as
prefill/decode/sample: a prefilled batch joins by left-padding the shorter cache and stacking
rows (into free rows where it fits), and finished rows leave at once, the batch's last rows
moved into their places, taking with them the columns that no remaining row uses. Row order
is therefore not admission order.
Rows that share a prompt are prefilled once and repeated (`unique_prompts`, `repeat_rows`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from arealite.server.sampling import SamplingTensors


def spare_columns(length: int) -> int:
    """Columns allocated beyond `length`: a quarter more (at least 32), so a row's KV grows by
    a copy every ~length/4 tokens instead of every token."""
    return max(32, length // 4)


def spare_rows(rows: int) -> int:
    """Rows allocated beyond `rows` when a batch outgrows its buffer: a quarter more (at least
    8), so groups joining a running batch are written into free rows, not a copy of every row."""
    return max(8, rows // 4)


class SlackLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are the first `rows` rows and
    `length` columns of buffers with spare rows and columns. A decoding step writes its token in
    place, rows joining are written into free rows, and rows leaving are replaced by rows moved
    from the end (`move_rows`): each costs the rows it touches, where DynamicLayer copies the
    whole cache of every layer (every step, and on every join and leave). Assigning `keys` /
    `values` (transformers' own surgery) adopts the tensor as a buffer without spare room; the
    next update grows it. `kv_dtype`: the dtype the buffers hold (None: the model's), fp32
    where attention computes in fp32 (`server.cpu_attention`)."""

    def __init__(self, kv_dtype: torch.dtype | None = None, **kwargs):
        self._buffers: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._length = {"keys": 0, "values": 0}
        self._rows = {"keys": 0, "values": 0}
        self.kv_dtype = kv_dtype
        super().__init__(**kwargs)

    def _view(self, name: str) -> torch.Tensor | None:
        buf = self._buffers[name]
        if buf is None or buf.dim() < 4:
            return buf
        return buf[: self._rows[name], :, : self._length[name]]

    def _adopt(
        self,
        name: str,
        tensor: torch.Tensor | None,
        length: int | None = None,
        rows: int | None = None,
    ) -> None:
        self._buffers[name] = tensor
        whole = tensor is not None and tensor.dim() == 4
        self._length[name] = (tensor.shape[-2] if whole else 0) if length is None else length
        self._rows[name] = (tensor.shape[0] if whole else 0) if rows is None else rows

    keys = property(lambda self: self._view("keys"), lambda self, t: self._adopt("keys", t))
    values = property(lambda self: self._view("values"), lambda self, t: self._adopt("values", t))

    def _append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        buf, start, rows = self._buffers[name], self._length[name], new.shape[0]
        end = start + new.shape[-2]
        if buf is None or buf.dim() < 4 or end > buf.shape[-2] or rows > buf.shape[0]:
            capacity = rows if buf is None or buf.dim() < 4 else max(rows, buf.shape[0])
            shape = (capacity, new.shape[1], end + spare_columns(end), new.shape[-1])
            grown = new.new_empty(shape, dtype=self.kv_dtype or new.dtype)
            if start:
                grown[:rows, :, :start] = buf[:rows, :, :start]
            buf = grown
        buf[:rows, :, start:end] = new
        self._adopt(name, buf, end, rows)
        return self._view(name)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._append("keys", key_states), self._append("values", value_states)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Rows `indices` (repeats allowed) into a new buffer, spare columns kept."""
        for name in self._buffers:
            if self._length[name]:
                live = self._buffers[name][: self._rows[name]]
                self._adopt(name, live[indices], self._length[name])

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
        """Keep the first `rows` rows after copying rows `src` into rows `dst` (disjoint): how
        leaving rows are replaced by the batch's last ones without copying the others."""
        for name in self._buffers:
            if self._length[name]:
                buf = self._buffers[name]
                if len(src):
                    buf[dst, :, : self._length[name]] = buf[src, :, : self._length[name]]
                self._rows[name] = rows

    def drop_leading_columns(self, count: int) -> None:
        """Forget the first `count` columns (padding of every row), spare columns kept."""
        for name in self._buffers:
            buf = self._buffers[name]
            self._adopt(name, buf[:, :, count:], self._length[name] - count, self._rows[name])

    def stack_rows(self, other: SlackLayer, width: int) -> None:
        """This layer's rows, then `other`'s, each left-padded with zeros to `width` columns:
        in place when the buffer has the free rows and is already `width` wide, else into a
        new buffer with spare rows and columns."""
        for name in self._buffers:
            buf, mine, theirs = self._buffers[name], self._view(name), other._view(name)
            n, k = mine.shape[0], theirs.shape[0]
            if mine.shape[2] != width or n + k > buf.shape[0]:
                rows, cols = n + k + spare_rows(n + k), width + spare_columns(width)
                buf = mine.new_empty((rows, mine.shape[1], cols, mine.shape[3]))
                buf[:n, :, : width - mine.shape[2]] = 0
                buf[:n, :, width - mine.shape[2] : width] = mine
            pad = width - theirs.shape[2]
            buf[n : n + k, :, :pad] = 0  # masked, but must be finite: 0 x NaN is NaN
            buf[n : n + k, :, pad:width] = theirs
            self._adopt(name, buf, width, n + k)


def new_cache(config, kv_dtype: torch.dtype | None = None) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers are SlackLayers holding
    `kv_dtype` (sliding-window and other layer kinds stay transformers' own)."""
    cache = DynamicCache(config=config)
    slack = functools.partial(SlackLayer, kv_dtype=kv_dtype)
    cache.layers = [slack() if type(x) is DynamicLayer else x for x in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # layers made on first use
        cache.layer_class_to_replicate = slack
    return cache


def can_join(cache: DynamicCache) -> bool:
    """Whether rows of caches like this one can be stacked and trimmed (plain full attention:
    every layer a SlackLayer)."""
    return all(isinstance(layer, SlackLayer) for layer in cache.layers)


@dataclass
class RunningBatch:
    """The rows decoded together: row i of every tensor and of the cache belongs to seqs[i]."""

    seqs: list  # model_runner.Sequence (not imported: model_runner imports this module)
    cache: DynamicCache  # from new_cache
    attention_mask: torch.Tensor  # [B, L] long, 0 on left padding
    positions: torch.Tensor  # [B] position id of each row's pending (last sampled) token
    last_tokens: torch.Tensor  # [B]
    sampling: SamplingTensors | None = None


def merge_batches(a: RunningBatch, b: RunningBatch) -> RunningBatch:
    """Stack two batches' rows (caches that `can_join`), left-padding the shorter with masked
    zeros."""
    width = max(a.attention_mask.shape[1], b.attention_mask.shape[1])
    for la, lb in zip(a.cache.layers, b.cache.layers):
        la.stack_rows(lb, width)

    def pad(mask: torch.Tensor) -> torch.Tensor:
        return F.pad(mask, [width - mask.shape[1], 0])

    return RunningBatch(
        seqs=a.seqs + b.seqs,
        cache=a.cache,
        attention_mask=torch.cat([pad(a.attention_mask), pad(b.attention_mask)]),
        positions=torch.cat([a.positions, b.positions]),
        last_tokens=torch.cat([a.last_tokens, b.last_tokens]),
    )


def keep_rows(batch: RunningBatch, keep_list: list[int], trim_padding: bool) -> RunningBatch:
    """The batch with only rows `keep_list` (its cache narrowed in place). With
    `trim_padding` (caches that `can_join` only) the last kept rows move into the places of
    leaving ones instead of every kept row being copied, and columns that are padding for
    every remaining row are dropped too, so a long finished prompt stops costing attention."""
    device = batch.attention_mask.device
    order = fill_holes(keep_list) if trim_padding else keep_list
    keep = torch.tensor(order, device=device)
    if trim_padding:
        moved = [i for i, old in enumerate(order) if old != i]
        src = torch.tensor([order[i] for i in moved], dtype=torch.long, device=device)
        dst = torch.tensor(moved, dtype=torch.long, device=device)
        for layer in batch.cache.layers:
            layer.move_rows(src, dst, len(order))
    else:
        batch.cache.batch_select_indices(keep)
    mask = batch.attention_mask[keep]
    start = int(mask.any(dim=0).int().argmax()) if trim_padding else 0
    if start > 0:  # drop columns that are padding for every remaining row
        for layer in batch.cache.layers:
            layer.drop_leading_columns(start)
    return RunningBatch(
        seqs=[batch.seqs[i] for i in order],
        cache=batch.cache,
        attention_mask=mask[:, start:],
        positions=batch.positions[keep],
        last_tokens=batch.last_tokens[keep],
    )


def fill_holes(keep_list: list[int]) -> list[int]:
    """Old row of each new row when the kept rows (ascending) stay in the first
    len(keep_list) places: a kept row there stays put, a leaving one's place takes a kept row
    from beyond them."""
    n, kept = len(keep_list), set(keep_list)
    movers = iter(i for i in keep_list if i >= n)
    return [i if i in kept else next(movers) for i in range(n)]


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
