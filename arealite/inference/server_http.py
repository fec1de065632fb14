"""One aiohttp session to the inference servers: per-call timeout, retries, error types.

Two failure kinds matter to the callers above: `ServerUnavailable` (unreachable or too slow;
the server pool takes it out of rotation) and `ServerError` (it answered with an error status:
a bad request, or a failure it reported; it stays in rotation).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp

SERVER_API_KEY_ENV = "AREAL_SERVER_API_KEY"


class ServerUnavailable(ConnectionError):
    """A server could not be reached or did not answer in time (it leaves the rotation)."""

    def __init__(self, addr: str, reason: str, timed_out: bool = False):
        super().__init__(f"{addr}: {reason}")
        self.addr, self.reason, self.timed_out = addr, reason, timed_out


class ServerError(RuntimeError):
    """A server answered with an error status: a bad request or a failure it reported."""

    def __init__(self, addr: str, path: str, status: int, message: str):
        super().__init__(f"{addr}{path} answered HTTP {status}: {message}")
        self.addr, self.path, self.status, self.message = addr, path, status, message


def parse_version(value: Any) -> int | None:
    """Servers report versions as ints or strings (SGLang: str, or "default" when unset)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def token_versions(spans: Any, n_tokens: int) -> list[int | None] | None:
    """`weight_versions` spans [{"version", "start", "end"}] (vLLM's; the embedded server's
    after an in-place update) -> one version per output token (None where the label is not an
    integer, e.g. "default" before any update)."""
    if spans is None:
        return None
    out: list[int | None] = [None] * n_tokens
    for s in spans:
        start, end = int(s["start"]), int(s["end"])
        if not 0 <= start <= end <= n_tokens:
            raise ValueError(f"weight_versions span {s} outside the {n_tokens} output tokens")
        out[start:end] = [parse_version(s["version"])] * (end - start)
    return out


class ServerHTTP:
    """JSON over HTTP to `host:port` servers; lives on one event loop (the session's).

    `counters["http_retries"]` counts retried calls. The API key comes from the config or, as
    launchers hand it to trainers, from $AREAL_SERVER_API_KEY.
    """

    def __init__(
        self,
        request_timeout: float,
        request_retries: int,
        api_key: str | None,
        counters: Counter[str],
    ):
        self.request_timeout = request_timeout
        self.request_retries = max(0, request_retries)
        self.api_key = api_key
        self.counters = counters
        self._session: aiohttp.ClientSession | None = None

    @property
    def closed(self) -> bool:
        return self._session is None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            key = self.api_key or os.environ.get(SERVER_API_KEY_ENV)
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            # limit=0: the servers do their own batching; queueing here would only add latency.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=headers
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def call(
        self, addr: str, method: str, path: str, payload: Any = None, timeout: float | None = None
    ) -> Any:
        """One HTTP call; the JSON answer (or text). Raises ServerUnavailable / ServerError."""
        t = aiohttp.ClientTimeout(total=timeout or self.request_timeout)
        try:
            async with self._get_session().request(
                method, f"http://{addr}{path}", json=payload, timeout=t
            ) as resp:
                text = await resp.text()
                status = resp.status
        except asyncio.TimeoutError:
            raise ServerUnavailable(
                addr, f"{method} {path} timed out after {t.total}s", timed_out=True
            ) from None
        except aiohttp.ClientError as e:
            raise ServerUnavailable(addr, f"{method} {path}: {type(e).__name__}: {e}") from None
        if status >= 400:
            raise ServerError(addr, path, status, _error_message(text))
        try:
            return json.loads(text)
        except ValueError:
            return text

    async def call_with_retries(
        self,
        addr: str,
        method: str,
        path: str,
        payload: Any = None,
        give_up: Callable[[], bool] | None = None,
    ) -> Any:
        """Retry connection errors and 5xx answers on the same server with backoff. A timeout,
        exhausted retries on connection errors, or `give_up()` (the server already left the
        rotation) raise ServerUnavailable."""
        retries = self.request_retries
        for attempt in range(retries + 1):
            try:
                return await self.call(addr, method, path, payload)
            except ServerUnavailable as e:
                if e.timed_out or attempt == retries or (give_up is not None and give_up()):
                    raise
            except ServerError as e:
                if e.status < 500 or e.status == 501 or attempt == retries:
                    raise
            self.counters["http_retries"] += 1
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(body, dict):
        for k in ("error", "message", "detail"):
            if body.get(k):
                inner = body[k]  # vLLM / OpenAI: {"error": {"message": ..., "type": ...}}
                if isinstance(inner, dict) and inner.get("message"):
                    inner = inner["message"]
                return str(inner)[:500]
    return text[:500]
