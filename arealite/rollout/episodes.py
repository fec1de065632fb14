"""Episodes in flight and their outcomes: what the loop thread records and the trainer takes.

`EpisodeBook` keeps the counters, the finished results and the errors under one condition
variable, so the trainer's thread can wait on it while the loop thread records outcomes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from arealite.api.workflow_api import RolloutError, RolloutWorkflow
from arealite.rollout.replay import Cursor, DataloaderFeed

if TYPE_CHECKING:
    from arealite.api.engine_api import InferenceEngine

logger = logging.getLogger("arealite.rollout")

ACCEPT_RATE_EMA = 0.05  # weight of each finished episode in the acceptance-rate average


@dataclass
class RolloutStat:
    """Episode counters since the start of training (restored on recovery)."""

    submitted: int = 0  # handed to submit()
    running: int = 0  # started and not finished
    accepted: int = 0  # finished and accepted (consumed or not)
    rejected: int = 0  # finished as None or refused by should_accept
    failed: int = 0  # raised an exception
    surplus: int = 0  # accepted past the staleness bound (over-provisioning), dropped


class Group:
    """The episodes of one `rollout_batch` call: results come back to it, in input order."""

    def __init__(self, n: int):
        self.results: list[TensorDict | None] = [None] * n
        self.done = 0
        self.error: RolloutError | None = None


@dataclass
class Episode:
    data: Any
    workflow: RolloutWorkflow
    should_accept: Callable[[TensorDict], bool] | None
    group: Group | None = None
    index: int = 0
    cursor: Cursor | None = None  # where prepare_batch pulled it from
    start_version: int = 0  # policy version when it started (its staleness counts from here)


async def run_episode(ep: Episode, engine: InferenceEngine) -> TensorDict | None:
    """The episode, then its acceptance test; any exception is the episode's failure."""
    result = await ep.workflow.arun_episode(engine, ep.data)
    if result is not None and not isinstance(result, TensorDict):
        raise TypeError(
            f"arun_episode must return a TensorDict or None, got {type(result).__name__}"
        )
    if result is not None and ep.should_accept is not None and not ep.should_accept(result):
        return None
    return result


class EpisodeBook:
    """Counters, finished results (for wait) and errors, guarded by `cond`."""

    def __init__(
        self, feed: DataloaderFeed, within_bound: Callable[[int, int], bool] = lambda v, a: True
    ):
        self.feed = feed
        self.within_bound = within_bound  # (start version, accepted so far) -> may accept
        # Share of finished episodes should_accept took (moving average): admission counts
        # running episodes at this expected yield.
        self.accept_rate = 1.0
        self.cond = threading.Condition()
        self.stat = RolloutStat()
        self.results: deque[tuple[TensorDict, Episode]] = deque()
        self.errors: deque[RolloutError] = deque()

    def snapshot(self) -> dict[str, int]:
        with self.cond:
            return {**asdict(self.stat), "ready": len(self.results)}

    def take(self, count: int) -> tuple[list[TensorDict], list[Any]]:
        """Under `cond`: the oldest `count` results and their data items, now consumed."""
        taken = [self.results.popleft() for _ in range(count)]
        for _, ep in taken:
            self.feed.mark_done(ep.cursor)
        return [r for r, _ in taken], [ep.data for _, ep in taken]

    def on_started(self) -> None:
        with self.cond:
            self.stat.running += 1
            self.cond.notify_all()  # the input queue has room again

    def on_done(self, task: asyncio.Task, ep: Episode) -> None:
        """Record how `task` (the episode `ep`) ended and wake the waiters."""
        if task.cancelled():
            with self.cond:
                self.stat.running -= 1
                self.cond.notify_all()
            return
        error = task.exception()
        result = task.result() if error is None else None
        with self.cond:
            self.stat.running -= 1
            if error is not None:
                self.stat.failed += 1
                self._record_error(ep, RolloutError(ep.data, ep.workflow, error))
            elif result is None:
                self.stat.rejected += 1
                self._update_accept_rate(0.0)
                self._finish_in_group(ep)
            elif ep.group is None and not self.within_bound(ep.start_version, self.stat.accepted):
                self.stat.surplus += 1
                self._finish_in_group(ep)
            else:
                self._update_accept_rate(1.0)
                self.stat.accepted += 1
                if ep.group is not None:
                    ep.group.results[ep.index] = result
                    ep.group.done += 1
                else:
                    self.results.append((result, ep))
            self.cond.notify_all()

    def _update_accept_rate(self, accepted: float) -> None:
        self.accept_rate += ACCEPT_RATE_EMA * (accepted - self.accept_rate)

    def _finish_in_group(self, ep: Episode) -> None:
        """Under `cond`: a rejected or failed episode needs no replay; count it done."""
        self.feed.mark_done(ep.cursor)
        if ep.group is not None:
            ep.group.done += 1

    def _record_error(self, ep: Episode, err: RolloutError) -> None:
        logger.error("%s", err, exc_info=err.__cause__)
        self._finish_in_group(ep)
        if ep.group is not None:
            ep.group.error = ep.group.error or err
        else:
            self.errors.append(err)
