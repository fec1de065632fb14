"""Continuous-batching scheduler: one background thread owns the model and runs the decode loop.

HTTP handlers only enqueue work and await `concurrent.futures.Future`s. Between two decoding
steps the thread applies control actions (pause, per-request aborts, exclusive jobs such as
weight loads) and admits waiting requests into the running batch, so a new request joins the
next step rather than the next batch.

A pause either aborts everything in flight (`abort`: the client resubmits prompt + tokens so far,
a prefill each) or freezes the running rows with their KV caches (`in_place`): weight loads then
run between two steps of those rows, which go on under the new weights from the next step, each
token tagged with the version that produced it (in-flight updates; the KV cache of the earlier
tokens stays as the old weights computed it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch

from arealite.server.aborts import PendingAborts
from arealite.server.metrics import ServerMetrics
from arealite.server.model_runner import ModelRunner, Sequence

logger = logging.getLogger("arealite.server")


def _settle(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a future that the waiting client may already have cancelled."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def pop_admissible(waiting: deque[Sequence], room: int, max_prefill_tokens: int) -> list[Sequence]:
    """FIFO, up to `room` rows and a padded prefill of at most `max_prefill_tokens` (always at
    least one request, however long, so nothing starves)."""
    admitted: list[Sequence] = []
    width = 0
    while waiting and len(admitted) < room:
        new_width = max(width, len(waiting[0].req.input_ids))
        if admitted and new_width * (len(admitted) + 1) > max_prefill_tokens:
            break
        admitted.append(waiting.popleft())
        width = new_width
    return admitted


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 16384,
        metrics: ServerMetrics | None = None,
        weight_version: int = 0,
        log_interval: float = 10.0,
        gather_quiet_s: float = 0.003,
        gather_max_s: float = 0.03,
    ) -> None:
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.metrics = metrics or ServerMetrics()
        self.weight_version = weight_version
        self.metrics.weight_version = weight_version
        self.log_interval = log_interval
        self.gather_quiet_s = gather_quiet_s
        self.gather_max_s = gather_max_s
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._futures: dict[int, Future] = {}  # id(seq) -> future; touched under _cond
        self._aborts = PendingAborts()
        self._pause_acks: list[Future] = []
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._paused = False
        self._frozen = False  # paused in place: running rows keep their state but do not step
        self._stopping = False
        self._last_log = time.monotonic()
        self._tokens_at_last_log = 0
        self._thread = threading.Thread(target=self._run, name="arealite-scheduler", daemon=True)

    # ---- API for the HTTP thread ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, seq: Sequence) -> Future:
        """Queue a sequence; the future resolves to the finished Sequence."""
        return self.submit_many([seq])[0]

    def submit_many(self, seqs: list[Sequence]) -> list[Future]:
        """Queue sequences at once, so they are admitted in the same step (rows sharing a
        prompt are then prefilled once); one future per sequence."""
        futures: list[Future] = [Future() for _ in seqs]
        with self._cond:
            for seq, fut in zip(seqs, futures):
                self._futures[id(seq)] = fut
                self._waiting.append(seq)
            self._cond.notify()
        return futures

    def abort(self, rid: str | None) -> None:
        """Abort one request id (waiting or running), or everything when rid is None."""
        with self._cond:
            if rid is None:
                self._aborts.abort_everything(self._waiting)
            else:
                self._aborts.pull_waiting(self._waiting, lambda s: s.rid == rid)
                self._aborts.add_rid(rid)
            self._cond.notify()

    def abort_sequence(self, seq: Sequence) -> None:
        """Abort exactly this submission (its client left; a retry may reuse the rid)."""
        with self._cond:
            if not self._aborts.pull_waiting(self._waiting, lambda s: s is seq):
                self._aborts.add_sequence(seq)
            self._cond.notify()

    def pause(self, in_place: bool = False) -> Future:
        """Hold new requests and stop decoding; in-flight ones are aborted, or with `in_place`
        kept (frozen with their KV caches until `resume`). Resolves once no step is running."""
        fut: Future = Future()
        with self._cond:
            self._paused = True
            self._frozen = self._frozen or in_place
            self.metrics.paused = True
            if not in_place:
                self._aborts.abort_everything(self._waiting)
            self._pause_acks.append(fut)
            self._cond.notify()
        return fut

    def resume(self) -> None:
        with self._cond:
            self._paused = self._frozen = False
            self.metrics.paused = False
            self._cond.notify()

    def run_exclusive(self, job: Callable[[], Any]) -> Future:
        """Run `job` on the scheduler thread between two steps, once no request is running or
        the running ones are frozen by an in-place pause (new ones are held meanwhile)."""
        fut: Future = Future()
        with self._cond:
            self._jobs.append((job, fut))
            self._cond.notify()
        return fut

    def set_weight_version(self, version: int) -> None:
        """Called from exclusive jobs only: rows frozen in place go on under `version`."""
        self.weight_version = version
        self.metrics.weight_version = version
        for seq in self.runner.running:
            seq.new_weights(version)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # ---- scheduler thread -------------------------------------------------------------------
    def _has_work(self) -> bool:
        stepping = self.runner.num_running and not self._frozen
        return bool(
            self._stopping
            or self._aborts
            or self._pause_acks
            or stepping
            or (self._jobs and not stepping)
            or (self._waiting and not self._paused and not self._jobs)
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._has_work():
                    self._cond.wait(timeout=self.log_interval)
                    self._maybe_log()
                if self._stopping:
                    break
                aborted = self._take_aborts()
                acks, self._pause_acks = self._pause_acks, []
            self._finish(aborted)
            for ack in acks:
                _settle(ack, True)
            if self._jobs and (self.runner.num_running == 0 or self._frozen):
                self._run_jobs()
                continue
            if self._frozen:
                continue
            self._step(self._admit())
            self._maybe_log()
        self._finish(self._take_aborts_for_shutdown())

    def _take_aborts(self) -> list[Sequence]:
        """Under the lock: collect waiting and running sequences that must end now as aborted."""
        return self._aborts.take(self.runner, self.weight_version)

    def _take_aborts_for_shutdown(self) -> list[Sequence]:
        with self._cond:
            self._aborts.abort_everything(self._waiting)
            return self._take_aborts()

    def _admit(self) -> list[Sequence]:
        """Pop waiting sequences that may join the next step (all at once after a short gather)."""
        with self._cond:
            if self._paused or self._jobs or not self._waiting or not self.runner.can_join_running:
                return []
            if self.runner.num_running == 0:
                self._gather_burst()
            room = self.max_batch_size - self.runner.num_running
            admitted = pop_admissible(self._waiting, room, self.max_prefill_tokens)
        for s in admitted:
            s.weight_version = self.weight_version
        return admitted

    def _gather_burst(self) -> None:
        """From idle, wait until arrivals pause briefly, so a burst of requests forms one batch
        instead of trickling in one prefill at a time (costs at most gather_max_s of latency)."""
        deadline = time.monotonic() + self.gather_max_s
        seen = len(self._waiting)
        while seen < self.max_batch_size and time.monotonic() < deadline:
            self._cond.wait(self.gather_quiet_s)
            if len(self._waiting) == seen or self._paused or self._stopping:
                return
            seen = len(self._waiting)

    def _step(self, admitted: list[Sequence]) -> None:
        rows = self.runner.num_running + len(admitted)
        if rows == 0:
            return
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                finished = self.runner.step(admitted)
        except Exception as e:  # a model failure must not kill the server: fail these requests
            logger.exception("scheduler step failed; aborting the running batch")
            self._fail_running(admitted, e)
            return
        self.metrics.on_step(rows, rows, time.perf_counter() - started)
        self._finish(finished)

    def _fail_running(self, admitted: list[Sequence], error: Exception) -> None:
        known = {id(s) for s in admitted}
        victims = admitted + [s for s in self.runner.drop_running() if id(s) not in known]
        with self._cond:
            futs = [self._futures.pop(id(s), None) for s in victims]
        for fut in futs:
            if fut is not None:
                _settle(fut, error=RuntimeError(f"generation failed: {error}"))

    def _run_jobs(self) -> None:
        with self._cond:
            jobs, self._jobs = list(self._jobs), deque()
        for job, fut in jobs:
            try:
                _settle(fut, job())
            except Exception as e:
                logger.exception("exclusive job failed")
                _settle(fut, error=e)

    def _finish(self, seqs: list[Sequence]) -> None:
        if not seqs:
            self._publish_queue()
            return
        with self._cond:
            futs = [self._futures.pop(id(s), None) for s in seqs]
        for s, fut in zip(seqs, futs):
            self.metrics.on_finish(s.finish_reason["type"], len(s.req.input_ids))
            if fut is not None:
                _settle(fut, s)
        self._publish_queue()

    def _publish_queue(self) -> None:
        self.metrics.set_queue(self.runner.num_running, len(self._waiting))

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_interval:
            return
        snap = self.metrics.snapshot()
        tokens = snap["generation_tokens"] - self._tokens_at_last_log
        if tokens or snap["running"] or len(self._waiting):
            logger.info(
                "gen throughput %.1f tok/s | running %d | waiting %d | version %s%s",
                tokens / (now - self._last_log),
                self.runner.num_running,
                len(self._waiting),
                self.weight_version,
                " | paused" if self._paused else "",
            )
        self._last_log, self._tokens_at_last_log = now, snap["generation_tokens"]
