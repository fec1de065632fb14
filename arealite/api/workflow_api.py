"""Rollout workflows (how one data item becomes trajectories) and the executor that runs them.

`WorkflowExecutor` runs episodes in an asyncio loop on a background thread, so the trainer's
thread only submits data and collects finished batches. How many episodes may start is bounded
by the staleness rule of DESIGN.md ("Asynchrony and staleness"):

    capacity = min(C/W - running, (eta + v + 1) * B/W - (accepted + running))

with C = max_concurrent_rollouts, B = consumer_batch_size, eta = max_head_offpolicyness, v = the
engine's current version and W = the trainer's data-parallel size. `accepted` counts every
accepted episode since the start (consumed or not), so at version v no more than (eta + v + 1)
batches' worth of episodes have ever been started: a trajectory is at most eta versions stale.

Recovery: `prepare_batch` pulls dataloader batches ahead of the trainer, so at a checkpoint some
pulled items are queued, running or finished but not yet trained on. `state_dict` records the
dataloader position before the oldest such batch and which of its items (and of the later
batches) are done; after `load_state_dict` the executor replays from there, skipping the done
items: no item is trained twice or skipped.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from arealite.utils.data import concat_padded_tensors

if TYPE_CHECKING:
    from arealite.api.cli_args import InferenceEngineConfig
    from arealite.api.engine_api import InferenceEngine

logger = logging.getLogger("arealite.rollout")


class RolloutWorkflow(abc.ABC):
    """One episode of interaction between a policy (through an InferenceEngine) and a task."""

    @abc.abstractmethod
    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TensorDict | None:
        """Run one episode on `data` and return its trajectories as a padded TensorDict
        `[n, L]` (input_ids, attention_mask, loss_mask, logprobs, versions, rewards, ...),
        or None to reject the episode (its slot is freed and it is counted as rejected)."""


class RolloutError(RuntimeError):
    """A workflow (or its `should_accept`) raised on one data item.

    Carries the item so the caller can log or skip it; the original exception is `__cause__`.
    """

    def __init__(self, data: Any, workflow: Any, cause: BaseException):
        text = repr(data)
        text = text if len(text) <= 300 else text[:300] + "...}"
        super().__init__(
            f"{type(workflow).__name__}.arun_episode failed on data item {text}: "
            f"{type(cause).__name__}: {cause}"
        )
        self.data = data
        self.workflow = workflow
        self.__cause__ = cause


@dataclass
class RolloutStat:
    """Episode counters since the start of training (restored on recovery)."""

    submitted: int = 0  # handed to submit()
    running: int = 0  # started and not finished
    accepted: int = 0  # finished and accepted (consumed or not)
    rejected: int = 0  # finished as None or refused by should_accept
    failed: int = 0  # raised an exception


@dataclass
class _Episode:
    data: Any
    workflow: RolloutWorkflow
    should_accept: Callable[[TensorDict], bool] | None
    group: _Group | None = None
    index: int = 0
    cursor: tuple[int, int] | None = None  # (pulled batch number, index in it): prepare_batch


@dataclass
class _PulledBatch:
    """A dataloader batch pulled by prepare_batch whose items are not all done yet."""

    position: Any  # dataloader.state_dict() just before it was pulled
    size: int
    done: set[int]  # indices trained on (results consumed), rejected or failed


class _Group:
    """The episodes of one `rollout_batch` call: results come back to it, in input order."""

    def __init__(self, n: int):
        self.results: list[TensorDict | None] = [None] * n
        self.done = 0
        self.error: RolloutError | None = None


POLL_S = 1.0  # fallback wake-up of the loop and of waiting callers


class WorkflowExecutor:
    """Runs `RolloutWorkflow` episodes on a background asyncio loop under the staleness bound.

    Thread-safe: `submit`, `wait`, `rollout_batch`, `prepare_batch`, `pause` and `resume` may be
    called from any thread other than the loop's. The engine's `get_version()` is read for every
    admission decision; call `notify()` after changing it (engines do this in `set_version`).
    """

    def __init__(self, config: InferenceEngineConfig, engine: InferenceEngine):
        self.config = config
        self.engine = engine
        self.max_concurrent = config.max_concurrent_rollouts or config.consumer_batch_size
        self.queue_size = config.queue_size or 4 * self.max_concurrent
        if self.queue_size < 1:
            raise ValueError(f"rollout.queue_size must be >= 1, got {self.queue_size}")
        self.world_size = 1
        self.stat = RolloutStat()
        self._input: queue.Queue[_Episode] = queue.Queue(maxsize=self.queue_size)
        self._results: deque[tuple[TensorDict, _Episode]] = deque()
        self._errors: deque[RolloutError] = deque()
        self._cond = threading.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._paused = False
        self._exiting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._loop_error: BaseException | None = None
        self._data_iter: Any = None
        self._dataloader: Any = None
        self._pulled: dict[int, _PulledBatch] = {}  # by batch number, oldest first
        self._n_pulled = 0
        self._replay: dict[str, Any] | None = None  # from load_state_dict, used at next pull
        self._replay_done: list[set[int]] = []  # done indices of the batches being replayed
        # Data items of the episodes the last wait() / rollout_batch() returned, in order.
        self.last_batch_data: list[Any] = []
        self._shutdown_hooks: list[Callable[[], Awaitable[Any]]] = []

    # ------------------------------------------------------------------ lifecycle

    def initialize(self, train_data_parallel_size: int = 1) -> None:
        """Start the loop thread; the capacity is split over `train_data_parallel_size` ranks."""
        if train_data_parallel_size < 1:
            raise ValueError(
                f"train_data_parallel_size must be >= 1, got {train_data_parallel_size}"
            )
        if self._thread is not None:
            raise RuntimeError("WorkflowExecutor.initialize() called twice")
        self.world_size = train_data_parallel_size
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run_loop, args=(ready,), name="arealite-rollout", daemon=True
        )
        self._thread.start()
        ready.wait()

    def destroy(self, timeout: float = 30.0) -> None:
        """Cancel every running episode, stop the loop and join its thread."""
        with self._cond:
            self._exiting = True
            self._cond.notify_all()
        self.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("rollout thread did not stop within %.0fs", timeout)

    def add_shutdown_hook(self, hook: Callable[[], Awaitable[Any]]) -> None:
        """`await hook()` on the loop at destroy, after every episode has been cancelled (e.g.
        close the engine's HTTP session only once nothing uses it)."""
        self._shutdown_hooks.append(hook)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._loop.is_closed():
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first")
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._exiting

    def run_coroutine(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the rollout loop (where the engine's HTTP session lives)."""
        if not self.running:
            coro.close()
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def notify(self) -> None:
        """Re-evaluate capacity now (version changed, resumed, results consumed, ...)."""
        loop, ev = self._loop, self._wakeup
        if loop is not None and ev is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # ------------------------------------------------------------------ capacity

    def get_capacity(self) -> int:
        """How many more episodes may start now (may be <= 0)."""
        w = self.world_size
        c = max(1, self.max_concurrent // w)
        b = max(1, self.config.consumer_batch_size // w)
        eta = self.config.max_head_offpolicyness
        v = self.engine.get_version()
        with self._cond:
            s = self.stat
            by_concurrency = c - s.running
            by_staleness = (eta + v + 1) * b - (s.accepted + s.running)
            # Never start an episode whose result could not be buffered (bounded output).
            by_buffer = self.queue_size - len(self._results) - s.running
        return min(by_concurrency, by_staleness, by_buffer)

    # ------------------------------------------------------------------ submission

    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> None:
        """Queue one episode (non-blocking). Raises `queue.Full` when `queue_size` episodes are
        already waiting to start (raise rollout.queue_size or wait() first)."""
        self._submit(_Episode(data, workflow, should_accept))

    def _submit(self, ep: _Episode) -> None:
        self._check_alive()
        if not isinstance(ep.workflow, RolloutWorkflow):
            raise TypeError(f"workflow must be a RolloutWorkflow, got {type(ep.workflow).__name__}")
        try:
            self._input.put_nowait(ep)
        except queue.Full:
            raise queue.Full(
                f"rollout input queue is full ({self.queue_size} episodes waiting to start); "
                "raise rollout.queue_size or collect results with wait() first"
            ) from None
        with self._cond:
            self.stat.submitted += 1
        self.notify()

    def _check_alive(self) -> None:
        if self._loop_error is not None:
            raise RuntimeError("rollout loop crashed") from self._loop_error
        if not self.running:
            raise RuntimeError("WorkflowExecutor is not running; call initialize() first")

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
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._errors:
                    raise self._errors.popleft()
                if len(self._results) >= count:
                    taken = [self._results.popleft() for _ in range(count)]
                    for _, ep in taken:
                        self._mark_done(ep)
                    out = [r for r, _ in taken]
                    self.last_batch_data = [ep.data for _, ep in taken]
                    break
                self._raise_if_stopped()
                remaining = POLL_S if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"wait({count}): only {len(self._results)} accepted episodes after "
                        f"{timeout}s ({self._describe()})"
                    )
                self._cond.wait(min(remaining, POLL_S))
        self.notify()  # room in the output buffer may admit new episodes
        return concat_padded_tensors(out)

    def _raise_if_stopped(self) -> None:
        if self._loop_error is not None:
            raise RuntimeError("rollout loop crashed") from self._loop_error
        if self._exiting:
            raise RuntimeError("WorkflowExecutor was destroyed while waiting")

    def _describe(self) -> str:
        s = self.stat
        return (
            f"running={s.running}, queued={self._input.qsize()}, accepted={s.accepted}, "
            f"rejected={s.rejected}, failed={s.failed}, version={self.engine.get_version()}, "
            f"paused={self._paused}"
        )

    def rollout_batch(
        self,
        data: Iterable[dict[str, Any]],
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> TensorDict:
        """Run one episode per item and wait for all of them; returns the accepted ones in input
        order. Rejected episodes are left out; the first failure raises RolloutError."""
        items = list(data)
        group = _Group(len(items))
        pending = deque(
            _Episode(d, workflow, should_accept, group=group, index=i) for i, d in enumerate(items)
        )
        while True:
            while pending:
                try:
                    self._submit(pending[0])
                except queue.Full:
                    break
                pending.popleft()
            with self._cond:
                if group.error is not None:
                    raise group.error
                if group.done == len(items):
                    break
                self._raise_if_stopped()
                self._cond.wait(POLL_S)
        self.last_batch_data = [d for d, r in zip(items, group.results) if r is not None]
        return concat_padded_tensors([r for r in group.results if r is not None])

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> TensorDict:
        """Asynchronous rollout: keep at least one dataloader batch queued ahead of the running
        episodes (so generation never waits for the trainer), and return the next
        `dataloader.batch_size` accepted episodes. Restarts the dataloader at epoch end."""
        batch_size = getattr(dataloader, "batch_size", None)
        if not batch_size:
            raise ValueError("prepare_batch needs a dataloader with a batch_size")
        if 2 * batch_size > self.queue_size:
            raise ValueError(
                f"rollout.queue_size={self.queue_size} must hold two dataloader batches "
                f"(2 x {batch_size})"
            )
        while True:
            while self._input.qsize() < batch_size:  # (a replayed batch may be all done)
                for cursor, item in self._next_batch(dataloader):
                    self._submit(_Episode(item, workflow, should_accept, cursor=cursor))
            try:
                return self.wait(batch_size, timeout=POLL_S)
            except TimeoutError:
                continue

    def _next_batch(self, dataloader: Any) -> list[tuple[tuple[int, int], dict[str, Any]]]:
        """The next dataloader batch as (cursor, item) pairs, without the items a restored
        state marks done (an empty list when all of a replayed batch is done)."""
        if self._replay is not None:
            self._start_replay(dataloader)
        elif self._dataloader is not dataloader:
            self._dataloader, self._data_iter = dataloader, iter(dataloader)
        position = _position(dataloader)
        try:
            batch = next(self._data_iter)
        except StopIteration:
            self._data_iter = iter(dataloader)
            position = _position(dataloader)
            try:
                batch = next(self._data_iter)
            except StopIteration:
                raise ValueError("prepare_batch: the dataloader yields no data") from None
        if isinstance(batch, dict):  # default collate: dict of columns -> rows
            n = len(next(iter(batch.values())))
            rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]
        else:
            rows = list(batch)
        done = self._replay_done.pop(0) if self._replay_done else set()
        number = self._n_pulled
        self._n_pulled += 1
        with self._cond:
            if len(done) < len(rows):
                self._pulled[number] = _PulledBatch(position, len(rows), set(done))
        return [((number, i), row) for i, row in enumerate(rows) if i not in done]

    def _start_replay(self, dataloader: Any) -> None:
        """Rewind the dataloader to the oldest batch that was not fully done at the checkpoint."""
        replay, self._replay = self._replay, None
        if replay["position"] is not None:
            dataloader.load_state_dict(replay["position"])
        self._dataloader, self._data_iter = dataloader, iter(dataloader)
        self._replay_done = [set(d) for d in replay["done"]]

    def _mark_done(self, ep: _Episode) -> None:
        """Under self._cond: the item of `ep` needs no replay after a restart."""
        if ep.cursor is None:
            return
        number, index = ep.cursor
        pulled = self._pulled.get(number)
        if pulled is not None:
            pulled.done.add(index)
            if len(pulled.done) == pulled.size:
                del self._pulled[number]

    # ------------------------------------------------------------------ control and state

    def pause(self) -> None:
        """Stop starting new episodes; running ones continue."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
        self.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def stats(self) -> dict[str, int]:
        """Counters for logging: submitted, running, accepted, rejected, failed, queued, ready."""
        with self._cond:
            out = asdict(self.stat)
            out["queued"] = self._input.qsize()
            out["ready"] = len(self._results)
        return out

    def state_dict(self) -> dict[str, Any]:
        """What recovery must restore: the staleness counters as if the episodes not yet
        consumed had never started (they are replayed), and where prepare_batch's replay
        starts (`position`: None = the dataloader's own state) with the done items after it."""
        with self._cond:
            s = self.stat
            pending = sum(b.size - len(b.done) for b in self._pulled.values())
            oldest = next(iter(self._pulled.values()), None)
            return {
                "submitted": s.submitted - pending,
                "accepted": s.accepted - len(self._results),
                "rejected": s.rejected,
                "failed": s.failed,
                "position": None if oldest is None else oldest.position,
                "done": [sorted(b.done) for b in self._pulled.values()],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and the replay of pulled-but-unconsumed items (episodes running
        at save time are lost; running = 0). Call before the first prepare_batch."""
        with self._cond:
            for k in ("submitted", "accepted", "rejected", "failed"):
                setattr(self.stat, k, int(state.get(k, 0)))
            if state.get("position") is not None or state.get("done"):
                self._replay = {"position": state.get("position"), "done": state["done"]}
        self.notify()

    # ------------------------------------------------------------------ the loop thread

    def _run_loop(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._wakeup = asyncio.Event()
        ready.set()
        try:
            loop.run_until_complete(self._schedule())
        except BaseException as e:  # surfaced to callers of wait()/submit()
            logger.exception("rollout loop crashed")
            self._loop_error = e
        finally:
            self._shutdown_loop(loop)

    def _shutdown_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        for hook in self._shutdown_hooks:
            try:
                loop.run_until_complete(hook())
            except Exception:
                logger.exception("rollout shutdown hook %r failed", hook)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        with self._cond:
            self._exiting = True
            self._cond.notify_all()

    async def _schedule(self) -> None:
        assert self._wakeup is not None
        while not self._exiting:
            self._wakeup.clear()
            self._start_admissible()
            try:
                await asyncio.wait_for(self._wakeup.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    def _start_admissible(self) -> None:
        if self._paused:
            return
        n = self.get_capacity()
        while n > 0:
            try:
                ep = self._input.get_nowait()
            except queue.Empty:
                return
            task = asyncio.ensure_future(self._run_episode(ep))
            with self._cond:
                self.stat.running += 1
                self._cond.notify_all()  # the input queue has room again
            self._tasks.add(task)
            task.add_done_callback(lambda t, ep=ep: self._on_done(t, ep))
            n -= 1

    async def _run_episode(self, ep: _Episode) -> TensorDict | None:
        """The episode, then its acceptance test; any exception is the episode's failure."""
        result = await ep.workflow.arun_episode(self.engine, ep.data)
        if result is not None and not isinstance(result, TensorDict):
            raise TypeError(
                f"arun_episode must return a TensorDict or None, got {type(result).__name__}"
            )
        if result is not None and ep.should_accept is not None and not ep.should_accept(result):
            return None
        return result

    def _on_done(self, task: asyncio.Task, ep: _Episode) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            with self._cond:
                self.stat.running -= 1
                self._cond.notify_all()
            return
        error = task.exception()
        result = task.result() if error is None else None
        with self._cond:
            self.stat.running -= 1
            if error is not None:
                self.stat.failed += 1
                self._record_error(ep, RolloutError(ep.data, ep.workflow, error))
            elif result is None:
                self.stat.rejected += 1
                self._mark_done(ep)
                if ep.group is not None:
                    ep.group.done += 1
            else:
                self.stat.accepted += 1
                if ep.group is not None:
                    ep.group.results[ep.index] = result
                    ep.group.done += 1
                else:
                    self._results.append((result, ep))
            self._cond.notify_all()
        self._wakeup.set()  # a slot is free

    def _record_error(self, ep: _Episode, err: RolloutError) -> None:
        logger.error("%s", err, exc_info=err.__cause__)
        self._mark_done(ep)
        if ep.group is not None:
            ep.group.done += 1
            ep.group.error = ep.group.error or err
        else:
            self._errors.append(err)


def _position(dataloader: Any) -> Any:
    """The dataloader's resumable position (StatefulDataLoader), or None."""
    state_dict = getattr(dataloader, "state_dict", None)
    return state_dict() if callable(state_dict) else None
