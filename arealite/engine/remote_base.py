"""HTTP client machinery shared by remote inference engines (SGLang now, vLLM later).

What every remote backend needs lives here: server discovery and health checks, one aiohttp
session on the rollout loop, per-request timeout and retries, round-robin routing with a sticky
server per request id, fail-over when a server dies (and re-admission once it is healthy again,
after it loaded the current weights), interruptible generation (an aborted
request is resubmitted as prompt + tokens so far with the remaining budget once the pause
lifts), and the pause -> load -> continue choreography of weight updates.

What differs between servers is isolated in a few methods a subclass overrides:
`build_generate_payload`, `parse_generate_response`, `pause_server`, `continue_server`,
`update_server_from_disk`, `init_weights_group`, `update_server_from_distributed` and
`server_tp_size` (and the class attributes `health_path`).
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from arealite.api.cli_args import InferenceEngineConfig
from arealite.api.engine_api import InferenceEngine
from arealite.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta
from arealite.api.workflow_api import RolloutWorkflow, WorkflowExecutor

if TYPE_CHECKING:
    from tensordict import TensorDict

logger = logging.getLogger("arealite.remote")

SERVER_ADDRS_ENV = "AREAL_LLM_SERVER_ADDRS"
SERVER_API_KEY_ENV = "AREAL_SERVER_API_KEY"
_STICKY_CAPACITY = 16384  # remembered rid -> server entries (LRU)
COUNTER_KEYS = (
    "generate_calls",  # HTTP generate calls (a resumed request makes several)
    "aborted_chunks",  # answers that came back aborted and were resubmitted
    "failovers",  # requests moved to another server
    "http_retries",
    "servers_removed",
    "servers_readmitted",
    "weight_updates",
)
READMIT_INTERVAL_S = 2.0  # how often failed servers are probed for re-admission


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


class NoServerAvailable(RuntimeError):
    """Every server has failed; the message names each one and why."""


@dataclass
class GenerateChunk:
    """One server answer to a generate call (a whole generation or the part before an abort)."""

    output_tokens: list[int]
    output_logprobs: list[float]
    finish: str  # "stop" | "length" | "abort"
    version: int | None  # weight version that produced the tokens, if the server says
    # Per-token versions when the server reports them (vLLM's weight_versions spans); None
    # entries fall back to `version`, then to the version last pushed.
    token_versions: list[int | None] | None = None


def parse_version(value: Any) -> int | None:
    """Servers report versions as ints or strings (SGLang: str, or "default" when unset)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


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


class RemoteInferenceEngine(InferenceEngine):
    """An InferenceEngine over HTTP to a list of servers; subclasses speak one server's API."""

    health_path = "/health"

    def __init__(self, config: InferenceEngineConfig):
        self.config = config
        self.addresses: list[str] = []
        self.failed: dict[str, str] = {}  # addr -> why it left the rotation
        # All keys up front: stats() may copy this from another thread while the loop counts.
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTER_KEYS, 0))
        self.executor = WorkflowExecutor(config, self)
        self._version = 0  # policy version for the staleness bound (set by the trainer)
        self._weight_version = 0  # version last pushed to the servers
        self._rr = 0
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._gen_allowed: asyncio.Event | None = None  # cleared while weights are swapped
        self._update_lock: asyncio.Lock | None = None
        self._nccl_group: tuple | None = None
        self._last_weights: WeightUpdateMeta | None = None  # what a re-admitted server loads
        self._seen_version = 0  # newest weight version a server reported to this client

    # ============================================================ server-specific hooks

    @abc.abstractmethod
    def build_generate_payload(
        self, req: ModelRequest, input_ids: list[int], max_new_tokens: int, min_new_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one generate call continuing `input_ids`."""

    @abc.abstractmethod
    def parse_generate_response(self, body: Any) -> GenerateChunk:
        """Tokens, logprobs, finish type and version out of one generate answer."""

    @abc.abstractmethod
    async def pause_server(self, addr: str) -> None:
        """Abort in-flight generation and hold new requests until `continue_server`."""

    @abc.abstractmethod
    async def continue_server(self, addr: str) -> None: ...

    @abc.abstractmethod
    async def update_server_from_disk(self, addr: str, meta: WeightUpdateMeta) -> None:
        """Load HF weights from `meta.path` and tag them `meta.version`; raise on failure."""

    async def init_weights_group(
        self, addr: str, meta: WeightUpdateMeta, rank_offset: int, world_size: int
    ) -> None:
        """Join the trainer's NCCL group (trainer rank 0, this server's ranks from
        `rank_offset`)."""
        raise NotImplementedError(f"{type(self).__name__} has no NCCL weight-update path")

    async def update_server_from_distributed(
        self,
        addr: str,
        meta: WeightUpdateMeta,
        bucket: list[tuple[str, list[int], str]],
        last: bool,
    ) -> None:
        """Receive one bucket of tensors broadcast by trainer rank 0."""
        raise NotImplementedError(f"{type(self).__name__} has no NCCL weight-update path")

    async def server_tp_size(self, addr: str) -> int:
        """Ranks one server occupies in the NCCL group."""
        return 1

    # ============================================================ lifecycle

    def initialize(self, addr: str | list[str] | None = None, train_data_parallel_size: int = 1):
        """Resolve server addresses (argument, config.server_addrs, or $AREAL_LLM_SERVER_ADDRS),
        start the rollout loop and wait up to `setup_timeout` for every server to be healthy."""
        self.addresses = self._resolve_addresses(addr)
        self.executor.add_shutdown_hook(self._close_session)
        self.executor.initialize(train_data_parallel_size)
        try:
            self.executor.run_coroutine(self._setup()).result()
        except BaseException:
            self.destroy()
            raise
        logger.info("connected to %d inference server(s): %s", len(self.addresses), self.addresses)

    def _resolve_addresses(self, addr: str | list[str] | None) -> list[str]:
        if isinstance(addr, str):
            addrs = addr.split(",")
        elif addr:
            addrs = list(addr)
        elif self.config.server_addrs:
            addrs = list(self.config.server_addrs)
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

    async def _setup(self) -> None:
        self._gen_allowed = asyncio.Event()
        self._gen_allowed.set()
        self._update_lock = asyncio.Lock()
        deadline = time.monotonic() + self.config.setup_timeout
        errors = await asyncio.gather(*(self._wait_healthy(a, deadline) for a in self.addresses))
        bad = {a: e for a, e in zip(self.addresses, errors) if e is not None}
        if bad:
            detail = "; ".join(f"{a}: {e}" for a, e in bad.items())
            raise TimeoutError(
                f"{len(bad)} of {len(self.addresses)} inference server(s) not healthy after "
                f"setup_timeout={self.config.setup_timeout}s: {detail}"
            )
        asyncio.ensure_future(self._readmit_loop())  # cancelled with the loop's other tasks

    async def _readmit_loop(self) -> None:
        """Probe failed servers (a launcher may have restarted them) and bring back the healthy
        ones."""
        while True:
            await asyncio.sleep(READMIT_INTERVAL_S)
            for addr in list(self.failed):
                try:
                    await self._try_readmit(addr)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # still broken: stays out, probed again later
                    logger.info("inference server %s not re-admitted yet: %s", addr, e)

    async def _try_readmit(self, addr: str) -> None:
        """Healthy again -> load the weights last pushed (tagged with their version) and match
        the others' pause state, then return to rotation. Under the update lock, so no weight
        update runs meanwhile and the server can never serve an older version."""
        try:
            await self._http(addr, "GET", self.health_path, timeout=5.0)
        except (ServerUnavailable, ServerError):
            return
        assert self._update_lock is not None and self._gen_allowed is not None
        async with self._update_lock:
            if addr not in self.failed:
                return
            meta = self._last_weights
            if meta is not None and meta.type != "disk":
                logger.warning(
                    "inference server %s is healthy again but cannot rejoin: its weights can only "
                    "be restored from disk, and the last update was %s", addr, meta.type
                )  # fmt: skip
                return
            if meta is not None:
                await self.update_server_from_disk(addr, meta)
            elif not await self._serves_version(addr, self._seen_version):
                return  # a client that never pushed weights (e.g. an evaluator) waits for the
                # one that does to bring the restarted server up to date
            if self._gen_allowed.is_set():
                await self.continue_server(addr)
            else:  # generation is paused on the others (pause_generation): pause it too
                await self.pause_server(addr)
            why = self.failed.pop(addr)
            self.counters["servers_readmitted"] += 1
            logger.warning(
                "inference server %s back in rotation with weights v%d (it had failed: %s)",
                addr, self._weight_version, why,
            )  # fmt: skip

    async def _wait_healthy(self, addr: str, deadline: float) -> str | None:
        """None once GET health_path answers 200, else the last error at the deadline."""
        last = "no answer"
        while True:
            try:
                await self._http(addr, "GET", self.health_path, timeout=5.0)
                return None
            except (ServerUnavailable, ServerError) as e:
                last = e.reason if isinstance(e, ServerUnavailable) else str(e)
            if time.monotonic() >= deadline:
                return last
            await asyncio.sleep(0.5)

    def destroy(self) -> None:
        """Cancel running episodes and requests, close the HTTP session, stop the loop."""
        self.executor.destroy()

    async def _close_session(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # ============================================================ versions and stats

    def set_version(self, version: int) -> None:
        self._version = version
        self.executor.notify()

    def get_version(self) -> int:
        return self._version

    @property
    def weight_version(self) -> int:
        """Version of the weights last pushed to the servers (tags tokens when the server
        does not report its own)."""
        return self._weight_version

    def stats(self) -> dict[str, int]:
        """Executor counters plus client events (aborted_chunks, failovers, ...)."""
        return {**self.executor.stats(), **self.counters, "servers_failed": len(self.failed)}

    # ============================================================ HTTP

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # A launcher hands the embedded servers' key to trainers through the environment.
            key = self.config.api_key or os.environ.get(SERVER_API_KEY_ENV)
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            # limit=0: the servers do their own batching; queueing here would only add latency.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=headers
            )
        return self._session

    async def _http(
        self,
        addr: str,
        method: str,
        path: str,
        payload: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """One HTTP call; the JSON answer (or text). Raises ServerUnavailable / ServerError."""
        t = aiohttp.ClientTimeout(total=timeout or self.config.request_timeout)
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

    async def _http_with_retries(self, addr: str, method: str, path: str, payload: Any = None):
        """Retry connection errors and 5xx answers on the same server with backoff; a timeout or
        exhausted retries on connection errors raise ServerUnavailable (the server leaves)."""
        retries = max(0, self.config.request_retries)
        for attempt in range(retries + 1):
            try:
                return await self._http(addr, method, path, payload)
            except ServerUnavailable as e:
                if e.timed_out or attempt == retries or addr in self.failed:
                    raise
            except ServerError as e:
                if e.status < 500 or e.status == 501 or attempt == retries:
                    raise
            self.counters["http_retries"] += 1
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))

    # ============================================================ routing

    def _alive(self) -> list[str]:
        return [a for a in self.addresses if a not in self.failed]

    def _choose_server(self, rid: str) -> str:
        addr = self._sticky.get(rid)
        if addr is not None and addr not in self.failed:
            self._sticky.move_to_end(rid)
            return addr
        alive = self._alive()
        if not alive:
            raise self._no_server_error()
        addr = alive[self._rr % len(alive)]
        self._rr += 1
        self._sticky[rid] = addr
        if len(self._sticky) > _STICKY_CAPACITY:
            self._sticky.popitem(last=False)
        return addr

    async def _serves_version(self, addr: str, version: int) -> bool:
        """Whether `addr` reports weights at least `version` (True when it cannot tell)."""
        try:
            body = await self._http(addr, "GET", "/get_weight_version", timeout=5.0)
        except ServerError:
            return True
        served = parse_version(body.get("weight_version")) if isinstance(body, dict) else None
        return served is None or served >= version

    async def _choose_server_or_wait(self, rid: str) -> str:
        """With every server down, wait up to setup_timeout for one to be re-admitted (a
        launcher restarts dead servers) before giving up."""
        deadline = time.monotonic() + self.config.setup_timeout
        while True:
            try:
                return self._choose_server(rid)
            except NoServerAvailable:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.5)

    def _no_server_error(self) -> NoServerAvailable:
        detail = "; ".join(f"{a}: {why}" for a, why in self.failed.items())
        return NoServerAvailable(f"all {len(self.addresses)} inference server(s) failed: {detail}")

    def _mark_failed(self, addr: str, reason: str) -> None:
        if addr not in self.failed:
            self.failed[addr] = reason
            self.counters["servers_removed"] += 1
            logger.warning(
                "taking inference server %s out of rotation (%d left): %s",
                addr,
                len(self._alive()),
                reason,
            )

    async def _request_with_failover(self, rid: str, path: str, payload: Any) -> tuple[Any, str]:
        """POST to the request's server; when it is unavailable, to the next live one."""
        while True:
            addr = await self._choose_server_or_wait(rid)
            try:
                return await self._http_with_retries(addr, "POST", path, payload), addr
            except ServerUnavailable as e:
                self._mark_failed(addr, e.reason)
                self._sticky.pop(rid, None)
                self.counters["failovers"] += 1

    # ============================================================ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request (n_samples must be 1). Called from any event loop; the HTTP
        work always runs on the rollout loop, which owns the session and the pause state."""
        self._validate_request(req)
        loop = asyncio.get_running_loop()
        if loop is self.executor.loop:
            return await self._agenerate(req)
        return await asyncio.wrap_future(self.executor.run_coroutine(self._agenerate(req)))

    def _validate_request(self, req: ModelRequest) -> None:
        if req.gconfig.n_samples != 1:
            raise ValueError(
                f"agenerate produces one sample, got gconfig.n_samples={req.gconfig.n_samples}; "
                "call it n times with gconfig.new(n_samples=1) (as RLVRWorkflow does)"
            )
        if not req.input_ids:
            raise ValueError(f"ModelRequest {req.rid}: input_ids is empty")

    async def _agenerate(self, req: ModelRequest) -> ModelResponse:
        """Loop until the budget is spent or the server stops: an abort (weight update) is
        resumed as prompt + tokens so far once generation is allowed again."""
        g = req.gconfig
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        stop_reason = "length"
        start, ttft = time.perf_counter(), float("inf")
        idle_aborts = 0
        while len(tokens) < g.max_new_tokens:
            assert self._gen_allowed is not None
            await self._gen_allowed.wait()
            path, payload = self.build_generate_payload(
                req,
                list(req.input_ids) + tokens,
                g.max_new_tokens - len(tokens),
                max(0, g.min_new_tokens - len(tokens)),
            )
            body, addr = await self._request_with_failover(req.rid, path, payload)
            chunk = self.parse_generate_response(body)
            self.counters["generate_calls"] += 1
            if chunk.output_tokens and ttft == float("inf"):
                ttft = time.perf_counter() - start
            v = chunk.version if chunk.version is not None else self._weight_version
            self._seen_version = max(self._seen_version, v)
            tokens += chunk.output_tokens
            logprobs += chunk.output_logprobs
            if chunk.token_versions is None:
                versions += [v] * len(chunk.output_tokens)
            else:
                versions += [v if t is None else t for t in chunk.token_versions]
            if chunk.finish != "abort":
                stop_reason = chunk.finish
                break
            self.counters["aborted_chunks"] += 1
            # Only aborts we did not cause (no weight update under way) count as suspicious.
            if chunk.output_tokens:
                idle_aborts = 0
            elif self._gen_allowed.is_set():
                idle_aborts += 1
                await self._backoff_after_abort(req.rid, addr, idle_aborts)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=stop_reason,  # type: ignore[arg-type]
            latency=time.perf_counter() - start,
            ttft=ttft,
        )

    async def _backoff_after_abort(self, rid: str, addr: str, idle_aborts: int) -> None:
        """Aborts without progress while we are not updating weights mean someone else is
        aborting us: back off, and give up rather than spin forever."""
        limit = 5 + self.config.request_retries
        if idle_aborts > limit:
            raise RuntimeError(
                f"request {rid}: server {addr} aborted it {idle_aborts} times in a row without "
                "generating a token, and no weight update was in progress"
            )
        await asyncio.sleep(min(2.0, 0.05 * 2**idle_aborts))

    # ============================================================ weight updates

    def update_weights(self, meta: WeightUpdateMeta) -> Future:
        """Pause every server (in-flight requests come back aborted and wait), load the new
        weights, continue. For NCCL, the trainer must broadcast while this future is pending."""
        return self.executor.run_coroutine(self._update_weights(meta))

    async def _update_weights(self, meta: WeightUpdateMeta) -> None:
        assert self._update_lock is not None and self._gen_allowed is not None
        async with self._update_lock:
            start = time.perf_counter()
            self._gen_allowed.clear()
            try:
                if self.config.pause_grace_period > 0:
                    await asyncio.sleep(self.config.pause_grace_period)
                await self._on_servers("pause_generation", self.pause_server)
                if meta.type == "disk":
                    await self._on_servers(
                        f"update_weights_from_disk({meta.path})",
                        lambda a: self.update_server_from_disk(a, meta),
                    )
                else:
                    await self._update_weights_nccl(meta)
                self._weight_version = meta.version
                self._last_weights = meta
            finally:
                try:
                    await self._on_servers("continue_generation", self.continue_server)
                finally:
                    self._gen_allowed.set()
            self.counters["weight_updates"] += 1
            logger.info(
                "weights v%d (%s) loaded on %d server(s) in %.2fs",
                meta.version,
                meta.type,
                len(self._alive()),
                time.perf_counter() - start,
            )

    async def _on_servers(self, what: str, fn: Callable[[str], Awaitable[Any]]) -> list[Any]:
        """Run `fn` on every live server concurrently. Unreachable servers leave the rotation;
        a server whose action failed while others succeeded leaves too (it would serve the wrong
        weights); if all fail, raise with every server's reason."""
        servers = self._alive()
        if not servers:
            raise self._no_server_error()
        results = await asyncio.gather(*(fn(a) for a in servers), return_exceptions=True)
        errors = {a: r for a, r in zip(servers, results) if isinstance(r, BaseException)}
        for a, e in errors.items():
            if isinstance(e, asyncio.CancelledError):
                raise e
            if isinstance(e, ServerUnavailable) or len(errors) < len(servers):
                self._mark_failed(a, f"{what} failed: {e}")
        if len(errors) == len(servers):
            detail = "; ".join(f"{a}: {e}" for a, e in errors.items())
            raise RuntimeError(f"{what} failed on every server: {detail}")
        return [r for r in results if not isinstance(r, BaseException)]

    async def _update_weights_nccl(self, meta: WeightUpdateMeta) -> None:
        """Join the trainer's NCCL group once per (address, port, name), then receive each
        bucket of parameters that trainer rank 0 broadcasts (GPU only)."""
        buckets = _param_buckets(meta)
        key = (meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name)
        if self._nccl_group != key:
            servers = self._alive()
            tp = await asyncio.gather(*(self.server_tp_size(a) for a in servers))
            world_size = 1 + sum(tp)
            offsets = {a: 1 + sum(tp[:i]) for i, a in enumerate(servers)}
            await self._on_servers(
                "init_weights_update_group",
                lambda a: self.init_weights_group(a, meta, offsets[a], world_size),
            )
            self._nccl_group = key
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            await self._on_servers(
                "update_weights_from_distributed",
                lambda a, b=bucket, last=last: self.update_server_from_distributed(
                    a, meta, b, last
                ),
            )

    def pause_generation(self) -> None:
        """Abort in-flight generation on every server and hold resubmissions until
        `continue_generation` (for callers that swap weights themselves)."""
        self.executor.run_coroutine(self._pause_generation()).result()

    async def _pause_generation(self) -> None:
        assert self._gen_allowed is not None
        self._gen_allowed.clear()
        await self._on_servers("pause_generation", self.pause_server)

    def continue_generation(self) -> None:
        self.executor.run_coroutine(self._continue_generation()).result()

    async def _continue_generation(self) -> None:
        assert self._gen_allowed is not None
        try:
            await self._on_servers("continue_generation", self.continue_server)
        finally:
            self._gen_allowed.set()

    # ============================================================ rollout (delegated)

    def submit(
        self,
        data: dict[str, Any],
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> None:
        self.executor.submit(data, workflow, should_accept)

    def wait(self, count: int, timeout: float | None = None) -> TensorDict:
        return self.executor.wait(count, timeout)

    def rollout_batch(
        self,
        data: list[dict[str, Any]],
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> TensorDict:
        return self.executor.rollout_batch(data, workflow, should_accept)

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: RolloutWorkflow,
        should_accept: Callable[[TensorDict], bool] | None = None,
    ) -> TensorDict:
        return self.executor.prepare_batch(dataloader, workflow, should_accept)

    def pause(self) -> None:
        self.executor.pause()

    def resume(self) -> None:
        self.executor.resume()


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


def _param_buckets(meta: WeightUpdateMeta) -> list[list[tuple[str, list[int], str]]]:
    """`meta.nccl_param_specs`: buckets of (name, shape, dtype) in broadcast order."""
    specs: Sequence | None = getattr(meta, "nccl_param_specs", None)
    if not specs:
        raise ValueError(
            "WeightUpdateMeta(type='nccl') needs nccl_param_specs: the trainer's parameter "
            "buckets as [[(name, shape, dtype), ...], ...] in broadcast order"
        )
    out = []
    for bucket in specs:
        b = []
        for s in bucket:
            name, shape, dtype = (s.name, s.shape, s.dtype) if hasattr(s, "name") else s
            b.append((str(name), [int(x) for x in shape], str(dtype).removeprefix("torch.")))
        out.append(b)
    return out
