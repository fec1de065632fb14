"""The staleness rule of asynchronous RL: how many new episodes may start now.

A pure function of counters, so it is tested alone; the executor calls it on every admission.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# At most 1 / MIN_ACCEPT_RATE times the batch still needed runs at once (dynamic sampling's
# default cap, 3x over-sampling, keeps the measured rate above this anyway).
MIN_ACCEPT_RATE = 0.25


@dataclass(frozen=True)
class StalenessController:
    """Bounds how far rollouts run ahead of training (docs/design.md, "Asynchrony and staleness").

    With C = max_concurrent_rollouts, B = consumer_batch_size, eta = max_head_offpolicyness,
    v = the current policy version and W = the trainer's data-parallel size (each rank runs its
    own executor with 1/W of the budget), the number of episodes that may start now is

        capacity = min(C/W - running, (eta + o + 1) * B/W - (accepted + running))

    where o is the start version of the oldest episode still running (v when none runs).
    `accepted` counts every accepted episode since the start (consumed or not). Episodes finish
    out of order - a long answer started at version o can still run when shorter ones started
    later have been trained on - and each accepted one is trained in the next batch, so counting
    from v would let later starts push an old episode past eta versions (it would then be
    dropped, with all its tokens; the long tail of answers is what would go). Counting from o
    keeps (accepted + running) <= (eta + o + 1) batches, so whichever episode finishes next is
    trained at most eta versions after it started, and none is dropped. eta = 0 is synchronous
    RL. Rejected and failed episodes are not counted, so they free their slot. C/W and B/W
    are at least 1.

    When a `should_accept` refuses many episodes (dynamic sampling late in a run refuses most
    groups), starting only as many as the batch still needs makes a chain of small waves, each
    waiting for the last one's refusals. With the measured acceptance rate p < 1, running
    episodes count at their expected yield p, so enough start at once; an accepted result past
    the bound is then refused as surplus (`within_bound`), which keeps the bound exact.
    """

    max_concurrent_rollouts: int
    consumer_batch_size: int
    max_head_offpolicyness: int
    world_size: int = 1

    def __post_init__(self):
        if self.consumer_batch_size is None:
            raise ValueError(
                "rollout.consumer_batch_size is unset: set it to the prompts per training batch "
                "(an experiment config derives it from train_dataset.batch_size)"
            )
        for name in ("max_concurrent_rollouts", "consumer_batch_size", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_head_offpolicyness < 0:
            raise ValueError(
                f"max_head_offpolicyness must be >= 0, got {self.max_head_offpolicyness}"
            )

    @property
    def per_rank_batch(self) -> int:
        return max(1, self.consumer_batch_size // self.world_size)

    def capacity(
        self,
        version: int,
        running: int,
        accepted: int,
        accept_rate: float = 1.0,
        oldest_running: int | None = None,
    ) -> int:
        """How many more episodes may start at policy `version` (may be <= 0), while the oldest
        running episode started at `oldest_running` (None: none runs)."""
        per_rank_concurrency = max(1, self.max_concurrent_rollouts // self.world_size)
        by_concurrency = per_rank_concurrency - running
        oldest = version if oldest_running is None else min(version, oldest_running)
        budget = (self.max_head_offpolicyness + oldest + 1) * self.per_rank_batch
        p = min(1.0, max(MIN_ACCEPT_RATE, accept_rate))
        by_staleness = math.floor((budget - accepted) / p + 1e-9) - running
        return min(by_concurrency, by_staleness)

    def within_bound(self, start_version: int, accepted: int) -> bool:
        """Whether one more accepted episode, started at `start_version`, keeps the bound: as
        the (accepted + 1)-th it is trained in batch ceil((accepted + 1) / B) - 1, at most eta
        versions after it started. Always true when accept_rate is 1."""
        return (
            accepted + 1 <= (self.max_head_offpolicyness + start_version + 1) * self.per_rank_batch
        )
