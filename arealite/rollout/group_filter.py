"""DAPO's dynamic sampling at the executor: groups whose rewards are all equal never reach the
trainer.

Under group-normalised advantages (GRPO, Dr. GRPO, DAPO) such a group has zero advantage on every
token, so training on it costs a forward and a backward for no gradient, and zeroing its loss
mask alone would shrink the batch instead of refilling it. As `prepare_batch`'s `group_filter`,
a refused group frees its slot and `prepare_batch` starts another data item in its place; staleness stays exact because only accepted episodes count against the
bound (docs/design.md, "Asynchrony and staleness"). Over-sampling is bounded: after
`max_dropped` refusals since the last batch the filter accepts what comes (the actor zeroes
those groups' loss mask and leaves them out of its forward and backward), so a task the policy
always solves or always fails cannot stall the run. Counters go to the metrics as `rollout/groups_*`.

Refusing a group after generating it still costs its generation: late in a run most groups are
all-correct, and generation (not training) sets the pace. With `skip_max_prob > 0` the filter
also remembers, per prompt, how many of its last groups in a row were solved (every sample earned
the best reward seen so far: `streak`) and skips the prompt before generating it with probability
min(skip_max_prob, 1 - 2^-streak), after GRESO's pre-rollout filtering. Unlike GRESO, a prompt
every sample fails is not skipped: each of its groups is a draw for the rare success that makes it
informative, and such prompts hold the accuracy left to gain (skipping both kinds plateaued the
demo's task ~8 points lower, docs/results.md). A prompt is never skipped for sure, so one the
policy starts to fail again is seen again. The history lives in memory (a restart begins it anew).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from typing import Any

from tensordict import TensorDict

REWARD_TOL = 1e-6
PROMPT_FIELDS = ("messages", "prompt", "input_ids", "question")  # the first one present
ID_FIELDS = ("query_id", "id", "idx", "index")  # not part of the prompt when keying a whole row


def is_informative(group: TensorDict) -> bool:
    """Whether the group's rewards differ (a non-zero group-normalised advantage somewhere)."""
    rewards = group["rewards"].float()
    return rewards.numel() > 1 and bool(rewards.max() - rewards.min() > REWARD_TOL)


def prompt_key(item: Any) -> str:
    """What identifies a prompt across dataset rows (arith's 20,000 rows repeat ~1,000 sums under
    distinct query ids): its messages / prompt / input_ids / question, else the row less its id."""
    if isinstance(item, dict):
        field = next((f for f in PROMPT_FIELDS if f in item), None)
        content = item[field] if field else {k: v for k, v in item.items() if k not in ID_FIELDS}
    else:
        content = item
    text = json.dumps(content, sort_keys=True, default=_jsonable)
    return hashlib.sha1(text.encode()).hexdigest()


def _jsonable(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)  # tensors and arrays whole (repr elides long ones)
    return tolist() if callable(tolist) else repr(value)


class PromptHistory:
    """Per prompt, how many of its latest groups in a row were solved; the skip draw."""

    def __init__(self, max_prob: float, seed: int = 0):
        if not 0.0 <= max_prob < 1.0:
            raise ValueError(f"skip_max_prob must be in [0, 1), got {max_prob}")
        self.max_prob = max_prob
        self._streak: dict[str, int] = {}
        self._rng = random.Random(seed)

    def skip_prob(self, key: str) -> float:
        return min(self.max_prob, 1.0 - 0.5 ** self._streak.get(key, 0))

    def draw_skip(self, key: str) -> bool:
        return self._rng.random() < self.skip_prob(key)

    def record(self, key: str, solved: bool) -> None:
        self._streak[key] = self._streak.get(key, 0) + 1 if solved else 0


class InformativeGroupFilter:
    """The executor's `GroupFilter`: groups are judged on the executor's loop thread, items
    skipped on the trainer's, and the trainer reads the counters through `take_stats` once per
    step."""

    def __init__(
        self, batch_size: int, max_oversample: float, skip_max_prob: float = 0.0, seed: int = 0
    ):
        if max_oversample < 1:
            raise ValueError(f"max_oversample must be >= 1, got {max_oversample}")
        self.max_dropped = int(round((max_oversample - 1) * batch_size))
        self.history = PromptHistory(skip_max_prob, seed) if skip_max_prob > 0 else None
        self._lock = threading.Lock()
        self._generated = self._dropped = self._forced = self._skipped = self._solved = 0
        self._best_reward = float("-inf")  # the highest reward of any sample so far

    def should_start(self, data: Any) -> bool:
        """False for a prompt skipped on its history (never without `skip_max_prob`)."""
        if self.history is None:
            return True
        with self._lock:
            skip = self.history.draw_skip(prompt_key(data))
            self._skipped += skip
        return not skip

    def should_accept(self, data: Any, group: TensorDict) -> bool:
        informative, solved = self._judge(group)
        if self.history is not None:
            with self._lock:
                self.history.record(prompt_key(data), solved)
        return self._decide(informative, solved)

    def _judge(self, group: TensorDict) -> tuple[bool, bool]:
        """(informative, solved): solved = every sample at the best reward seen so far."""
        informative, rewards = is_informative(group), group["rewards"].float()
        with self._lock:
            self._best_reward = max(self._best_reward, rewards.max().item())
            solved = not informative and rewards.min().item() >= self._best_reward - REWARD_TOL
        return informative, solved

    def _decide(self, informative: bool, solved: bool) -> bool:
        with self._lock:
            self._generated += 1
            self._solved += solved
            if informative:
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
                # of the equal-reward groups, those all at the best reward (the rest all fail)
                "rollout/groups_all_solved": self._solved,
            }
            if self.history is not None:
                stats["rollout/groups_skipped"] = self._skipped
            self._generated = self._dropped = self._forced = self._skipped = self._solved = 0
        return stats
