"""Which inference server a request goes to: routing, fail-over, health and re-admission.

Round-robin over the live servers with a sticky server per request id (a resumed generation
finds its prefix cache again); a server that cannot be reached leaves the rotation, the request
moves to the next one, and a background probe brings it back once it is healthy and the client
has restored its weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from arealite.api.launch_config import SERVER_ADDRS_ENV, SERVERS_STARTUP_ENV
from arealite.inference.server_http import ServerError, ServerHTTP, ServerUnavailable

logger = logging.getLogger("arealite.remote")

STICKY_CAPACITY = 16384  # remembered rid -> server entries (LRU)
READMIT_INTERVAL_S = 2.0  # how often failed servers are probed for re-admission


class NoServerAvailable(RuntimeError):
    """Every server has failed; the message names each one and why."""


def normalize_address(addr: str) -> str:
    """'http://h:p/' or 'h:p' -> 'h:p' (the form the launcher and configs use)."""
    a = addr.strip()
    for prefix in ("http://", "https://"):
        if a.startswith(prefix):
            a = a[len(prefix) :]
    a = a.rstrip("/")
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Bad server address {addr!r}: expected host:port")
    return a


def resolve_addresses(addr: str | list[str] | None, configured: list[str] | None) -> list[str]:
    """Server addresses from the argument, else the config, else $AREAL_LLM_SERVER_ADDRS."""
    if isinstance(addr, str):
        addrs = addr.split(",")
    elif addr:
        addrs = list(addr)
    elif configured:
        addrs = list(configured)
    else:
        addrs = os.environ.get(SERVER_ADDRS_ENV, "").split(",")
    addrs = [normalize_address(a) for a in addrs if a.strip()]
    if not addrs:
        raise ValueError(
            "No inference server addresses: pass initialize(addr=...), set "
            f"rollout.server_addrs, or export {SERVER_ADDRS_ENV}=host:port[,host:port...]"
        )
    if len(set(addrs)) != len(addrs):
        raise ValueError(f"Duplicate inference server addresses: {addrs}")
    return addrs


class ServerPool:
    """The servers of one client and which of them are in rotation (`failed` holds the others,
    with the reason). Used only on the client's event loop."""

    def __init__(
        self,
        addresses: list[str],
        http: ServerHTTP,
        counters: Counter[str],
        health_path: str = "/health",
        wait_timeout: float = 120.0,
    ):
        self.addresses = addresses
        self.http = http
        self.counters = counters
        self.health_path = health_path
        self.wait_timeout = wait_timeout  # how long a request waits for a server to return
        self.failed: dict[str, str] = {}
        self._rr = 0
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._outage_logged_at = -float("inf")

    # ------------------------------------------------------------------ routing

    def alive(self) -> list[str]:
        return [a for a in self.addresses if a not in self.failed]

    def choose(self, rid: str) -> str:
        """The request's sticky server if it is alive, else the next live one (round-robin)."""
        addr = self._sticky.get(rid)
        if addr is not None and addr not in self.failed:
            self._sticky.move_to_end(rid)
            return addr
        alive = self.alive()
        if not alive:
            raise self.no_server_error()
        addr = alive[self._rr % len(alive)]
        self._rr += 1
        self._sticky[rid] = addr
        if len(self._sticky) > STICKY_CAPACITY:
            self._sticky.popitem(last=False)
        return addr

    async def choose_or_wait(self, rid: str) -> str:
        """With every server down, wait up to `wait_timeout` for one to be re-admitted (a
        launcher restarts dead servers) before giving up."""
        deadline = time.monotonic() + self.wait_timeout
        waited = False
        while True:
            try:
                addr = self.choose(rid)
                if waited:
                    logger.warning("request %s goes to %s, which is back", rid, addr)
                return addr
            except NoServerAvailable as e:
                if time.monotonic() >= deadline:
                    raise
                if not waited:
                    self._log_outage(e)
                waited = True
            await asyncio.sleep(0.5)

    def _log_outage(self, e: NoServerAvailable) -> None:
        """Once per outage (not once per waiting request)."""
        now = time.monotonic()
        if now - self._outage_logged_at > self.wait_timeout:
            self._outage_logged_at = now
            logger.warning(
                "%s; requests wait up to %.0fs (rollout.setup_timeout) for one to come back",
                e,
                self.wait_timeout,
            )

    def no_server_error(self) -> NoServerAvailable:
        detail = "; ".join(f"{a}: {why}" for a, why in self.failed.items())
        return NoServerAvailable(f"all {len(self.addresses)} inference server(s) failed: {detail}")

    def mark_failed(self, addr: str, reason: str) -> None:
        if addr not in self.failed:
            self.failed[addr] = reason
            self.counters["servers_removed"] += 1
            logger.warning(
                "taking inference server %s out of rotation (%d left): %s",
                addr,
                len(self.alive()),
                reason,
            )

    async def call(self, addr: str, method: str, path: str, payload: Any = None) -> Any:
        """One call with retries, abandoned once `addr` has left the rotation."""
        return await self.http.call_with_retries(
            addr, method, path, payload, give_up=lambda: addr in self.failed
        )

    async def post_with_failover(self, rid: str, path: str, payload: Any) -> tuple[Any, str]:
        """POST to the request's server; when it is unavailable, to the next live one."""
        while True:
            addr = await self.choose_or_wait(rid)
            try:
                return await self.call(addr, "POST", path, payload), addr
            except ServerUnavailable as e:
                self.mark_failed(addr, e.reason)
                self._sticky.pop(rid, None)
                self.counters["failovers"] += 1

    async def on_servers(self, what: str, fn: Callable[[str], Awaitable[Any]]) -> list[Any]:
        """Run `fn` on every live server concurrently. Unreachable servers leave the rotation;
        a server whose action failed while others succeeded leaves too (it would serve the wrong
        weights); if all fail, raise with every server's reason."""
        servers = self.alive()
        if not servers:
            raise self.no_server_error()
        results = await asyncio.gather(*(fn(a) for a in servers), return_exceptions=True)
        errors = {a: r for a, r in zip(servers, results) if isinstance(r, BaseException)}
        for a, e in errors.items():
            if isinstance(e, asyncio.CancelledError):
                raise e
            if isinstance(e, ServerUnavailable) or len(errors) < len(servers):
                self.mark_failed(a, f"{what} failed: {e}")
        if len(errors) == len(servers):
            detail = "; ".join(f"{a}: {e}" for a, e in errors.items())
            raise RuntimeError(f"{what} failed on every server: {detail}")
        return [r for r in results if not isinstance(r, BaseException)]

    # ------------------------------------------------------------------ health

    async def is_healthy(self, addr: str) -> bool:
        try:
            await self.http.call(addr, "GET", self.health_path, timeout=5.0)
            return True
        except (ServerUnavailable, ServerError):
            return False

    async def wait_all_healthy(self, timeout: float) -> None:
        """TimeoutError naming each server not healthy after `timeout` seconds (or the servers'
        startup timeout, when the launcher started us beside them), and why."""
        timeout = max(timeout, float(os.environ.get(SERVERS_STARTUP_ENV) or 0))
        deadline = time.monotonic() + timeout
        errors = await asyncio.gather(*(self._wait_healthy(a, deadline) for a in self.addresses))
        bad = {a: e for a, e in zip(self.addresses, errors) if e is not None}
        if bad:
            detail = "; ".join(f"{a}: {e}" for a, e in bad.items())
            raise TimeoutError(
                f"{len(bad)} of {len(self.addresses)} inference server(s) not healthy after "
                f"setup_timeout={timeout}s: {detail}"
            )

    async def _wait_healthy(self, addr: str, deadline: float) -> str | None:
        """None once GET health_path answers 200, else the last error at the deadline."""
        last = "no answer"
        while True:
            try:
                await self.http.call(addr, "GET", self.health_path, timeout=5.0)
                return None
            except (ServerUnavailable, ServerError) as e:
                last = e.reason if isinstance(e, ServerUnavailable) else str(e)
            if time.monotonic() >= deadline:
                return last
            await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ re-admission

    async def readmit_loop(self, restore: Callable[[str], Awaitable[None]]) -> None:
        """Forever: probe the failed servers (a launcher may have restarted them) and call
        `restore(addr)` on the healthy ones; it brings the server up to date and calls
        `readmit(addr)` (or leaves it out, to be probed again)."""
        while True:
            await asyncio.sleep(READMIT_INTERVAL_S)
            for addr in list(self.failed):
                try:
                    if await self.is_healthy(addr):
                        await restore(addr)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # still broken: stays out, probed again later
                    logger.info("inference server %s not re-admitted yet: %s", addr, e)

    def readmit(self, addr: str, note: str = "") -> None:
        why = self.failed.pop(addr)
        self.counters["servers_readmitted"] += 1
        logger.warning(
            "inference server %s back in rotation%s (it had failed: %s)", addr, note, why
        )
