"""Datasets by name: `get_custom_dataset(path, rank, world_size, type="rl"|"sft", ...)`.
Imports arealite.api and arealite.utils only.

`path` picks the task: "arith" (synthetic arithmetic, see arith.py), a GSM8K hub id
("openai/gsm8k") or a local GSM8K-format .jsonl / .parquet file or directory (see gsm8k.py),
a CLEVR-count source (any path containing "clevr_count_70k") or "synthetic_counting" (its
offline stand-in, `size` rows from `seed`); the vision sets need a `processor`
(see clevr_count_70k.py).
The result is a `datasets.Dataset` (map-style, so StatefulDataLoader can checkpoint its position)
holding this rank's shard; every rank builds the same rows and keeps a disjoint contiguous slice.
"""

from __future__ import annotations

import os
from typing import Any

from arealite.dataset.arith import get_arith_dataset
from arealite.dataset.common import DatasetFormatError, drop_long_rows
from arealite.dataset.gsm8k import get_gsm8k_dataset, write_synthetic_gsm8k_jsonl

__all__ = [
    "ARITH_KWARGS",
    "DatasetFormatError",
    "get_custom_dataset",
    "shard_dataset",
    "write_synthetic_gsm8k_jsonl",
]

# Knobs of the synthetic arithmetic task (DatasetConfig.size / seed / max_digits / n_operands).
ARITH_KWARGS = ("size", "seed", "max_digits", "n_operands", "ops", "test_fraction")


def _has_content(path: str) -> bool:
    with open(path, "rb") as f:
        return bool(f.read(4096).strip())


def shard_dataset(ds: Any, rank: int, world_size: int) -> Any:
    """This rank's contiguous shard; shards of all ranks partition the dataset."""
    from datasets.distributed import split_dataset_by_node

    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return split_dataset_by_node(ds, rank=rank, world_size=world_size)


def get_custom_dataset(
    path: str,
    rank: int = 0,
    world_size: int = 1,
    type: str = "rl",
    split: str = "train",
    tokenizer: Any = None,
    processor: Any = None,
    max_length: int | None = None,
    too_long: str = "drop",
    **kwargs: Any,
) -> Any:
    """This rank's shard of dataset `path`, as RL rows (messages, answer, query_id) or SFT rows
    (input_ids, loss_mask). Rows longer than `max_length` tokens are dropped (and counted in
    the log) before sharding, so every rank drops the same rows."""
    if type not in ("rl", "sft"):
        raise ValueError(f"dataset type must be 'rl' or 'sft', got {type!r}")
    if tokenizer is None and processor is not None:
        tokenizer = getattr(processor, "tokenizer", None)
    if type == "sft" and tokenizer is None:
        raise ValueError(f"SFT dataset {path!r} needs a tokenizer")
    unknown = set(kwargs) - set(ARITH_KWARGS)
    if unknown:
        raise TypeError(f"get_custom_dataset got unknown arguments {sorted(unknown)}")
    if path == "synthetic_counting" or "clevr_count_70k" in path.lower():
        return _vision_dataset(path, rank, world_size, type, split, processor, kwargs)
    if path == "arith":
        ds = get_arith_dataset(split, type, tokenizer, **kwargs)
    elif os.path.isfile(path) and not _has_content(path):
        raise DatasetFormatError(f"dataset file {path!r} is empty")
    elif "gsm8k" in path.lower() or os.path.exists(path):
        # The arithmetic knobs (always present in DatasetConfig) mean nothing here.
        ds = get_gsm8k_dataset(path, split, type, tokenizer)
    else:
        raise ValueError(
            f"Unknown dataset {path!r}: use 'arith', a GSM8K hub id ('openai/gsm8k'), or a local "
            "GSM8K-format .jsonl / .parquet file or directory"
        )
    if len(ds) == 0:
        raise DatasetFormatError(f"dataset {path!r} (split {split!r}) has no rows")
    ds = drop_long_rows(ds, max_length, type, tokenizer, name=f"{path}:{split}", on_long=too_long)
    return shard_dataset(ds, rank, world_size)


def _vision_dataset(path, rank, world_size, type, split, processor, kwargs) -> Any:
    """CLEVR-count rows (RL: messages + images + answer; SFT: ids + images), sharded inside."""
    from arealite.dataset import clevr_count_70k as clevr

    if processor is None:
        raise ValueError(f"vision dataset {path!r} needs a processor (load_vlm_processor(path))")
    if path == "synthetic_counting":
        path = clevr.synthetic_counting_dir(kwargs.get("size", 256), kwargs.get("seed", 0), split)
    if type == "rl":
        return clevr.get_clevr_count_70k_rl_dataset(path, split, processor, rank, world_size)
    return clevr.get_clevr_count_70k_sft_dataset(path, split, processor, rank, world_size)
