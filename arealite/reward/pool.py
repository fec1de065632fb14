"""Run a reward function in worker processes, with a timeout per call.

Why processes: reward code (math-verify, sympy, user code) is CPU-bound, may hang, and
math-verify times itself out with `signal.alarm`, which only works in a process's main thread:
a pool worker's tasks run exactly there, and the rollout loop's thread stays free.

Why the odd lifecycle: a call that times out leaves its worker stuck, and a ProcessPoolExecutor
cannot kill one task. So a timeout retires the whole pool: new calls go to a fresh pool, and the
retired one is killed as soon as its other (innocent) calls have finished.

The reward function must be picklable (a module-level function): workers import its module,
and the parent's `__main__` script only when the reward is defined there (such a script needs
an `if __name__ == "__main__":` guard: forkserver / spawn children re-import it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import multiprocessing
import pickle
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from arealite.api.reward_api import FailFast
from arealite.reward.errors import RewardErrors

logger = logging.getLogger("arealite.reward")

WARMUP_TIMEOUT_S = 300.0


def _preload(fn: Callable) -> None:
    """Worker initializer: unpickling `fn` already imported its module; nothing else to do."""


def _warmup() -> bool:
    return True


class RemoteTraceback(Exception):
    """The worker-side traceback of a failed call, chained as the cause of its exception."""

    def __str__(self) -> str:
        return str(self.args[0])


class _CallFailed:
    """A call's exception, sent back in place of its value (with its traceback as text, the
    part pickling drops) so that one failing sample does not fail its batch-mates."""

    def __init__(self, error: BaseException, traceback_text: str):
        try:
            pickle.dumps(error)
        except Exception:
            error = RuntimeError(f"{type(error).__name__}: {error}")
        self.error, self.traceback_text = error, traceback_text

    def unwrap(self) -> BaseException:
        self.error.__cause__ = RemoteTraceback(self.traceback_text)
        return self.error


def _call_many(fn: Callable, calls: list[tuple[tuple, dict]]) -> list[Any]:
    out: list[Any] = []
    for args, kwargs in calls:
        try:
            out.append(fn(*args, **kwargs))
        except Exception as e:
            out.append(_CallFailed(e, traceback.format_exc()))
    return out


_MAIN_HIDDEN = threading.Lock()  # pools start from their own threads, two at once in GRPO


@contextlib.contextmanager
def _main_script_hidden(fn: Callable) -> Iterator[None]:
    """While workers start: a forkserver / spawn child imports the parent's `__main__` script
    (as `__mp_main__`) unless `__main__` has neither `__file__` nor `__spec__`. A trainer script
    imports torch, transformers and FSDP (~3 s a worker on a 2-core CPU, the first reward calls
    waiting for it); a reward that does not live in `__main__` needs none of it. A reward that
    does (its pickle names `__main__`) keeps the default."""
    import __main__ as main

    if b"__main__" in pickle.dumps(fn):
        yield
        return
    with _MAIN_HIDDEN:
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        try:
            yield
        finally:
            main.__dict__.update(saved)


class _Generation:
    """One ProcessPoolExecutor and the calls still running on it."""

    def __init__(self, fn: Callable, max_workers: int, ctx: Any):
        with _main_script_hidden(fn):
            self.pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=max_workers, mp_context=ctx, initializer=_preload, initargs=(fn,)
            )
            # One task per worker spawns them all now (workers start on demand, and only while
            # none is idle), so module import time is not charged to the first reward calls'
            # timeout, and no worker starts outside this block.
            self.warmup = [self.pool.submit(_warmup) for _ in range(max_workers)]
        # The executor joins its workers at interpreter exit, which would hang on a stuck one;
        # threading's exit hooks run in reverse order, so this kill runs before that join.
        try:
            threading._register_atexit(self.kill)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # no such hook, or already shutting down
            pass
        self.pending: set[concurrent.futures.Future] = set()
        self.retired = False
        self.killed = False
        self._manager: threading.Thread | None = None  # the executor's, once killed

    def kill(self) -> None:
        """Kill the workers (a stuck one cannot be stopped otherwise), then wait for the
        executor's manager thread to close its pipes."""
        if not self.killed:
            self.killed = True
            self._manager = getattr(self.pool, "_executor_manager_thread", None)
            # ProcessPoolExecutor has no public per-worker kill before Python 3.14.
            for p in list(getattr(self.pool, "_processes", {}).values()):
                try:
                    p.kill()
                except Exception:  # already gone
                    pass
            self.pool.shutdown(wait=False, cancel_futures=True)
        self._join_manager()

    def _join_manager(self) -> None:
        """Why wait: at interpreter exit concurrent.futures' own hook (it runs right after ours)
        writes to the manager thread's wake-up pipe without a lock; a manager thread still
        closing that pipe makes the write fail, and Python prints "Exception ignored in:
        <module 'threading'> ... OSError: [Errno 9] Bad file descriptor", which a user reads as
        a crash. With the workers dead the thread ends in milliseconds. Not from the thread itself: a call's
        done-callback runs there and may kill a retired generation."""
        manager = self._manager
        if manager is None or manager is threading.current_thread():
            return
        manager.join(timeout=10.0)
        if not manager.is_alive():  # let it go: it holds a weakref to the executor whose
            self._manager = None  # callback, run at interpreter teardown, prints a traceback


def _kill_all(gens: list[_Generation]) -> None:
    for g in gens:
        g.kill()


class RewardPool:
    """`await pool(*args, **kwargs)` runs `reward_fn(*args, **kwargs)` in a worker process and
    returns a float (`await pool.many(calls)`: a list, for a group); a timeout, an exception or
    a non-finite value (NaN, inf, not a number) returns `default` (0.0) and is counted in
    `stats` (timeouts / errors) and logged once per kind with a count; with `fail_fast`, a
    reward that plainly never works raises RewardFailFastError instead (errors.py), so
    the run stops."""

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        max_workers: int = 2,
        timeout: float = 15.0,
        default: float = 0.0,
        mp_context: str = "forkserver",
        fail_fast: FailFast | None = None,
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        try:
            pickle.dumps(reward_fn)
        except Exception as e:
            raise TypeError(
                f"reward_fn {reward_fn!r} must be picklable (a module-level function) because "
                f"it runs in a process pool: {e}"
            ) from None
        self.reward_fn = reward_fn
        self.max_workers = max_workers
        self.timeout = timeout
        self.default = default
        methods = multiprocessing.get_all_start_methods()
        self._ctx = multiprocessing.get_context(mp_context if mp_context in methods else "spawn")
        self._lock = threading.Lock()
        self._gens: list[_Generation] = []
        self._current: _Generation | None = None
        self._closed = False
        self.stats = {"calls": 0, "ok": 0, "timeouts": 0, "errors": 0}
        self.errors = RewardErrors(getattr(reward_fn, "__name__", repr(reward_fn)), fail_fast)
        self._finalizer = weakref.finalize(self, _kill_all, self._gens)
        # Boot the workers now, beside the caller's model loading: a forkserver imports the main
        # script (seconds) before the first worker runs, and the first reward calls would wait.
        threading.Thread(target=self._start_early, name="reward-pool-start", daemon=True).start()

    def _start_early(self) -> None:
        try:
            self._generation()
        except RuntimeError:  # closed before it started
            pass

    def _generation(self) -> _Generation:
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            if self._current is None or self._current.retired:
                self._current = _Generation(self.reward_fn, self.max_workers, self._ctx)
                self._gens.append(self._current)
            return self._current

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        return (await self.many([(args, kwargs)]))[0]

    async def many(self, calls: list[tuple[tuple, dict]]) -> list[float]:
        """Score several calls (a GRPO group's samples, as `(args, kwargs)`) in one worker
        task per worker: one inter-process round trip per chunk, not per sample. A chunk gets
        `timeout` per call; one that times out is retried call by call, so only the stuck call
        scores `default`."""
        gen = await self._ready_generation()
        size = -(-len(calls) // self.max_workers)
        chunks = [calls[i : i + size] for i in range(0, len(calls), size)]
        scored = await asyncio.gather(*(self._run_chunk(gen, chunk) for chunk in chunks))
        return [value for chunk in scored for value in chunk]

    async def _ready_generation(self) -> _Generation:
        gen = self._generation()
        try:
            if not all(f.done() for f in gen.warmup):  # called per group: skip once warm
                await asyncio.wait_for(
                    asyncio.gather(*(asyncio.wrap_future(f) for f in gen.warmup)), WARMUP_TIMEOUT_S
                )
            for f in gen.warmup:
                f.result()  # a worker that failed to start raises BrokenProcessPool here
        except (BrokenProcessPool, asyncio.TimeoutError) as e:
            self._retire(gen)
            raise RuntimeError(
                f"reward worker processes failed to start (cannot import {self.reward_fn!r}?): "
                f"{type(e).__name__}: {e}"
            ) from e
        return gen

    async def _run_chunk(self, gen: _Generation, calls: list[tuple[tuple, dict]]) -> list[float]:
        fut = gen.pool.submit(_call_many, self.reward_fn, calls)
        with self._lock:
            gen.pending.add(fut)
        fut.add_done_callback(lambda f, g=gen: self._on_finished(g, f))
        try:
            values = await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout * len(calls))
        except asyncio.TimeoutError:
            self._retire(gen, stuck=fut)
            if len(calls) > 1:  # find the stuck call; its batch-mates keep their scores
                return list(await asyncio.gather(*(self(*c[0], **c[1]) for c in calls)))
            self.stats["timeouts"] += 1
            return [self._failed(f"timeout after {self.timeout:g}s")]
        except Exception as e:  # the task as a whole failed (a dead worker, a result that
            if isinstance(e, BrokenProcessPool):  # cannot be pickled)
                self._retire(gen)
            return [self._error(e) for _ in calls]
        return [self._score(v) for v in values]

    def _score(self, value: Any) -> float:
        try:
            if isinstance(value, _CallFailed):
                raise value.unwrap()
            value = float(value)
            if not math.isfinite(value):  # NaN / inf would poison the advantages of the group
                raise ValueError(f"returned a non-finite reward {value}")
        except Exception as e:
            return self._error(e)
        self.stats["calls"] += 1
        self.stats["ok"] += 1
        self.errors.ok()
        return value

    def _error(self, e: BaseException) -> float:
        self.stats["errors"] += 1
        return self._failed(type(e).__name__, e)

    def _failed(self, kind: str, e: BaseException | None = None) -> float:
        self.stats["calls"] += 1
        self.errors.failed(kind, e)
        return self.default

    def _on_finished(self, gen: _Generation, fut: concurrent.futures.Future) -> None:
        with self._lock:
            gen.pending.discard(fut)
            drained = gen.retired and not gen.pending
        if drained:
            gen.kill()

    def _retire(self, gen: _Generation, stuck: concurrent.futures.Future | None = None) -> None:
        """Send new calls to a fresh pool; kill this one once its innocent calls are done."""
        with self._lock:
            gen.retired = True
            if stuck is not None:
                gen.pending.discard(stuck)
            drained = not gen.pending
        if drained:
            gen.kill()

    def end_step(self, what: str = "step") -> None:
        """The trainer's step boundary: raises RewardFailFastError when every call of the step
        failed (the rule: arealite/reward/errors.py)."""
        self.errors.end_step(what)

    def worker_pids(self) -> list[int]:
        """Pids of live worker processes (monitoring; stuck workers show up here)."""
        with self._lock:
            gens = [g for g in self._gens if not g.killed]
        procs = [p for g in gens for p in list(getattr(g.pool, "_processes", {}).values())]
        return [p.pid for p in procs if p.is_alive()]

    def close(self) -> None:
        """Kill every worker (stuck ones included)."""
        with self._lock:
            self._closed = True
        self._finalizer()
