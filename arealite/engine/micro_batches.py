"""Micro-batches every rank agrees on. FSDP runs collectives in each forward and backward, so
all ranks must run the same number of micro-batches: the split is rebalanced to the busiest
rank's count, and ranks that still have fewer (or no data) run 1-token dummies."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.cli_args import MicroBatchSpec
from arealite.utils import distributed as du
from arealite.utils.data import MicroBatchList, split_padded_tensor_dict_into_mb_list


def split_across_ranks(
    input_: TensorDict, spec: MicroBatchSpec
) -> tuple[MicroBatchList | None, int] | None:
    """Split this rank's batch under `spec.max_tokens_per_mb` (a collective). Returns None if
    every rank is empty, else (this rank's micro-batches, None when it has no data; the number
    of micro-batches every rank must run)."""
    n_seqs = input_.batch_size[0]
    if sum(du.all_gather_int(n_seqs)) == 0:
        return None
    mbl = None
    if n_seqs:
        mbl = split_padded_tensor_dict_into_mb_list(input_, spec.max_tokens_per_mb, spec.n_mbs)
    n_local = len(mbl) if mbl else 0
    n_max = int(du.all_reduce_max([n_local])[0])
    if 0 < n_local < n_max:  # rebalance into as many micro-batches as the busiest rank
        alt = split_padded_tensor_dict_into_mb_list(input_, spec.max_tokens_per_mb, n_max)
        mbl = alt if len(alt) <= n_max else mbl
    return mbl, n_max


def dummy_mb(device: torch.device) -> dict[str, Any]:
    """A packed 1-token micro-batch, marked `dummy`: its loss is multiplied by 0."""
    cu = torch.tensor([0, 1], dtype=torch.int32)
    packed = dict(
        input_ids=torch.zeros(1, dtype=torch.long),
        position_ids=torch.zeros(1, dtype=torch.long),
        cu_seqlens=cu,
        max_seqlen=1,
        seq_keys=("input_ids",),
        dummy=True,
    )
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.items()}
