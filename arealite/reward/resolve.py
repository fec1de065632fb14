"""The reward a run uses, built from the config's `reward:` / `reward_weights:`.

One spec runs in one RewardPool. Several run as one pool each (so each keeps its own timeout
and error counts) and are summed with their weights; the mean of each component since the last
`component_stats()` call goes to the metrics as `reward/<spec>`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from arealite.api.reward_api import ContractReward, reward_specs
from arealite.reward.pool import RewardPool
from arealite.utils.reward_errors import FailFast

COUNTERS = ("calls", "ok", "timeouts", "errors")


class WeightedRewardPool:
    """Drop-in for RewardPool (`await pool(**kw)`, `.stats`, `.close()`) over several rewards."""

    def __init__(
        self,
        specs: list[tuple[str, float]],
        workers: int,
        timeout: float,
        fail_fast: FailFast | None = None,
    ):
        self.components = [
            (s, w, RewardPool(ContractReward(s), workers, timeout, fail_fast=fail_fast))
            for s, w in specs
        ]
        self._sums = {s: 0.0 for s, _ in specs}
        self._counts = {s: 0 for s, _ in specs}

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        values = await asyncio.gather(*(p(*args, **kwargs) for _, _, p in self.components))
        for (spec, _, _), v in zip(self.components, values):
            self._sums[spec] += v
            self._counts[spec] += 1
        return sum(w * v for (_, w, _), v in zip(self.components, values))

    @property
    def stats(self) -> dict[str, int]:
        """Counters summed over the components (a sample counts once per component)."""
        return {k: sum(p.stats[k] for _, _, p in self.components) for k in COUNTERS}

    def component_stats(self) -> dict[str, float]:
        """Mean of each component since the last call (then reset)."""
        out = {
            f"reward/{s}": self._sums[s] / self._counts[s] for s in self._sums if self._counts[s]
        }
        self._sums = dict.fromkeys(self._sums, 0.0)
        self._counts = dict.fromkeys(self._counts, 0)
        return out

    def close(self) -> None:
        for _, _, p in self.components:
            p.close()


def make_reward_pool(
    reward: Any, weights: Any, workers: int, timeout: float, fail_fast: FailFast | None = None
):
    """A RewardPool for one reward spec, a WeightedRewardPool for a list of them; `fail_fast`
    (`config.rollout.reward_fail_fast()`) stops the run on a broken reward, each spec judged
    on its own calls."""
    specs = reward_specs(reward, weights)
    if len(specs) == 1 and specs[0][1] == 1.0:
        return RewardPool(ContractReward(specs[0][0]), workers, timeout, fail_fast=fail_fast)
    return WeightedRewardPool(specs, workers, timeout, fail_fast)
