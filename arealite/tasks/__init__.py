"""Tasks: what a run trains on. A task is a data source plus a reward; a built-in task is one
module here holding both, with its held-out rule: arith.py (synthetic arithmetic, exact match),
gsm8k.py (grade-school math, math-verify), clevr_count.py (vision counting, the last bracketed
number) and synthetic_counting.py (its offline stand-in). registry.py is the one table: task
name -> (loader, reward, options); `train_dataset.path: arith` picks an entry, and its reward is
the run's when `reward:` is unset. load.py gives a config's rows, built-in or not.

Your own task has the same shape, in the config: a data source (`train_dataset.path`: a .jsonl /
.parquet / .csv file, a folder, a hub id; `columns:` maps your column names) and a reward
(`reward: my_rewards.py:score`, the contract in arealite/api/reward_api.py). Nothing to register.

Imports arealite.api, arealite.utils and arealite.dataset (the generic loader and row building
blocks); arealite.reward imports this package (built-in rewards by short name), never the
reverse.
"""

from arealite.tasks.load import (
    check_dataset_config,
    first_reward_row,
    get_custom_dataset,
    load_rows,
)
from arealite.tasks.registry import TASKS, default_reward, find_task, is_vision_dataset

__all__ = [
    "TASKS",
    "check_dataset_config",
    "default_reward",
    "find_task",
    "first_reward_row",
    "get_custom_dataset",
    "is_vision_dataset",
    "load_rows",
]
