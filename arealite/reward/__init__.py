"""Reward functions: `reward_fn(prompt, completions, prompt_ids, completion_ids, **row) -> float`.
Imports arealite.api and arealite.utils only.

`completions` is ONE completion string (the name follows AReaL); `row` is the dataset row, so
`answer` arrives as a keyword. All functions are module-level, hence picklable into the reward
process pool of the RLVR workflow.
"""

from __future__ import annotations

from collections.abc import Callable

from arealite.reward.arith import arith_reward_fn
from arealite.reward.clevr_count import clevr_count_reward_fn
from arealite.reward.math_verify_reward import gsm8k_reward_fn, math_reward_fn

__all__ = [
    "REWARD_FNS",
    "arith_reward_fn",
    "clevr_count_reward_fn",
    "get_reward_fn",
    "gsm8k_reward_fn",
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
