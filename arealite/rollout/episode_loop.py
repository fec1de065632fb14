"""The executor's loop thread: starts the episodes `Admission` allows, reports their outcomes.

`WorkflowExecutor` is the trainer-facing side (submit, wait, batches, state); `EpisodeLoop` is
the side that runs on its own asyncio thread. The two share only the `Admission`
(admission.py), which holds the one lock over what both threads touch.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from arealite.rollout.admission import POLL_S, Admission
from arealite.rollout.episodes import Episode, run_episode
from arealite.utils.loop_thread import LoopThread

if TYPE_CHECKING:
    from arealite.api.engine_api import InferenceEngine

logger = logging.getLogger("arealite.rollout")


class EpisodeLoop:
    """Starts the episodes `admission.take_startable()` hands it and runs them on `engine`.

    The admission rule stays with the staleness accounting; the loop only decides when to
    ask (on `notify`, on a finished episode, and every POLL_S). A crash of the loop closes the
    admission, so waiting callers raise it.
    """

    def __init__(self, engine: InferenceEngine, admission: Admission):
        self.engine = engine
        self.admission = admission
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
        self.exiting = True
        self.admission.close("WorkflowExecutor was destroyed while waiting")
        self._loop.stop(timeout)

    def notify(self) -> None:
        """Re-evaluate capacity now."""
        ev = self._wakeup
        if ev is not None:
            self._loop.call_soon(ev.set)

    def check_alive(self) -> None:
        """Raise unless episodes can be submitted (loop started, not crashed nor destroyed)."""
        if self.error is not None:
            raise RuntimeError("rollout loop crashed") from self.error
        if not self.running:
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first")

    # ------------------------------------------------------------------ on the loop thread

    def _on_exit(self, fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:  # surfaced to wait()/submit()
            logger.error("rollout loop crashed", exc_info=fut.exception())
            self.error = fut.exception()
            self.admission.close("rollout loop crashed", self.error)

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
        for ep in self.admission.take_startable():
            task = asyncio.ensure_future(run_episode(ep, self.engine))
            self._tasks.add(task)
            task.add_done_callback(lambda t, ep=ep: self._on_done(t, ep))

    def _on_done(self, task: asyncio.Task, ep: Episode) -> None:
        self._tasks.discard(task)
        self.admission.on_done(task, ep)
        if self._wakeup is not None:
            self._wakeup.set()  # a slot is free
