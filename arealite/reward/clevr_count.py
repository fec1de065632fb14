"""CLEVR-count reward: the model counts objects in an image and writes the number last,
preferably bracketed ("... so there are [4]")."""

from __future__ import annotations

import re

from arealite.reward.arith import ExactMatchReward

_BRACKETED = re.compile(r"\[\s*(\d+)\s*\]")
_NUMBER = re.compile(r"\d+")


def extract_count(text: str) -> int | None:
    """The last bracketed number `[n]` if any, else the last number, else None."""
    found = _BRACKETED.findall(text) or _NUMBER.findall(text)
    return int(found[-1]) if found else None


# 1.0 if the extracted count equals row["answer"], else 0.0.
clevr_count_reward_fn = ExactMatchReward(
    "clevr_count_reward_fn", extract_count, False, "has no number"
)
