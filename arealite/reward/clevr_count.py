"""CLEVR-count reward: the model counts objects in an image and writes the number last,
preferably bracketed ("... so there are [4]")."""

from __future__ import annotations

import re

_BRACKETED = re.compile(r"\[\s*(\d+)\s*\]")
_NUMBER = re.compile(r"\d+")


def extract_count(text: str) -> int | None:
    """The last bracketed number `[n]` if any, else the last number, else None."""
    found = _BRACKETED.findall(text) or _NUMBER.findall(text)
    return int(found[-1]) if found else None


def clevr_count_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str | int | None = None,
    **row,
) -> float:
    """1.0 if the extracted count equals row["answer"], else 0.0."""
    if answer is None:
        raise ValueError("clevr_count_reward_fn needs the dataset row's 'answer' field")
    gold = extract_count(str(answer))
    if gold is None:
        raise ValueError(f"clevr_count_reward_fn: reference answer {answer!r} has no number")
    return float(extract_count(completions) == gold)
