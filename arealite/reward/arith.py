"""Exact-match reward of the synthetic arithmetic task: the last integer in the completion."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last (signed) integer in `text`, e.g. 46 in "12+34=46" or in "\\boxed{46}"."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def arith_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str | int | None = None,
    **row,
) -> float:
    """1.0 if the completion's last integer equals row["answer"], else 0.0."""
    if answer is None:
        raise ValueError("arith_reward_fn needs the dataset row's 'answer' field")
    gold = last_integer(str(answer))
    if gold is None or str(gold) != str(answer).strip():
        raise ValueError(f"arith_reward_fn: reference answer {answer!r} is not an integer")
    return float(last_integer(completions) == gold)
