"""Exact-match reward of the synthetic arithmetic task: the last integer in the completion."""

from __future__ import annotations

import re
from collections.abc import Callable

from arealite.api.reward_api import Reward, RewardInput

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last (signed) integer in `text`, e.g. 46 in "12+34=46" or in "\\boxed{46}"."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


class ExactMatchReward(Reward):
    """1.0 if the value `extract` finds in the completion equals the one in row["answer"],
    else 0.0.

    A class rather than one function per task so the task only names its extractor; an
    instance pickles (its extractor is a module-level function) for the reward worker processes.
    `strict`: the reference answer must be exactly the extracted value (e.g. "16", not "x=16").
    """

    def __init__(self, name: str, extract: Callable[[str], int | None], strict: bool, why: str):
        self.__name__ = self.name = name
        self.extract, self.strict, self.why = extract, strict, why

    def score(self, sample: RewardInput) -> float:
        answer = sample.row.get("answer")
        if answer is None:
            raise ValueError(f"{self.name} needs the dataset row's 'answer' field")
        gold = self.extract(str(answer))
        if gold is None or (self.strict and str(gold) != str(answer).strip()):
            raise ValueError(f"{self.name}: reference answer {answer!r} {self.why}")
        return float(self.extract(sample.completion) == gold)


# 1.0 if the completion's last integer equals row["answer"], else 0.0.
arith_reward_fn = ExactMatchReward("arith_reward_fn", last_integer, True, "is not an integer")
