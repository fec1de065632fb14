"""Reward functions: `reward_fn(prompt, completions, prompt_ids, completion_ids, **row) -> float`.
Imports arealite.api and arealite.utils only. The contract, and how a config names a reward
(`reward: my_file.py:score`, built-ins by short name), are in arealite/api/reward_api.py;
`make_reward_pool(config.reward, config.reward_weights, ...)` builds what a workflow calls.

`completions` is ONE completion string (the name follows AReaL); `row` is the dataset row, so
`answer` arrives as a keyword. All functions are module-level, hence picklable into the reward
process pool of the RLVR workflow.
"""

from __future__ import annotations

from collections.abc import Callable

from arealite.reward.arith import arith_reward_fn
from arealite.reward.clevr_count import clevr_count_reward_fn
from arealite.reward.math_verify_reward import gsm8k_reward_fn, math_reward_fn
from arealite.reward.task_reward import WeightedRewardPool, make_reward_pool

__all__ = [
    "REWARD_FNS",
    "WeightedRewardPool",
    "arith_reward_fn",
    "clevr_count_reward_fn",
    "get_reward_fn",
    "gsm8k_reward_fn",
    "make_reward_pool",
    "math_reward_fn",
]

REWARD_FNS: dict[str, Callable[..., float]] = {
    "arith": arith_reward_fn,
    "clevr_count": clevr_count_reward_fn,
    "gsm8k": gsm8k_reward_fn,
    "math": math_reward_fn,
}


def get_reward_fn(name: str) -> Callable[..., float]:
    """The reward function called `name` (arith | clevr_count | gsm8k | math)."""
    if name not in REWARD_FNS:
        raise ValueError(f"Unknown reward {name!r}; choose one of {sorted(REWARD_FNS)}")
    return REWARD_FNS[name]
