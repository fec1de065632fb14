"""Built-in tasks by name: `train_dataset.path: arith` (or gsm8k, clevr_count_70k,
synthetic_counting) picks an entry here; anything else is a file, a folder or a hub id read by
the generic loader (sources.py + rows.py).

An entry turns (split, type, tokenizer, processor, **options) into canonical rows; `options`
are the task's own settings (`train_dataset.options: {max_digits: 1}` for arith), so the shared
DatasetConfig holds nothing task-specific. `reward` is the built-in reward the task uses when
the config names none. `aliases` are exact names (a hub id) that mean the same entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BuiltinTask:
    load: Callable[..., Any]  # (split, type, tokenizer, processor, **options) -> Dataset
    reward: str | None  # short name in arealite.api.reward_api.BUILTIN_REWARDS
    options: tuple[str, ...]  # the option names `load` accepts
    aliases: tuple[str, ...] = field(default=())
    vision: bool = False  # rows carry images: needs a processor
    shards_itself: bool = False  # `load` takes rank / world_size (lazy image transforms)


def _arith(split, type, tokenizer, processor, **options):
    from arealite.dataset.arith import get_arith_dataset

    return get_arith_dataset(split, type, tokenizer, **options)


def _gsm8k(split, type, tokenizer, processor, source="openai/gsm8k"):
    from arealite.dataset.gsm8k import get_gsm8k_dataset

    return get_gsm8k_dataset(source, split, type, tokenizer)


def _clevr(split, type, tokenizer, processor, rank=0, world_size=1, source=None, **synthetic):
    from arealite.dataset import clevr_count_70k as clevr

    if processor is None:
        raise ValueError("vision dataset needs a processor (load_vlm_processor(path))")
    if source is None:  # the offline synthetic stand-in
        source = clevr.synthetic_counting_dir(
            synthetic.get("size", 256), synthetic.get("seed", 0), split
        )
    if type == "rl":
        return clevr.get_clevr_count_70k_rl_dataset(source, split, processor, rank, world_size)
    return clevr.get_clevr_count_70k_sft_dataset(source, split, processor, rank, world_size)


def _synthetic_counting(split, type, tokenizer, processor, rank=0, world_size=1, **options):
    return _clevr(split, type, tokenizer, processor, rank, world_size, source=None, **options)


def _clevr_hub(split, type, tokenizer, processor, rank=0, world_size=1, source=None):
    from arealite.dataset.clevr_count_70k import HF_DATASET_ID

    source = source or HF_DATASET_ID
    return _clevr(split, type, tokenizer, processor, rank, world_size, source=source)


ARITH_OPTIONS = ("size", "seed", "max_digits", "n_operands", "ops", "test_fraction", "mix")

BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "arith": BuiltinTask(_arith, "arith", ARITH_OPTIONS),
    "gsm8k": BuiltinTask(_gsm8k, "math_verify", ("source",), aliases=("openai/gsm8k",)),
    "clevr_count_70k": BuiltinTask(
        _clevr_hub,
        "clevr_count",
        ("source",),
        aliases=("BUAADreamer/clevr_count_70k",),
        vision=True,
        shards_itself=True,
    ),  # fmt: skip
    "synthetic_counting": BuiltinTask(
        _synthetic_counting, "clevr_count", ("size", "seed"), vision=True, shards_itself=True
    ),
}


def find_task(path: str) -> tuple[str, BuiltinTask] | None:
    """(name, entry) of the built-in task `path` names exactly (name or alias), else None."""
    for name, task in BUILTIN_TASKS.items():
        if path == name or path in task.aliases:
            return name, task
    return None
