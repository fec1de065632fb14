"""The inference client shared by remote backends (SGLang's protocol, vLLM).

`RemoteInferenceEngine` owns an event loop thread where its HTTP session (`server_http.py`) and
its server pool (`server_pool.py`: routing, fail-over, re-admission) live. On top it does what an
RL trainer needs from generation: interruptible generation (`remote_generate.py`: an aborted
request is resubmitted as prompt + tokens so far with the remaining budget once the pause lifts;
every token records the weight version that produced it) and the pause -> load -> continue
choreography of weight updates (`remote_weights.py`).

What differs between servers is isolated in a few methods a subclass overrides:
`build_generate_payload`, `parse_generate_response`, `pause_server`, `continue_server`,
`update_server_from_disk`, `init_weights_group`, `update_server_from_distributed` and
`server_tp_size` (and the class attribute `health_path`).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import Counter
from typing import Any

from arealite.api.cli_args import RolloutConfig
from arealite.api.engine_api import InferenceEngine
from arealite.api.io_struct import ModelRequest, ModelResponse, ParamSpec, WeightUpdateMeta
from arealite.inference.remote_generate import (
    GenerateChunk,
    generate_group_resumable,
    generate_resumable,
)
from arealite.inference.remote_weights import WeightUpdates
from arealite.inference.server_http import ServerError, ServerHTTP, ServerUnavailable, parse_version
from arealite.inference.server_pool import NoServerAvailable, ServerPool, resolve_addresses
from arealite.utils.loop_thread import LoopThread

__all__ = [
    "GenerateChunk",
    "NoServerAvailable",
    "RemoteInferenceEngine",
    "ServerError",
    "ServerUnavailable",
    "parse_version",
]

logger = logging.getLogger("arealite.remote")

COUNTER_KEYS = (
    "generate_calls",  # HTTP generate calls (a resumed request makes several)
    "aborted_chunks",  # answers that came back aborted and were resubmitted
    "failovers",  # requests moved to another server
    "http_retries",
    "servers_removed",
    "servers_readmitted",
    "weight_updates",
)


class RemoteInferenceEngine(InferenceEngine):
    """An InferenceEngine over HTTP to a list of servers; subclasses speak one server's API."""

    health_path = "/health"
    batch_generate = False  # the server answers SGLang's batch form (see build_batch_payload)

    def __init__(self, config: RolloutConfig):
        self.config = config
        # All keys up front: stats() may copy this from another thread while the loop counts.
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTER_KEYS, 0))
        self._load_unsupported = False  # the servers' /metrics lack the embedded server's series
        self.http = ServerHTTP(
            config.request_timeout, config.request_retries, config.api_key, self.counters
        )
        self.pool = ServerPool([], self.http, self.counters, self.health_path, config.setup_timeout)
        self.weights = WeightUpdates(self)
        self._loop = LoopThread("arealite-inference-client")
        self._version = 0  # policy version (set by the trainer; the staleness bound reads it)
        self.loaded_elsewhere = 0  # newest version another client loaded on every server
        # Set while generation may run; cleared during weight updates and pause_generation.
        self.gen_allowed: asyncio.Event | None = None

    # ============================================================ server-specific hooks

    @abc.abstractmethod
    def build_generate_payload(
        self, req: ModelRequest, input_ids: list[int], max_new_tokens: int, min_new_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one generate call continuing `input_ids`."""

    @abc.abstractmethod
    def parse_generate_response(self, body: Any) -> GenerateChunk:
        """Tokens, logprobs, finish type and version out of one generate answer."""

    def build_batch_payload(
        self, calls: list[tuple[ModelRequest, list[int], int, int]]
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one call generating for several requests, each given as
        build_generate_payload's arguments; only where `batch_generate`."""
        raise NotImplementedError(f"{type(self).__name__} has no batch generate call")

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
        self, addr: str, meta: WeightUpdateMeta, bucket: list[ParamSpec], last: bool
    ) -> None:
        """Receive one bucket of tensors broadcast by trainer rank 0."""
        raise NotImplementedError(f"{type(self).__name__} has no NCCL weight-update path")

    async def server_tp_size(self, addr: str) -> int:
        """Ranks one server occupies in the NCCL group."""
        return 1

    # ============================================================ lifecycle

    def initialize(self, addr: str | list[str] | None = None) -> None:
        """Resolve server addresses (argument, config.server_addrs, or $AREAL_LLM_SERVER_ADDRS),
        start the client's loop and wait up to `setup_timeout` for every server to be healthy."""
        self.pool.addresses = resolve_addresses(addr, self.config.server_addrs)
        self._loop.add_shutdown_hook(self.http.close)
        self._loop.start()
        try:
            self._loop.run(self._setup()).result()
        except BaseException:
            self.destroy()
            raise
        logger.info("connected to %d inference server(s): %s", len(self.addresses), self.addresses)

    async def _setup(self) -> None:
        self.gen_allowed = asyncio.Event()
        self.gen_allowed.set()
        self.weights.on_loop_start()
        await self.pool.wait_all_healthy(self.config.setup_timeout)
        # Cancelled with the loop's other tasks at destroy.
        asyncio.ensure_future(self.pool.readmit_loop(self.weights.restore_server))

    def destroy(self) -> None:
        """Cancel requests in flight, close the HTTP session, stop the client's loop."""
        self._loop.stop()

    def run_coroutine(self, coro) -> Any:
        """Run `coro` on the client's loop (where its session lives); a concurrent Future."""
        return self._loop.run(coro)

    @property
    def addresses(self) -> list[str]:
        return self.pool.addresses

    @property
    def failed(self) -> dict[str, str]:
        """Servers out of rotation, with the reason."""
        return self.pool.failed

    # ============================================================ versions and stats

    def set_version(self, version: int) -> None:
        self._version = version

    def expect_weight_version(self, version: int) -> None:
        """Another client (the trainer's) finished loading `version` on every live server: from
        now on an answer with older weights comes from a server restarted behind our back."""
        self.loaded_elsewhere = max(self.loaded_elsewhere, version)
        self.weights.saw_version(version)

    def get_version(self) -> int:
        return self._version

    @property
    def weight_version(self) -> int:
        """Version of the weights last pushed to the servers (tags tokens when the server
        does not report its own)."""
        return self.weights.version

    def server_load(self) -> dict[str, float] | None:
        """The embedded servers' batching counters from their /metrics, summed. None when a
        server does not serve them (SGLang and vLLM name theirs differently: not asked again)
        or a call failed (a dashboard figure must never stop training; asked again next time)."""
        if self._load_unsupported:
            return None
        try:
            texts = self.run_coroutine(self._all_metrics()).result(timeout=10)
        except Exception as e:
            logger.debug("server_load: %s", e)
            return None
        loads = [parse_server_load(t) for t in texts]
        if not loads or any(load is None for load in loads):
            self._load_unsupported = bool(loads)
            return None
        return {k: sum(load[k] for load in loads) for k in loads[0]} | {"servers": len(loads)}

    async def _all_metrics(self) -> list[str]:
        return list(
            await asyncio.gather(
                *(self.http.call(a, "GET", "/metrics", timeout=2) for a in self.addresses)
            )
        )

    def stats(self) -> dict[str, int]:
        """Client events: generate_calls, aborted_chunks, failovers, ... and servers_failed."""
        return {**self.counters, "servers_failed": len(self.failed)}

    # ============================================================ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request (n_samples must be 1). Called from any event loop; the HTTP
        work always runs on the client's loop, which owns the session and the pause state."""
        self._validate_request(req)
        if asyncio.get_running_loop() is self._loop.loop:
            return await generate_resumable(self, req)
        return await asyncio.wrap_future(self._loop.run(generate_resumable(self, req)))

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        """Generate for several requests (a GRPO group): one batch call per round where the
        server takes SGLang's batch form (`batch_generate`), else concurrent single calls;
        either way one hop to the client's loop."""
        for req in reqs:
            self._validate_request(req)
        if asyncio.get_running_loop() is self._loop.loop:
            return await self._generate_group(reqs)
        return await asyncio.wrap_future(self._loop.run(self._generate_group(reqs)))

    async def _generate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        if self.batch_generate and len(reqs) > 1:
            return await generate_group_resumable(self, reqs)
        return list(await asyncio.gather(*(generate_resumable(self, r) for r in reqs)))

    def _validate_request(self, req: ModelRequest) -> None:
        if req.gconfig.n_samples != 1:
            raise ValueError(
                f"agenerate produces one sample, got gconfig.n_samples={req.gconfig.n_samples}; "
                "call it n times with gconfig.new(n_samples=1) (as RLVRWorkflow does)"
            )
        if not req.input_ids:
            raise ValueError(f"ModelRequest {req.rid}: input_ids is empty")

    # ============================================================ weights and pausing

    def update_weights(self, meta: WeightUpdateMeta):
        """Pause every server (in-flight requests come back aborted and wait), load the new
        weights, continue. For NCCL, the trainer must broadcast while this future is pending."""
        return self._loop.run(self.weights.update(meta))

    def nccl_world_size(self) -> int:
        """1 (trainer rank 0) + every live server's tensor-parallel ranks: the size of the NCCL
        weight-update group, for `WeightUpdateMeta.nccl_world_size`."""
        return self._loop.run(self.weights.nccl_world_size()).result()

    def pause_generation(self) -> None:
        """Stop generation on every server (in-flight requests aborted, or frozen with
        `pause_mode: in_place`) and hold new ones until `continue_generation` (for callers
        that swap weights themselves)."""
        self._loop.run(self._pause_generation()).result()

    async def _pause_generation(self) -> None:
        assert self.gen_allowed is not None
        self.gen_allowed.clear()
        await self.pool.on_servers("pause_generation", self.pause_server)

    def continue_generation(self) -> None:
        self._loop.run(self._continue_generation()).result()

    async def _continue_generation(self) -> None:
        assert self.gen_allowed is not None
        try:
            await self.pool.on_servers("continue_generation", self.continue_server)
        finally:
            self.gen_allowed.set()


_LOAD_SERIES = {
    "arealite_decode_steps_total": "decode_steps",
    "arealite_step_batch_size_sum": "batch_rows",
    "arealite_busy_seconds_total": "busy_seconds",
}


def parse_server_load(text: Any) -> dict[str, float] | None:
    """decode_steps / batch_rows / busy_seconds from the embedded server's Prometheus text."""
    if not isinstance(text, str):
        return None
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _LOAD_SERIES:
            found[_LOAD_SERIES[name]] = float(value)
    return found if len(found) == len(_LOAD_SERIES) else None
