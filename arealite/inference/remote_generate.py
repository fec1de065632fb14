"""Interruptible generation of a remote inference client: requests resumed across aborts.

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

from arealite.api.cli_args import RolloutConfig
from arealite.api.io_struct import ModelRequest, ModelResponse, PartialResponse
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

    config: RolloutConfig
    counters: Counter[str]
    gen_allowed: asyncio.Event | None
    pool: ServerPool
    weights: WeightUpdates
    loaded_elsewhere: int

    def build_generate_payload(
        self, req: ModelRequest, input_ids: list[int], max_new_tokens: int, min_new_tokens: int
    ) -> tuple[str, dict[str, Any]]: ...
    def parse_generate_response(self, body: Any) -> GenerateChunk: ...
    def build_batch_payload(
        self, calls: list[tuple[ModelRequest, list[int], int, int]]
    ) -> tuple[str, dict[str, Any]]: ...


@dataclass
class Progress(PartialResponse):
    """What one request has generated so far, across the answers of its resumed calls."""

    idle_aborts: int = 0  # aborts in a row without a token while no weight update ran

    def add(self, c: GenerateClient, chunk: GenerateChunk, start: float) -> bool:
        """Append one answer; an abort leaves the request pending (resumed by the caller).
        True for an abort without a token while no weight update ran (the caller backs off)."""
        v = chunk.version if chunk.version is not None else c.weights.version
        c.weights.saw_version(v)
        if chunk.token_versions is None:
            versions = [v] * len(chunk.output_tokens)
        else:
            versions = [v if t is None else t for t in chunk.token_versions]
        self.extend(chunk.output_tokens, chunk.output_logprobs, versions, chunk.finish, start)
        if chunk.finish != "abort":
            return False
        c.counters["aborted_chunks"] += 1
        # Only aborts we did not cause (no weight update under way) count as suspicious.
        if chunk.output_tokens:
            self.idle_aborts = 0
        elif c.gen_allowed is not None and c.gen_allowed.is_set():
            self.idle_aborts += 1
            return True
        return False


async def generate_resumable(c: GenerateClient, req: ModelRequest) -> ModelResponse:
    """One request until its budget is spent or the server stops it."""
    return (await generate_group_resumable(c, [req]))[0]


async def generate_group_resumable(
    c: GenerateClient, reqs: list[ModelRequest]
) -> list[ModelResponse]:
    """Requests generated together, one batch call per round (the backend must take SGLang's
    batch form): a GRPO group costs one HTTP exchange, not n. An abort (weight update)
    resumes the unfinished ones as prompt + tokens so far once generation is allowed again."""
    start = time.perf_counter()
    progress = [Progress(r) for r in reqs]
    while pending := [p for p in progress if not p.done]:
        assert c.gen_allowed is not None
        await c.gen_allowed.wait()
        chunks, addr = await generate_chunks(c, pending)
        stuck = [p.idle_aborts for p, chunk in zip(pending, chunks) if p.add(c, chunk, start)]
        if stuck:
            await backoff_after_abort(c.config, pending[0].req.rid, addr, max(stuck))
    return [p.response(start) for p in progress]


async def generate_chunks(
    c: GenerateClient, pending: list[Progress]
) -> tuple[list[GenerateChunk], str]:
    """One generate call continuing each request with the rest of its budget (a batch call
    when there are several); (answers in order, server)."""
    calls = [
        (
            p.req,
            list(p.req.input_ids) + p.tokens,
            p.req.gconfig.max_new_tokens - len(p.tokens),
            max(0, p.req.gconfig.min_new_tokens - len(p.tokens)),
        )
        for p in pending
    ]
    if len(calls) == 1:
        path, payload = c.build_generate_payload(*calls[0])
    else:
        path, payload = c.build_batch_payload(calls)
    # Every live server loaded this version before the request went out: a server answering
    # with older weights restarted behind our back. Take it out (it is restored before it
    # rejoins) and generate elsewhere; each retry removes a server, so this ends.
    expected = max(c.weights.version, c.loaded_elsewhere)
    while True:
        body, addr = await c.pool.post_with_failover(pending[0].req.rid, path, payload)
        chunks = parse_answers(c, body, len(calls))
        c.counters["generate_calls"] += 1
        # Judged on tokens only: an answer without any has nothing stale to keep out.
        stale = [
            ch.version
            for ch in chunks
            if ch.output_tokens and ch.version is not None and ch.version < expected
        ]
        if not stale:
            return chunks, addr
        reason = f"it serves weights v{min(stale)}, older than v{expected} (restarted?)"
        c.pool.mark_failed(addr, reason)


def parse_answers(c: GenerateClient, body: Any, n: int) -> list[GenerateChunk]:
    """A single answer, or a batch call's list of n."""
    if n == 1:
        return [c.parse_generate_response(body)]
    if not isinstance(body, list) or len(body) != n:
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise ValueError(f"/generate batch of {n} prompts answered with {got}")
    return [c.parse_generate_response(b) for b in body]


async def backoff_after_abort(config: RolloutConfig, rid: str, addr: str, idle_aborts: int) -> None:
    """Aborts without progress while we are not updating weights mean someone else is
    aborting us: back off, and give up rather than spin forever."""
    limit = 5 + config.request_retries
    if idle_aborts > limit:
        raise RuntimeError(
            f"request {rid}: server {addr} aborted it {idle_aborts} times in a row without "
            "generating a token, and no weight update was in progress"
        )
    await asyncio.sleep(min(2.0, 0.05 * 2**idle_aborts))
