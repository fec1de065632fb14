"""Per-step figures of the inference side, from the engine's cumulative counters: how full the
servers' batches were and how many requests a weight update interrupted.

Why: with long, long-tailed answers a synchronous step waits for its longest sample while the
server's batch drains; the busy share and rows per batched step show that idle time, and the
interrupted requests (each resumed as prompt + tokens so far, docs/design.md "Weight versions")
show what asynchrony pays for it.
"""

from __future__ import annotations

import time

from arealite.api.engine_api import InferenceEngine


class ServerLoadMeter:
    """`step_stats()` once per step: the deltas since the previous call."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self.last, self.last_aborts, self.last_time = None, 0, time.monotonic()
        self.step_stats()  # the counters so far: the first step's deltas start here

    def _aborts(self) -> int:
        stats = getattr(self.engine, "stats", None)
        return stats().get("aborted_chunks", 0) if stats is not None else 0

    def step_stats(self) -> dict[str, float]:
        """rollout/interrupted_requests; with the embedded server also rollout/server_batch_rows
        (rows per batched step) and rollout/server_busy_frac (share of wall time in steps)."""
        load, aborts, now = self.engine.server_load(), self._aborts(), time.monotonic()
        stats = {"rollout/interrupted_requests": float(aborts - self.last_aborts)}
        if load is not None and self.last is not None:
            steps = load["decode_steps"] - self.last["decode_steps"]
            rows = load["batch_rows"] - self.last["batch_rows"]
            busy = load["busy_seconds"] - self.last["busy_seconds"]
            wall = max(now - self.last_time, 1e-9)
            stats["rollout/server_batch_rows"] = rows / steps if steps else 0.0
            stats["rollout/server_busy_frac"] = busy / load["servers"] / wall
        self.last, self.last_aborts, self.last_time = load, aborts, now
        return stats
