"""Weight updates of a remote inference client, and bringing a restarted server up to date.

An update pauses generation everywhere (in-flight requests come back aborted and wait), loads
the new weights on every live server (from disk, received over NCCL from trainer rank 0, or
opened from CUDA IPC handles of the trainer's tensors on a shared GPU),
then continues. A server that failed and came back rejoins only after it loaded the weights
last pushed, under the same lock, so no server ever serves an older version than the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Protocol

from arealite.api.cli_args import RolloutConfig
from arealite.api.io_struct import ParamSpec, WeightUpdateMeta
from arealite.inference.server_http import ServerError, ServerHTTP, parse_version
from arealite.inference.server_pool import NoServerAvailable, ServerPool

logger = logging.getLogger("arealite.remote")

# A weight load slower than this gets a log line at INFO. Quicker ones after the first (every
# step of a CPU run, in-memory GPU updates) go to DEBUG, where one a step would bury the
# progress lines; `timeperf/update_weights` records every load's seconds.
SLOW_LOAD_S = 1.0


class WeightClient(Protocol):
    """What weight updates need of their client (RemoteInferenceEngine): its servers and the
    backend's per-server weight endpoints. A Protocol, so this module never imports its owner."""

    config: RolloutConfig
    counters: Counter[str]
    gen_allowed: asyncio.Event | None
    http: ServerHTTP
    pool: ServerPool

    async def pause_server(self, addr: str) -> None: ...
    async def continue_server(self, addr: str) -> None: ...
    async def update_server_from_disk(self, addr: str, meta: WeightUpdateMeta) -> None: ...
    async def init_weights_group(
        self, addr: str, meta: WeightUpdateMeta, rank_offset: int, world_size: int
    ) -> None: ...
    async def update_server_from_distributed(
        self, addr: str, meta: WeightUpdateMeta, bucket: list[ParamSpec], last: bool
    ) -> None: ...
    async def update_server_from_tensor(
        self, addr: str, meta: WeightUpdateMeta, payload: str, last: bool
    ) -> None: ...
    async def server_tp_size(self, addr: str) -> int: ...


class WeightUpdates:
    """The weight state of one client: the version last pushed, the last update (what a
    re-admitted server loads) and the NCCL group the servers joined. Runs on the client's loop."""

    def __init__(self, client: WeightClient):
        self.client = client
        self.version = 0  # version last pushed to the servers
        self.last: WeightUpdateMeta | None = None
        self.seen_version = 0  # newest weight version a server reported to this client
        self._nccl_group: tuple | None = None
        self._lock: asyncio.Lock | None = None

    def on_loop_start(self) -> None:
        self._lock = asyncio.Lock()

    def saw_version(self, version: int) -> None:
        self.seen_version = max(self.seen_version, version)

    async def update(self, meta: WeightUpdateMeta) -> None:
        c = self.client
        assert self._lock is not None and c.gen_allowed is not None
        async with self._lock:
            start = time.perf_counter()
            c.gen_allowed.clear()
            try:
                if c.config.pause_grace_period > 0:
                    await asyncio.sleep(c.config.pause_grace_period)
                try:
                    await self._pause_and_load(meta)
                except (RuntimeError, NoServerAvailable) as e:
                    if meta.type != "disk" or c.pool.alive():
                        raise  # a server answered with an error: not a server death
                    logger.warning(  # the run goes on: each server loads them as it returns
                        "weights v%d not loaded now (%s); every server loads them from %s when "
                        "it is back, before it serves again",
                        meta.version,
                        e,
                        meta.path,
                    )
                self.version = meta.version
                self.last = meta
            finally:
                try:
                    if c.pool.alive():  # servers that return are continued by restore_server
                        await c.pool.on_servers("continue_generation", c.continue_server)
                finally:
                    c.gen_allowed.set()
            c.counters["weight_updates"] += 1
            seconds = time.perf_counter() - start
            quiet = c.counters["weight_updates"] > 1 and seconds < SLOW_LOAD_S
            logger.log(
                logging.DEBUG if quiet else logging.INFO,
                "weights v%d (%s) loaded on %d server(s) in %.2fs",
                meta.version,
                meta.type,
                len(c.pool.alive()),
                seconds,
            )

    async def _pause_and_load(self, meta: WeightUpdateMeta) -> None:
        c = self.client
        await c.pool.on_servers("pause_generation", c.pause_server)
        if meta.type == "disk":
            await c.pool.on_servers(
                f"update_weights_from_disk({meta.path})",
                lambda a: c.update_server_from_disk(a, meta),
            )
        elif meta.type == "tensor":
            for i, payload in enumerate(meta.tensor_payloads):
                last = i == len(meta.tensor_payloads) - 1
                await c.pool.on_servers(
                    "update_weights_from_tensor",
                    lambda a, p=payload, last=last: c.update_server_from_tensor(a, meta, p, last),
                )
        else:
            await self._update_nccl(meta)

    async def nccl_world_size(self) -> int:
        return (await self._nccl_layout())[0]

    async def _nccl_layout(self) -> tuple[int, dict[str, int]]:
        """(group size, each live server's first rank): trainer rank 0, then servers' TP ranks."""
        servers = self.client.pool.alive()
        tp = await asyncio.gather(*(self.client.server_tp_size(a) for a in servers))
        return 1 + sum(tp), {a: 1 + sum(tp[:i]) for i, a in enumerate(servers)}

    async def _update_nccl(self, meta: WeightUpdateMeta) -> None:
        """Join the trainer's NCCL group once per (address, port, name), then receive each
        bucket of parameters that trainer rank 0 broadcasts (GPU only)."""
        c = self.client
        buckets = meta.param_buckets()
        key = (meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name)
        if self._nccl_group != key:
            world_size, offsets = await self._nccl_layout()
            if meta.nccl_world_size and meta.nccl_world_size != world_size:
                raise ValueError(
                    f"meta.nccl_world_size={meta.nccl_world_size}, but the live servers make a "
                    f"group of {world_size} (trainer rank 0 + their TP ranks)"
                )
            await c.pool.on_servers(
                "init_weights_update_group",
                lambda a: c.init_weights_group(a, meta, offsets[a], world_size),
            )
            self._nccl_group = key
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            await c.pool.on_servers(
                "update_weights_from_distributed",
                lambda a, b=bucket, last=last: c.update_server_from_distributed(a, meta, b, last),
            )

    async def restore_server(self, addr: str) -> None:
        """A failed server is healthy again: load the weights last pushed (tagged with their
        version), match the others' pause state, return it to rotation. Under the update lock,
        so no weight update runs meanwhile."""
        c = self.client
        assert self._lock is not None and c.gen_allowed is not None
        async with self._lock:
            if addr not in c.pool.failed:
                return
            meta = self.last
            if meta is not None and meta.type != "disk":
                logger.warning(
                    "inference server %s is healthy again but cannot rejoin: its weights can only "
                    "be restored from disk, and the last update was %s",
                    addr,
                    meta.type,
                )
                return
            if meta is not None:
                await c.update_server_from_disk(addr, meta)
            elif not await self._serves_version(addr, self.seen_version):
                return  # a client that never pushed weights (e.g. an evaluator) waits for the
                # one that does to bring the restarted server up to date
            if c.gen_allowed.is_set():
                await c.continue_server(addr)
            else:  # generation is paused on the others (pause_generation): pause it too
                await c.pause_server(addr)
            c.pool.readmit(addr, f" with weights v{self.version}")

    async def _serves_version(self, addr: str, version: int) -> bool:
        """Whether `addr` reports weights at least `version` (True when it cannot tell)."""
        try:
            body = await self.client.http.call(addr, "GET", "/get_weight_version", timeout=5.0)
        except ServerError:
            return True
        served = parse_version(body.get("weight_version")) if isinstance(body, dict) else None
        return served is None or served >= version
