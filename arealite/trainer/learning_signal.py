"""Say out loud when GRPO has nothing to learn from.

A group whose samples all got the same reward has zero advantage everywhere, so it moves the
policy by nothing (only the KL term, if any). When every group of several consecutive steps is
like that, the run looks healthy (steps, losses, throughput) while training on nothing; issue
23's run trained 12 steps on reward 0.0 because its reward read a column that arrived as None.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("arealite.trainer")


class NoLearningSignal:
    """`observe(step, rewards)` once per step (rewards: the batch's sequence rewards, groups of
    `group_size` consecutive samples); warns once, returning the message, when `steps`
    consecutive steps had equal rewards in every group. `steps=0` turns it off."""

    def __init__(self, steps: int, group_size: int):
        if steps < 0 or group_size < 1:
            raise ValueError(f"need steps >= 0 and group_size >= 1, got {steps}, {group_size}")
        self.steps = steps
        self.group_size = group_size
        self.first_step: int | None = None  # of the current run of signal-free steps
        self.streak = 0
        self.values: Counter[float] = Counter()  # rewards seen in that run
        self.warned = False

    def observe(self, step: int, rewards: Any) -> str | None:
        values = [float(r) for r in (rewards.tolist() if hasattr(rewards, "tolist") else rewards)]
        if self.warned or not self.steps or not values:
            return None
        n = self.group_size
        groups = [values[i : i + n] for i in range(0, len(values), n)]
        if any(max(g) != min(g) for g in groups):
            self.streak, self.first_step, self.values = 0, None, Counter()
            return None
        self.streak += 1
        self.first_step = step if self.first_step is None else self.first_step
        self.values.update(values)
        if self.streak < self.steps:
            return None
        self.warned = True
        message = self.describe(step, len(groups))
        logger.warning("%s", message)
        return message

    def describe(self, step: int, n_groups: int) -> str:
        seen = ", ".join(f"{v:g} x{c}" for v, c in sorted(self.values.items()))
        likely = _likely_causes(list(self.values))
        return (
            f"no learning signal: in each of steps {self.first_step}..{step} ({self.streak} "
            f"steps, {n_groups} groups of {self.group_size} in the last) every group's samples "
            f"got equal rewards (rewards seen: {seen}), so every advantage is 0 and the policy "
            f"learns nothing. Likely: {likely} (warned once; rollout.no_signal_steps)"
        )


def _likely_causes(values: Sequence[float]) -> str:
    reads_none = (
        "the reward gets None for a column it reads (its keyword names must match the row's "
        "columns: the canonical ones or your own, README 'Bring your own task'); or it raises "
        "and scores 0 (rollout/errors)"
    )
    if set(values) == {0.0}:
        return f"{reads_none}; or the task is too hard for the warm start (try an easier " + (
            "task, more gconfig.n_samples, or SFT first)"
        )
    if len(set(values)) == 1 and max(values) > 0:
        return "the task is too easy for the warm start (every sample is right: a harder task)"
    return f"{reads_none}; or the reward does not depend on the completion"
