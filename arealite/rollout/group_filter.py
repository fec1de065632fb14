"""DAPO's dynamic sampling at the executor: groups whose rewards are all equal never reach the
trainer.

Under group-normalised advantages (GRPO, Dr. GRPO, DAPO) such a group has zero advantage on every
token, so training on it costs a forward and a backward for no gradient, and zeroing its loss
mask (the old `actor.dynamic_sampling`) shrinks the batch instead of refilling it. Used as the
executor's `should_accept`, a refused group frees its slot and `prepare_batch` starts another
data item in its place; staleness stays exact because only accepted episodes count against the
bound (docs/design.md, "Asynchrony and staleness"). Over-sampling is bounded: after
`max_dropped` refusals since the last batch the filter accepts what comes (the actor's loss mask
still zeroes those groups), so a task the policy always solves or always fails cannot stall the
run. Counters go to the metrics as `rollout/groups_*`.
"""

from __future__ import annotations

import threading

from tensordict import TensorDict

REWARD_TOL = 1e-6


def is_informative(group: TensorDict) -> bool:
    """Whether the group's rewards differ (a non-zero group-normalised advantage somewhere)."""
    rewards = group["rewards"].float()
    return rewards.numel() > 1 and bool(rewards.max() - rewards.min() > REWARD_TOL)


class InformativeGroupFilter:
    """`should_accept` for `WorkflowExecutor.prepare_batch`; runs on the executor's loop thread,
    read by the trainer's thread through `take_stats` once per step."""

    def __init__(self, batch_size: int, max_oversample: float):
        if max_oversample < 1:
            raise ValueError(f"max_oversample must be >= 1, got {max_oversample}")
        self.max_dropped = int(round((max_oversample - 1) * batch_size))
        self._lock = threading.Lock()
        self._generated = self._dropped = self._forced = 0

    def __call__(self, group: TensorDict) -> bool:
        with self._lock:
            self._generated += 1
            if is_informative(group):
                return True
            if self._dropped >= self.max_dropped:
                self._forced += 1  # the cap: train on what there is
                return True
            self._dropped += 1
            return False

    def take_stats(self) -> dict[str, float]:
        """Counts since the last call (one training step), and re-arm the over-sampling cap."""
        with self._lock:
            stats = {
                "rollout/groups_generated": self._generated,
                "rollout/groups_dropped": self._dropped,
                "rollout/groups_accepted_uninformative": self._forced,
            }
            self._generated = self._dropped = self._forced = 0
        return stats
