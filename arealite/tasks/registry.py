"""The built-in tasks, by name: `train_dataset.path: arith` (or gsm8k, clevr_count_70k,
synthetic_counting) picks an entry of TASKS; anything else is the user's own data, read by the
generic loader (arealite/dataset/).

An entry is the task: its loader turns (split, type, tokenizer, processor, **options) into
canonical rows, `options` naming the task's own settings (`train_dataset.options:
{max_digits: 1}` for arith, so the shared DatasetConfig holds nothing task-specific); its reward
scores a completion (arealite/api/reward_api.py's contract) and is the run's reward when the
config names none; `reward_names` are the short names a config's `reward:` may use for it
(`reward: math_verify` on any math data). `aliases` are exact names (a hub id) that mean the
same task.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import arealite.tasks.arith as arith
import arealite.tasks.clevr_count as clevr_count
import arealite.tasks.gsm8k as gsm8k
import arealite.tasks.long_sums as long_sums
import arealite.tasks.synthetic_counting as synthetic_counting


@dataclass(frozen=True)
class Task:
    load: Callable[..., Any]  # (split, type, tokenizer, processor, **options) -> Dataset
    reward: Callable[..., float]  # the task's reward: the contract's signature
    reward_names: tuple[str, ...]  # its short names in `reward:`; the first is the default
    options: tuple[str, ...]  # the option names `load` accepts
    aliases: tuple[str, ...] = field(default=())
    vision: bool = False  # rows carry images: needs a processor
    shards_itself: bool = False  # `load` takes rank / world_size (lazy image transforms)


_COUNT = dict(vision=True, shards_itself=True)
TASKS: dict[str, Task] = {
    "arith": Task(arith.load, arith.arith_reward_fn, ("arith",), arith.OPTIONS),
    "long_sums": Task(
        long_sums.load, long_sums.long_sums_reward_fn, ("long_sums",), long_sums.OPTIONS
    ),
    "gsm8k": Task(
        gsm8k.load,
        gsm8k.math_reward_fn,
        ("math_verify", "gsm8k"),
        gsm8k.OPTIONS,
        aliases=(gsm8k.GSM8K_HUB_ID,),
    ),
    "clevr_count_70k": Task(
        clevr_count.load,
        clevr_count.clevr_count_reward_fn,
        ("clevr_count",),
        clevr_count.OPTIONS,
        aliases=(clevr_count.HF_DATASET_ID,),
        **_COUNT,
    ),
    "synthetic_counting": Task(
        synthetic_counting.load,
        clevr_count.clevr_count_reward_fn,
        ("clevr_count",),
        synthetic_counting.OPTIONS,
        **_COUNT,
    ),
}


def find_task(path: str) -> tuple[str, Task] | None:
    """(name, entry) of the built-in task `path` names exactly (name or alias), else None."""
    for name, task in TASKS.items():
        if path == name or path in task.aliases:
            return name, task
    return None


def builtin_reward(name: str) -> Callable[..., float] | None:
    """The built-in reward a short name (`reward: arith`) means, else None."""
    for task in TASKS.values():
        if name in task.reward_names:
            return task.reward
    return None


REWARD_NAMES = tuple(sorted({n for task in TASKS.values() for n in task.reward_names}))


def default_reward(path: str) -> str | None:
    """The short name of a built-in task's reward (None for user data: the config names one)."""
    found = find_task(path)
    return found[1].reward_names[0] if found else None


def is_vision_dataset(path: str, model_path: str = "") -> bool:
    """Rows carry images (the loop then needs the model's processor and a vision workflow): a
    vision built-in task, or a local model folder with an image preprocessor."""
    found = find_task(path)
    if found is not None:
        return found[1].vision
    return os.path.isfile(os.path.join(model_path, "preprocessor_config.json"))
