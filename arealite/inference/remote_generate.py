"""Interruptible generation of a remote inference client: one request, resumed across aborts.

A weight update aborts in-flight generation; the request is resubmitted as prompt + tokens so
far with the remaining budget once generation is allowed again, and every token records the
weight version that produced it. A server answering with weights older than every live server
loaded restarted behind our back: it is taken out and the call goes elsewhere. Aborts nobody
here caused are backed off and, repeated without progress, given up on.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from arealite.api.cli_args import InferenceEngineConfig
from arealite.api.io_struct import ModelRequest, ModelResponse
from arealite.inference.remote_weights import WeightUpdates
from arealite.inference.server_pool import ServerPool


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


class GenerateClient(Protocol):
    """What generation needs of its client (RemoteInferenceEngine): its servers, weight state
    and the backend's payload format. A Protocol, so this module never imports its owner."""

    config: InferenceEngineConfig
    counters: Counter[str]
    gen_allowed: asyncio.Event | None
    pool: ServerPool
    weights: WeightUpdates
    loaded_elsewhere: int

    def build_generate_payload(
        self, req: ModelRequest, input_ids: list[int], max_new_tokens: int, min_new_tokens: int
    ) -> tuple[str, dict[str, Any]]: ...
    def parse_generate_response(self, body: Any) -> GenerateChunk: ...


async def generate_resumable(c: GenerateClient, req: ModelRequest) -> ModelResponse:
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
        assert c.gen_allowed is not None
        await c.gen_allowed.wait()
        chunk, addr = await generate_chunk(c, req, tokens)
        if chunk.output_tokens and ttft == float("inf"):
            ttft = time.perf_counter() - start
        v = chunk.version if chunk.version is not None else c.weights.version
        c.weights.saw_version(v)
        tokens += chunk.output_tokens
        logprobs += chunk.output_logprobs
        if chunk.token_versions is None:
            versions += [v] * len(chunk.output_tokens)
        else:
            versions += [v if t is None else t for t in chunk.token_versions]
        if chunk.finish != "abort":
            stop_reason = chunk.finish
            break
        c.counters["aborted_chunks"] += 1
        # Only aborts we did not cause (no weight update under way) count as suspicious.
        if chunk.output_tokens:
            idle_aborts = 0
        elif c.gen_allowed.is_set():
            idle_aborts += 1
            await backoff_after_abort(c.config, req.rid, addr, idle_aborts)
    return ModelResponse(
        input_tokens=list(req.input_ids),
        output_tokens=tokens,
        output_logprobs=logprobs,
        output_versions=versions,
        stop_reason=stop_reason,  # type: ignore[arg-type]
        latency=time.perf_counter() - start,
        ttft=ttft,
    )


async def generate_chunk(
    c: GenerateClient, req: ModelRequest, tokens: list[int]
) -> tuple[GenerateChunk, str]:
    """One generate call continuing `tokens` with the rest of the budget; (answer, server)."""
    g = req.gconfig
    path, payload = c.build_generate_payload(
        req,
        list(req.input_ids) + tokens,
        g.max_new_tokens - len(tokens),
        max(0, g.min_new_tokens - len(tokens)),
    )
    # Every live server loaded this version before the request went out: a server answering
    # with older weights restarted behind our back. Take it out (it is restored before it
    # rejoins) and generate elsewhere; each retry removes a server, so this ends.
    expected = max(c.weights.version, c.loaded_elsewhere)
    while True:
        body, addr = await c.pool.post_with_failover(req.rid, path, payload)
        chunk = c.parse_generate_response(body)
        c.counters["generate_calls"] += 1
        # Judged on tokens only: an answer without any has nothing stale to keep out.
        if not chunk.output_tokens or chunk.version is None or chunk.version >= expected:
            return chunk, addr
        reason = f"it serves weights v{chunk.version}, older than v{expected} (restarted?)"
        c.pool.mark_failed(addr, reason)


async def backoff_after_abort(
    config: InferenceEngineConfig, rid: str, addr: str, idle_aborts: int
) -> None:
    """Aborts without progress while we are not updating weights mean someone else is
    aborting us: back off, and give up rather than spin forever."""
    limit = 5 + config.request_retries
    if idle_aborts > limit:
        raise RuntimeError(
            f"request {rid}: server {addr} aborted it {idle_aborts} times in a row without "
            "generating a token, and no weight update was in progress"
        )
    await asyncio.sleep(min(2.0, 0.05 * 2**idle_aborts))
