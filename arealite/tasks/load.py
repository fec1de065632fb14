"""A config's data, whichever it is: a built-in task (registry.py) or the user's own data
(arealite/dataset/). `load_rows(cfg, rank, world_size, type, tokenizer, processor)`, or
`get_custom_dataset(path, ...)` with the same settings as keywords, gives this rank's shard as a
`datasets.Dataset` (map-style, so StatefulDataLoader can checkpoint its position).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from arealite.dataset import (
    DatasetFormatError,
    DatasetNotFoundError,
    check_user_dataset,
    first_user_row,
    shard_dataset,
    user_rows,
)
from arealite.dataset.common import drop_long_rows
from arealite.tasks.registry import TASKS, Task, find_task


def load_rows(cfg: Any, rank: int, world_size: int, type: str, tokenizer=None, processor=None):
    """This rank's shard of the dataset a DatasetConfig describes."""
    return get_custom_dataset(
        cfg.path,
        rank,
        world_size,
        type=type,
        split=cfg.split,
        tokenizer=tokenizer,
        processor=processor,
        max_length=cfg.max_length,
        too_long=cfg.too_long,
        name=cfg.name,
        data_files=cfg.data_files,
        columns=cfg.columns,
        prompt_template=cfg.prompt_template,
        **(cfg.options or {}),
    )


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
        ds = _task_rows(found, split, type, tokenizer, processor, rank, world_size, options)
        if found[1].shards_itself:
            return ds
    else:
        if options:
            raise TypeError(
                f"dataset {path!r} is not a built-in task, so options {sorted(options)} mean "
                f"nothing (built-in tasks: {sorted(TASKS)})"
            )
        with _naming_tasks():
            ds = user_rows(path, split, type, tokenizer, name, data_files, columns, prompt_template)
    if len(ds) == 0:
        raise DatasetFormatError(f"dataset {path!r} (split {split!r}) has no rows")
    ds = drop_long_rows(ds, max_length, type, tokenizer, name=f"{path}:{split}", on_long=too_long)
    return shard_dataset(ds, rank, world_size)


def _task_rows(
    found: tuple[str, Task], split, type, tokenizer, processor, rank, world_size, options
) -> Any:
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


@contextlib.contextmanager
def _naming_tasks() -> Iterator[None]:
    """A path that is neither a built-in task nor a dataset: say which tasks there are."""
    try:
        yield
    except DatasetNotFoundError as e:
        raise DatasetNotFoundError(f"{e} (built-in tasks: {sorted(TASKS)})") from e


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
    with _naming_tasks():
        check_user_dataset(cfg, type)


def first_reward_row(cfg: Any) -> dict | None:
    """Row 0 of an RL DatasetConfig's data as the reward receives it (canonical columns, the
    user's own names too), for preflight to call the reward on; None for a vision built-in
    task (its rows need the model's processor)."""
    found = find_task(cfg.path)
    if found is not None:
        if found[1].vision:
            return None
        options = dict(cfg.options or {})
        return dict(_task_rows(found, cfg.split, "rl", None, None, 0, 1, options)[0])
    with _naming_tasks():
        return first_user_row(cfg)
