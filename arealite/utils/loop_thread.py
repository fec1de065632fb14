"""An asyncio event loop on a daemon thread, so synchronous callers can run coroutines on it.

The inference client keeps its HTTP session there, the rollout executor runs its episodes there
and the agent proxy serves its HTTP routes there; each must cancel every task and close what it
opened before the loop closes (shutdown hooks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

logger = logging.getLogger("arealite.loop")


class LoopThread:
    """`start()` once, `run(coro)` from any other thread, `stop()` once.

    `stop` cancels every task still on the loop, awaits them, then awaits each shutdown hook
    (e.g. close an HTTP session only once no request uses it) and closes the loop.
    """

    def __init__(self, name: str):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._shutdown_hooks: list[Callable[[], Awaitable[Any]]] = []

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: start() called twice")
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=self.name, daemon=True
        )
        self._thread.start()
        ready.wait()

    def add_shutdown_hook(self, hook: Callable[[], Awaitable[Any]]) -> None:
        self._shutdown_hooks.append(hook)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def running(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._loop is not None
            and self._loop.is_running()
        )

    def run(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule `coro` on the loop; RuntimeError when the loop is not running."""
        if not self.running:
            coro.close()
            raise RuntimeError(f"{self.name} is not running; call initialize() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` on the loop thread; nothing when the loop is gone."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # closed between the check and the call
                pass

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel every task, run the shutdown hooks, close the loop and join the thread."""
        if self._loop is not None:
            self.call_soon(self._loop.stop)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("%s did not stop within %.0fs", self.name, timeout)

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            self._shutdown(loop)

    def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        for hook in self._shutdown_hooks:
            try:
                loop.run_until_complete(hook())
            except Exception:
                logger.exception("%s: shutdown hook %r failed", self.name, hook)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
