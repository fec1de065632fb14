"""Admission: which episodes may start now, and what became of those that ran, under one lock.

The trainer's thread submits episodes and waits for results; the executor's loop thread
(`EpisodeLoop`, episode_loop.py) starts what `take_startable` allows and reports each outcome
to `on_done`. Everything both threads touch lives here, behind one condition variable: the
episodes waiting to start, the counters (`RolloutStat`), the finished results and errors, the
pause flag, the measured acceptance rate, and the staleness rule (`StalenessController`,
staleness.py) that turns them into how many episodes may start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from tensordict import TensorDict

from arealite.api.workflow_api import RolloutError
from arealite.rollout.episodes import BatchCall, Episode, RolloutStat
from arealite.rollout.replay import DataloaderFeed
from arealite.rollout.staleness import StalenessController

logger = logging.getLogger("arealite.rollout")

POLL_S = 1.0  # fallback wake-up of the loop and of waiting callers
ACCEPT_RATE_EMA = 0.05  # weight of each finished episode in the acceptance-rate average


class Admission:
    """The rollout's one lock and what it guards. `version()` is the current policy version
    (the staleness bound counts from it); `queue_size` bounds both the episodes waiting to
    start and the results buffered for the trainer."""

    def __init__(
        self,
        staleness: StalenessController,
        feed: DataloaderFeed,
        queue_size: int,
        version: Callable[[], int],
    ):
        self.staleness = staleness
        self.feed = feed
        self.queue_size = queue_size
        self.version = version
        self._cond = threading.Condition()
        self._stat = RolloutStat()
        self._waiting: deque[Episode] = deque()  # submitted, not started
        self._results: deque[tuple[TensorDict, Episode]] = deque()
        # start version -> episodes running since it: the staleness budget counts from the oldest
        self._running_since: Counter[int] = Counter()
        self._errors: deque[RolloutError] = deque()
        self._paused = False
        # Share of finished episodes should_accept took (moving average): admission counts
        # running episodes at this expected yield.
        self._accept_rate = 1.0
        self._closed: tuple[str, BaseException | None] | None = None  # why nothing more comes

    # ------------------------------------------------------------------ the trainer's side

    def set_world_size(self, world_size: int) -> None:
        """The staleness budget is split over `world_size` trainer ranks."""
        self.staleness = dataclasses.replace(self.staleness, world_size=world_size)

    def submit(self, ep: Episode) -> None:
        """Queue `ep` to start; `queue.Full` when `queue_size` episodes already wait."""
        with self._cond:
            if len(self._waiting) >= self.queue_size:
                raise queue.Full(
                    f"rollout input queue is full ({self.queue_size} episodes waiting to start); "
                    "raise rollout.queue_size or collect results with wait() first"
                )
            self._waiting.append(ep)
            self._stat.submitted += 1

    def queued(self) -> int:
        """Episodes submitted and not started."""
        with self._cond:
            return len(self._waiting)

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def capacity(self) -> int:
        """How many more episodes may start now (may be <= 0): the staleness rule, and never
        one whose result could not be buffered."""
        v = self.version()
        with self._cond:
            return self._capacity(v)

    def _capacity(self, v: int) -> int:
        s = self._stat
        oldest = min(self._running_since) if self._running_since else None
        allowed = self.staleness.capacity(v, s.running, s.accepted, self._accept_rate, oldest)
        return min(allowed, self.queue_size - len(self._results) - s.running)

    def take(
        self, count: int, timeout: float | None, refill_below: int | None = None
    ) -> tuple[list[TensorDict], list[Any]] | None:
        """Block until `count` accepted results are buffered; take them (oldest first) with
        their data items. With `refill_below`, None as soon as fewer episodes than that wait
        to start. Raises the first episode failure, TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._errors:
                    raise self._errors.popleft()
                if len(self._results) >= count:
                    taken = [self._results.popleft() for _ in range(count)]
                    for _, ep in taken:
                        self.feed.mark_done(ep.cursor)
                    return [r for r, _ in taken], [ep.data for _, ep in taken]
                if refill_below is not None and len(self._waiting) < refill_below:
                    return None
                self._raise_if_closed()
                remaining = POLL_S if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"wait({count}): only {len(self._results)} accepted episodes after "
                        f"{timeout}s ({self._describe()})"
                    )
                self._cond.wait(min(remaining, POLL_S))

    def wait_batch_call(self, call: BatchCall) -> bool:
        """Whether every episode of `call` has finished, waiting up to POLL_S seconds (or the
        next outcome) for it; raises the call's first failure."""
        with self._cond:
            if not self._call_done(call):
                self._raise_if_closed()
                self._cond.wait(POLL_S)
            return self._call_done(call)

    def _call_done(self, call: BatchCall) -> bool:
        if call.error is not None:
            raise call.error
        return call.done == len(call.results)

    def close(self, reason: str, cause: BaseException | None = None) -> None:
        """Nothing more will finish (the loop stopped or crashed): wake the waiters, which
        raise RuntimeError(reason). The first reason stays."""
        with self._cond:
            self._closed = self._closed or (reason, cause)
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            reason, cause = self._closed
            raise RuntimeError(reason) from cause

    def _describe(self) -> str:
        s = self._stat
        return (
            f"running={s.running}, queued={len(self._waiting)}, accepted={s.accepted}, "
            f"rejected={s.rejected}, failed={s.failed}, version={self.version()}, "
            f"paused={self._paused}"
        )

    def snapshot(self) -> dict[str, int]:
        """The counters, the results ready and the episodes queued to start."""
        with self._cond:
            ready, queued = len(self._results), len(self._waiting)
            return {**dataclasses.asdict(self._stat), "ready": ready, "queued": queued}

    def state_dict(self) -> dict[str, Any]:
        """The counters as if the episodes not yet consumed had never started (recovery
        replays them), and the replay's own state."""
        with self._cond:
            s = self._stat
            return {
                "submitted": s.submitted - self.feed.pending(),
                "accepted": s.accepted - len(self._results),
                "rejected": s.rejected,
                "failed": s.failed,
                **self.feed.state_dict(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            for k in ("submitted", "accepted", "rejected", "failed"):
                setattr(self._stat, k, int(state.get(k, 0)))
            self.feed.load_state_dict(state)

    # ------------------------------------------------------------------ the loop's side

    def take_startable(self) -> list[Episode]:
        """The waiting episodes that may start now (none while paused), counted as running
        and stamped with the version they start at."""
        v = self.version()
        with self._cond:
            if self._paused:
                return []
            n = min(self._capacity(v), len(self._waiting))
            started = [self._waiting.popleft() for _ in range(max(0, n))]
            for ep in started:
                ep.start_version = v
            self._stat.running += len(started)
            if started:
                self._running_since[v] += len(started)
                self._cond.notify_all()  # the input queue has room again
        return started

    def on_done(self, task: asyncio.Task, ep: Episode) -> None:
        """Record how `task` (the episode `ep`) ended and wake the waiters."""
        if task.cancelled():
            with self._cond:
                self._stop_running(ep)
                self._cond.notify_all()
            return
        error = task.exception()
        result = task.result() if error is None else None
        with self._cond:
            self._stop_running(ep)
            if error is not None:
                self._stat.failed += 1
                self._record_error(ep, RolloutError(ep.data, ep.workflow, error))
            elif result is None:
                self._stat.rejected += 1
                self._update_accept_rate(0.0)
                self._finish_in_call(ep)
            elif ep.batch_call is None and not self._within_bound(ep):
                self._stat.surplus += 1
                self._finish_in_call(ep)
            else:
                self._update_accept_rate(1.0)
                self._stat.accepted += 1
                if ep.batch_call is not None:
                    ep.batch_call.results[ep.index] = result
                    ep.batch_call.done += 1
                else:
                    self._results.append((result, ep))
            self._cond.notify_all()

    def _stop_running(self, ep: Episode) -> None:
        self._stat.running -= 1
        self._running_since[ep.start_version] -= 1
        if not self._running_since[ep.start_version]:
            del self._running_since[ep.start_version]

    def _within_bound(self, ep: Episode) -> bool:
        return self.staleness.within_bound(ep.start_version, self._stat.accepted)

    def _update_accept_rate(self, accepted: float) -> None:
        self._accept_rate += ACCEPT_RATE_EMA * (accepted - self._accept_rate)

    def _finish_in_call(self, ep: Episode) -> None:
        """A rejected or failed episode needs no replay; count it done."""
        self.feed.mark_done(ep.cursor)
        if ep.batch_call is not None:
            ep.batch_call.done += 1

    def _record_error(self, ep: Episode, err: RolloutError) -> None:
        logger.error("%s", err, exc_info=err.__cause__)
        self._finish_in_call(ep)
        if ep.batch_call is not None:
            ep.batch_call.error = ep.batch_call.error or err
        else:
            self._errors.append(err)
