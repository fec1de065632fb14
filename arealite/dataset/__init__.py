"""Datasets from the config: `load_rows(cfg, rank, world_size, type, tokenizer, processor)`, or
`get_custom_dataset(path, ...)` with the same settings as keywords. Imports arealite.api and
arealite.utils only.

`path` is a built-in task name (registry.py: arith, gsm8k / openai/gsm8k, clevr_count_70k,
synthetic_counting; their settings come as `options`) or any dataset `datasets` can open
(sources.py: a .jsonl / .json / .parquet / .csv file, a `save_to_disk` folder, a hub id with
`name` / `split` / `data_files`), whose columns become canonical rows (rows.py).
The result is a `datasets.Dataset` (map-style, so StatefulDataLoader can checkpoint its position)
holding this rank's shard; every rank builds the same rows and keeps a disjoint contiguous slice.
"""

from __future__ import annotations

import os
from typing import Any

from arealite.dataset.common import DatasetFormatError, drop_long_rows
from arealite.dataset.gsm8k import write_synthetic_gsm8k_jsonl
from arealite.dataset.registry import ARITH_OPTIONS, BUILTIN_TASKS, find_task
from arealite.dataset.rows import rl_row, sft_row_from
from arealite.dataset.sources import DatasetNotFoundError, map_columns, open_source

__all__ = [
    "ARITH_OPTIONS",
    "BUILTIN_TASKS",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "check_dataset_config",
    "default_reward",
    "first_reward_row",
    "get_custom_dataset",
    "is_vision_dataset",
    "load_rows",
    "preview_rows",
    "shard_dataset",
    "write_synthetic_gsm8k_jsonl",
]


def shard_dataset(ds: Any, rank: int, world_size: int) -> Any:
    """This rank's contiguous shard; shards of all ranks partition the dataset."""
    from datasets.distributed import split_dataset_by_node

    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return split_dataset_by_node(ds, rank=rank, world_size=world_size)


def default_reward(path: str) -> str | None:
    """The built-in reward of a built-in task (None for user data: the config must name one)."""
    found = find_task(path)
    return found[1].reward if found else None


def is_vision_dataset(path: str, model_path: str = "") -> bool:
    """Rows carry images (the loop then needs the model's processor and a vision workflow): a
    vision built-in task, or a local model folder with an image preprocessor."""
    found = find_task(path)
    if found is not None:
        return found[1].vision
    return os.path.isfile(os.path.join(model_path, "preprocessor_config.json"))


def load_rows(cfg: Any, rank: int, world_size: int, type: str, tokenizer=None, processor=None):
    """This rank's shard of the dataset a DatasetConfig describes."""
    return get_custom_dataset(
        cfg.path, rank, world_size, type=type, split=cfg.split, tokenizer=tokenizer,
        processor=processor, max_length=cfg.max_length, too_long=cfg.too_long, name=cfg.name,
        data_files=cfg.data_files, columns=cfg.columns, prompt_template=cfg.prompt_template,
        **(cfg.options or {}),
    )  # fmt: skip


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
    name: str | None = None,
    data_files: Any = None,
    columns: dict[str, str] | None = None,
    prompt_template: str | None = None,
    **options: Any,
) -> Any:
    """This rank's shard of dataset `path`, as RL rows (messages, query_id, and the other
    columns: answer, images, ...) or SFT rows (input_ids, loss_mask). Rows longer than
    `max_length` tokens are dropped (and counted in the log) before sharding, so every rank
    drops the same rows. `options` go to a built-in task."""
    if type not in ("rl", "sft"):
        raise ValueError(f"dataset type must be 'rl' or 'sft', got {type!r}")
    if tokenizer is None and processor is not None:
        tokenizer = getattr(processor, "tokenizer", None)
    if type == "sft" and tokenizer is None:
        raise ValueError(f"SFT dataset {path!r} needs a tokenizer")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    found = find_task(path)
    if found is not None:
        ds = _builtin_rows(found, split, type, tokenizer, processor, rank, world_size, options)
        if found[1].shards_itself:
            return ds
    else:
        if options:
            raise TypeError(
                f"dataset {path!r} is not a built-in task, so options {sorted(options)} mean "
                f"nothing (built-in tasks: {sorted(BUILTIN_TASKS)})"
            )
        raw = preview_rows(path, split, name, data_files, columns, n=None)
        ds = _canonical_rows(raw, path, split, type, tokenizer, prompt_template, columns)
    if len(ds) == 0:
        raise DatasetFormatError(f"dataset {path!r} (split {split!r}) has no rows")
    ds = drop_long_rows(ds, max_length, type, tokenizer, name=f"{path}:{split}", on_long=too_long)
    return shard_dataset(ds, rank, world_size)


def _builtin_rows(found, split, type, tokenizer, processor, rank, world_size, options) -> Any:
    task_name, task = found
    unknown = set(options) - set(task.options)
    if unknown:
        raise TypeError(
            f"dataset {task_name!r} got unknown options {sorted(unknown)}; it takes "
            f"{list(task.options)}"
        )
    if task.shards_itself:
        options = dict(options, rank=rank, world_size=world_size)
    return task.load(split, type, tokenizer, processor, **options)


def check_dataset_config(cfg: Any, type: str) -> None:
    """What preflight checks in about a second: a built-in task knows its options; any other
    dataset opens and its first rows have the canonical columns `type` needs."""
    found = find_task(cfg.path)
    if found is not None:
        unknown = set(cfg.options or {}) - set(found[1].options)
        if unknown:
            raise TypeError(
                f"options {sorted(unknown)} are not settings of {found[0]!r} "
                f"(it takes {list(found[1].options)})"
            )
        return
    if cfg.options:
        raise TypeError(f"options {sorted(cfg.options)} apply to built-in tasks only")
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


def first_reward_row(cfg: Any) -> dict | None:
    """Row 0 of an RL DatasetConfig's data as the reward receives it (canonical columns, the
    user's own names too), for preflight to call the reward on; None for a vision built-in
    task (its rows need the model's processor)."""
    found = find_task(cfg.path)
    if found is not None:
        if found[1].vision:
            return None
        options = dict(cfg.options or {})
        return dict(_builtin_rows(found, cfg.split, "rl", None, None, 0, 1, options)[0])
    raw = preview_rows(cfg.path, cfg.split, cfg.name, cfg.data_files, cfg.columns, n=1)
    source = f"dataset {cfg.path!r} split {cfg.split!r}"
    prefix = _id_prefix(cfg.path, cfg.split)
    return rl_row(raw[0], 0, cfg.prompt_template, source, prefix, cfg.columns)


def preview_rows(path, split="train", name=None, data_files=None, columns=None, n=8) -> Any:
    """The raw table of a non-built-in dataset with canonical column names (first `n` rows
    only when `n` is given: what preflight checks)."""
    try:
        ds = open_source(path, split, name, data_files)
    except DatasetNotFoundError as e:
        raise DatasetNotFoundError(f"{e} (built-in tasks: {sorted(BUILTIN_TASKS)})") from e
    if n is not None:
        ds = ds.select(range(min(n, len(ds))))
    return map_columns(ds, columns, source=f"dataset {path!r}")


def _id_prefix(path: str, split: str) -> str:
    return f"{os.path.basename(path.rstrip('/')) or path}-{split}"


def _canonical_rows(raw, path, split, type, tokenizer, template, columns=None) -> Any:
    source = f"dataset {path!r} split {split!r}"
    prefix = _id_prefix(path, split)
    if type == "rl":
        fn = rl_row
        kw = {"template": template, "source": source, "id_prefix": prefix, "aliases": columns}
    else:
        fn, kw = sft_row_from, {"tokenizer": tokenizer, "template": template, "source": source}
    return raw.map(
        fn, with_indices=True, fn_kwargs=kw, remove_columns=raw.column_names,
        keep_in_memory=True, load_from_cache_file=False,
    )  # fmt: skip
