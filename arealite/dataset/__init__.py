"""The user's own data as canonical rows: any dataset `datasets` can open (sources.py: a .jsonl /
.json / .parquet / .csv file, a `save_to_disk` folder, a hub id with `name` / `split` /
`data_files`), whose columns become canonical rows (rows.py), plus the row building blocks the
built-in tasks share (common.py). Imports arealite.api and arealite.utils only.

Built-in tasks by name (arith, gsm8k, ...) and the entry point that picks a task or the user's
data, `load_rows(cfg, ...)`, are in arealite/tasks/. Every rank builds the same rows and keeps a
disjoint contiguous slice (`shard_dataset`).
"""

from __future__ import annotations

import os
from typing import Any

from arealite.dataset.common import DatasetFormatError, map_rows
from arealite.dataset.rows import rl_row, sft_row_from
from arealite.dataset.sources import DatasetNotFoundError, map_columns, open_source

__all__ = [
    "DatasetFormatError",
    "DatasetNotFoundError",
    "check_user_dataset",
    "first_user_row",
    "preview_rows",
    "shard_dataset",
    "user_rows",
]


def shard_dataset(ds: Any, rank: int, world_size: int) -> Any:
    """This rank's contiguous shard; shards of all ranks partition the dataset."""
    from datasets.distributed import split_dataset_by_node

    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return split_dataset_by_node(ds, rank=rank, world_size=world_size)


def preview_rows(path, split="train", name=None, data_files=None, columns=None, n=8) -> Any:
    """The raw table of a user's dataset with canonical column names (first `n` rows only when
    `n` is given: what preflight checks)."""
    ds = open_source(path, split, name, data_files)
    if n is not None:
        ds = ds.select(range(min(n, len(ds))))
    return map_columns(ds, columns, source=f"dataset {path!r}")


def user_rows(path, split, type, tokenizer, name, data_files, columns, template) -> Any:
    """All canonical rows (RL or SFT) of a user's dataset, before length filter and sharding."""
    raw = preview_rows(path, split, name, data_files, columns, n=None)
    source = f"dataset {path!r} split {split!r}"
    if type == "rl":
        fn = rl_row
        kw = {
            "template": template,
            "source": source,
            "id_prefix": _id_prefix(path, split),
            "aliases": columns,
        }
    else:
        fn, kw = sft_row_from, {"tokenizer": tokenizer, "template": template, "source": source}
    return map_rows(raw, fn, kw)


def check_user_dataset(cfg: Any, type: str) -> None:
    """What preflight checks in about a second: the dataset opens and its first rows have the
    canonical columns `type` needs."""
    rows = preview_rows(cfg.path, cfg.split, cfg.name, cfg.data_files, cfg.columns, n=8)
    need = (
        [("messages",), ("prompt",)] if type == "rl" else [("messages",), ("prompt", "completion")]
    )
    if not any(all(c in rows.column_names for c in group) for group in need):
        wanted = " or ".join("+".join(g) for g in need)
        raise DatasetFormatError(
            f"dataset {cfg.path!r} has columns {rows.column_names} but {type.upper()} needs "
            f"{wanted}; map yours with columns: {{prompt: <your column>}}"
        )
    source = f"dataset {cfg.path!r} split {cfg.split!r}"
    for i, row in enumerate(rows):
        if type == "rl":
            rl_row(row, i, cfg.prompt_template, source, "preflight")
        elif row.get("messages") is None and row.get("completion") is None:
            raise DatasetFormatError(f"{source}: row {i} has no 'completion'")


def first_user_row(cfg: Any) -> dict:
    """Row 0 of a user's RL dataset as the reward receives it (canonical columns, the user's
    own names too)."""
    raw = preview_rows(cfg.path, cfg.split, cfg.name, cfg.data_files, cfg.columns, n=1)
    source = f"dataset {cfg.path!r} split {cfg.split!r}"
    prefix = _id_prefix(cfg.path, cfg.split)
    return rl_row(raw[0], 0, cfg.prompt_template, source, prefix, cfg.columns)


def _id_prefix(path: str, split: str) -> str:
    return f"{os.path.basename(path.rstrip('/')) or path}-{split}"
