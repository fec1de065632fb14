"""WorkflowExecutor: runs rollout episodes in the background under the staleness bound.

Built by the training script on an inference engine:

    executor = WorkflowExecutor(config.rollout, engine)
    executor.initialize(train_data_parallel_size=world)
    batch = executor.prepare_batch(train_loader, workflow)   # async, staleness-bounded
    executor.pause(); ...update weights...; executor.set_version(v); executor.resume()

Episodes run on the executor's own asyncio loop thread (`EpisodeLoop`, episode_loop.py), so the
trainer's thread only submits data and collects finished batches. What may start, and what
finished, is the `Admission`'s (admission.py: one lock, the staleness rule of staleness.py);
recovery replays pulled-but-untrained dataloader items (replay.py).
"""

from __future__ import annotations

import functools
import logging
import queue
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from arealite.api.workflow_api import GroupFilter, RolloutWorkflow
from arealite.rollout.admission import Admission
from arealite.rollout.episode_loop import EpisodeLoop
from arealite.rollout.episodes import BatchCall, Episode
from arealite.rollout.replay import DataloaderFeed
from arealite.rollout.staleness import StalenessController
from arealite.utils.data import concat_padded_tensors

if TYPE_CHECKING:
    from arealite.api.cli_args import RolloutConfig
    from arealite.api.engine_api import InferenceEngine

logger = logging.getLogger("arealite.rollout")


class WorkflowExecutor:
    """Runs `RolloutWorkflow` episodes on a background asyncio loop under the staleness bound.

    Thread-safe: `submit`, `wait`, `rollout_batch`, `prepare_batch`, `pause` and `resume` may be
    called from any thread other than the loop's. The engine's `get_version()` is read for every
    admission decision; change it with `set_version` here (which also wakes the loop).
    """

    def __init__(self, config: RolloutConfig, engine: InferenceEngine):
        self.config = config
        self.engine = engine
        self.max_concurrent = config.max_concurrent_rollouts or config.consumer_batch_size or 1
        self.queue_size = config.queue_size or 4 * self.max_concurrent
        if self.queue_size < 1:
            raise ValueError(f"rollout.queue_size must be >= 1, got {self.queue_size}")
        staleness = StalenessController(
            self.max_concurrent, config.consumer_batch_size, config.max_head_offpolicyness
        )
        self.feed = DataloaderFeed()
        self.admission = Admission(staleness, self.feed, self.queue_size, engine.get_version)
        self._runner = EpisodeLoop(engine, self.admission)

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, train_data_parallel_size: int = 1) -> None:
        """Start the loop thread; the capacity is split over `train_data_parallel_size` ranks."""
        if train_data_parallel_size < 1:
            raise ValueError(
                f"train_data_parallel_size must be >= 1, got {train_data_parallel_size}"
            )
        if self._runner.started:
            raise RuntimeError("WorkflowExecutor.initialize() called twice")
        self.admission.set_world_size(train_data_parallel_size)
        self._runner.start()

    def destroy(self, timeout: float = 30.0) -> None:
        """Cancel every running episode, stop the loop and join its thread."""
        self._runner.stop(timeout)

    @property
    def running(self) -> bool:
        return self._runner.running

    def notify(self) -> None:
        """Re-evaluate capacity now (version changed, resumed, results consumed, ...)."""
        self._runner.notify()

    # ------------------------------------------------------------------ versions and capacity

    def set_version(self, version: int) -> None:
        """Set the engine's policy version (the staleness bound counts from it) and re-admit."""
        self.engine.set_version(version)
        self.notify()

    def get_version(self) -> int:
        return self.engine.get_version()

    def get_capacity(self) -> int:
        """How many more episodes may start now (may be <= 0)."""
        return self.admission.capacity()

    # ------------------------------------------------------------------ submission

    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> None:
        """Queue one episode (non-blocking). Raises `queue.Full` when `queue_size` episodes are
        already waiting to start (raise rollout.queue_size or wait() first)."""
        self._submit(Episode(data, workflow, should_accept))

    def _submit(self, ep: Episode) -> None:
        self._runner.check_alive()
        if not isinstance(ep.workflow, RolloutWorkflow):
            raise TypeError(f"workflow must be a RolloutWorkflow, got {type(ep.workflow).__name__}")
        self.admission.submit(ep)
        self.notify()

    # ------------------------------------------------------------------ collection

    def wait(self, count: int, timeout: float | None = None) -> TensorDict:
        """Block until `count` accepted episodes are ready; return them concatenated (in
        completion order). Raises RolloutError if an episode failed, TimeoutError on timeout."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > self.queue_size:
            raise ValueError(
                f"wait({count}) can never complete: at most rollout.queue_size={self.queue_size} "
                "results are buffered"
            )
        return self._await_results(count, timeout)[0]

    def _await_results(
        self, count: int, timeout: float | None, refill_below: int | None = None
    ) -> tuple[TensorDict, list[Any]] | None:
        """wait()'s body, with the episodes' data items; with `refill_below`, None as soon as
        fewer episodes than that are queued to start, so the caller tops the queue up at once
        (dynamic sampling refuses groups quickly and each refusal starts a queued item)."""
        out = self.admission.take(count, timeout, refill_below)
        if out is None:
            return None
        self.notify()  # room in the output buffer may admit new episodes
        return concat_padded_tensors(out[0]), out[1]

    def rollout_batch(
        self,
        data: Iterable[dict[str, Any]],
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
        return_data: bool = False,
    ) -> TensorDict | tuple[TensorDict, list[Any]]:
        """Run one episode per item and wait for all of them; returns the accepted ones in input
        order (and their items with `return_data`). Rejected episodes are left out; the first
        failure raises RolloutError."""
        items = list(data)
        call = BatchCall(len(items))
        pending = deque(
            Episode(d, workflow, should_accept, batch_call=call, index=i)
            for i, d in enumerate(items)
        )
        while True:
            while pending:
                try:
                    self._submit(pending[0])
                except queue.Full:
                    break
                pending.popleft()
            if self.admission.wait_batch_call(call):
                break
        batch = concat_padded_tensors([r for r in call.results if r is not None])
        kept = [d for d, r in zip(items, call.results) if r is not None]
        return (batch, kept) if return_data else batch

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: RolloutWorkflow,
        group_filter: GroupFilter | None = None,
        return_data: bool = False,
    ) -> TensorDict | tuple[TensorDict, list[Any]]:
        """Asynchronous rollout: keep at least one dataloader batch queued ahead of the running
        episodes (so generation never waits for the trainer), and return the next
        `dataloader.batch_size` accepted episodes (and their items with `return_data`),
        restarting the dataloader at epoch end. `group_filter` decides which items start
        (those it skips are done for recovery and replaced by the next ones) and which
        finished groups are accepted."""
        batch_size = getattr(dataloader, "batch_size", None)
        if not batch_size:
            raise ValueError("prepare_batch needs a dataloader with a batch_size")
        if 2 * batch_size > self.queue_size:
            raise ValueError(
                f"rollout.queue_size={self.queue_size} must hold two dataloader batches "
                f"(2 x {batch_size})"
            )
        while True:
            while self.admission.queued() < batch_size:  # (a replayed batch may be all done)
                for cursor, item in self.feed.next_batch(dataloader):
                    if group_filter is not None and not group_filter.should_start(item):
                        self.feed.mark_done(cursor)
                        continue
                    accept = None
                    if group_filter is not None:
                        accept = functools.partial(group_filter.should_accept, item)
                    self._submit(Episode(item, workflow, accept, cursor=cursor))
            out = self._await_results(batch_size, timeout=None, refill_below=batch_size)
            if out is not None:
                return out if return_data else out[0]

    # ------------------------------------------------------------------ control and state

    def pause(self) -> None:
        """Stop starting new episodes; running ones continue (e.g. around a weight update)."""
        self.admission.pause()

    def resume(self) -> None:
        self.admission.resume()
        self.notify()

    @property
    def paused(self) -> bool:
        return self.admission.paused

    def stats(self) -> dict[str, int]:
        """Counters for logging: submitted, running, accepted, rejected, failed, queued, ready."""
        return self.admission.snapshot()

    def state_dict(self) -> dict[str, Any]:
        """What recovery must restore: the staleness counters as if the episodes not yet
        consumed had never started (they are replayed), and where prepare_batch's replay
        starts (`position`: None = the dataloader's own state) with the done items after it."""
        return self.admission.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and the replay of pulled-but-unconsumed items (episodes running
        at save time are lost; running = 0). Call before the first prepare_batch."""
        self.admission.load_state_dict(state)
        self.notify()
