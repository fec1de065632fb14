"""The executor's loop thread: starts queued episodes while capacity allows, records outcomes.

`WorkflowExecutor` is the trainer-facing side (submit, wait, batches, state); `EpisodeLoop` is
the side that runs on its own asyncio thread. The two share only the input queue and the
`EpisodeBook` (whose condition variable guards the counters both threads touch).
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

from arealite.rollout.episodes import Episode, EpisodeBook, run_episode
from arealite.utils.loop_thread import LoopThread

if TYPE_CHECKING:
    from arealite.api.engine_api import InferenceEngine

logger = logging.getLogger("arealite.rollout")

POLL_S = 1.0  # fallback wake-up of the loop and of waiting callers


class EpisodeLoop:
    """Takes episodes off `input` as `capacity()` allows (none while `paused()`) and runs them.

    `capacity` and `paused` are the executor's: the admission rule stays with the staleness
    accounting, while the loop only decides when to ask (on `notify`, on a finished episode,
    and every POLL_S). A crash of the loop is kept in `error` and raised to the callers.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        book: EpisodeBook,
        queue_size: int,
        capacity: Callable[[], int],
        paused: Callable[[], bool],
    ):
        self.engine = engine
        self.book = book
        self.queue_size = queue_size
        self.input: queue.Queue[Episode] = queue.Queue(maxsize=queue_size)
        self._capacity = capacity
        self._paused = paused
        self._tasks: set[asyncio.Task] = set()  # the loop holds tasks weakly
        self._loop = LoopThread("arealite-rollout")
        self._wakeup: asyncio.Event | None = None
        self.exiting = False
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ from other threads

    @property
    def started(self) -> bool:
        return self._loop.loop is not None

    @property
    def running(self) -> bool:
        return self._loop.running and not self.exiting and self.error is None

    def start(self) -> None:
        self._loop.start()
        self._loop.run(self._schedule()).add_done_callback(self._on_exit)

    def stop(self, timeout: float) -> None:
        """Cancel every running episode, stop the loop and join its thread; wake the waiters."""
        with self.book.cond:
            self.exiting = True
            self.book.cond.notify_all()
        self._loop.stop(timeout)
        with self.book.cond:
            self.book.cond.notify_all()

    def notify(self) -> None:
        """Re-evaluate capacity now."""
        ev = self._wakeup
        if ev is not None:
            self._loop.call_soon(ev.set)

    def submit(self, ep: Episode) -> None:
        """Queue `ep` to start when capacity allows; `queue.Full` when the input queue is."""
        try:
            self.input.put_nowait(ep)
        except queue.Full:
            raise queue.Full(
                f"rollout input queue is full ({self.queue_size} episodes waiting to start); "
                "raise rollout.queue_size or collect results with wait() first"
            ) from None
        with self.book.cond:
            self.book.stat.submitted += 1
        self.notify()

    def check_alive(self) -> None:
        """Raise unless episodes can be submitted (loop started, not crashed nor destroyed)."""
        if self.error is not None:
            raise RuntimeError("rollout loop crashed") from self.error
        if not self.running:
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first")

    def raise_if_stopped(self) -> None:
        """Raise if the loop crashed or was destroyed (nothing waited for will ever arrive)."""
        if self.error is not None:
            raise RuntimeError("rollout loop crashed") from self.error
        if self.exiting:
            raise RuntimeError("WorkflowExecutor was destroyed while waiting")

    # ------------------------------------------------------------------ on the loop thread

    def _on_exit(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:  # surfaced to wait()/submit()
            logger.error("rollout loop crashed", exc_info=fut.exception())
            self.error = fut.exception()
        with self.book.cond:
            self.book.cond.notify_all()

    async def _schedule(self) -> None:
        self._wakeup = asyncio.Event()
        while not self.exiting:
            self._wakeup.clear()
            self._start_admissible()
            try:
                await asyncio.wait_for(self._wakeup.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    def _start_admissible(self) -> None:
        if self._paused():
            return
        n = self._capacity()
        while n > 0:
            try:
                ep = self.input.get_nowait()
            except queue.Empty:
                return
            ep.start_version = self.engine.get_version()
            task = asyncio.ensure_future(run_episode(ep, self.engine))
            self.book.on_started()
            self._tasks.add(task)
            task.add_done_callback(lambda t, ep=ep: self._on_done(t, ep))
            n -= 1

    def _on_done(self, task: asyncio.Task, ep: Episode) -> None:
        self._tasks.discard(task)
        self.book.on_done(task, ep)
        if self._wakeup is not None:
            self._wakeup.set()  # a slot is free
