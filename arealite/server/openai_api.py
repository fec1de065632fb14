"""OpenAI-compatible `POST /v1/chat/completions` and `GET /v1/models` on the embedded server.

For evaluation and debugging with any OpenAI client (SGLang and vLLM serve the same routes).
The model's own chat template renders messages and tools; tool calls in the output come back
as `tool_calls`. A choice interrupted by `pause_generation` (a weight update) is continued from
its tokens once generation resumes, so clients never see the abort. Errors use OpenAI's shape
`{"error": {"message", "type", "param"}}` with `param` naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace

from aiohttp import web

from arealite.openai_wire.request import (
    ChatRequest,
    ChatRequestError,
    encode_text,
    parse_chat_request,
    render_prompt,
    tool_parser_for,
)
from arealite.openai_wire.response import (
    build_choice,
    chunk_body,
    completion_body,
    completion_chunks,
    cut_at_stop,
    delta_choice,
    error_body,
    sse_event,
)
from arealite.server.model_runner import ModelRunner, Sequence
from arealite.server.protocol import BadRequest, GenerateRequest, SamplingParams, decode_json_body
from arealite.server.scheduler import Scheduler

logger = logging.getLogger("arealite.server")

MAX_RESUBMITS = 50  # pause/continue cycles one choice survives
STREAM_POLL_S = 0.02


def _openai_error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, param), status=status)


class _Choice:
    """One choice's generation; its tokens accumulate across resubmissions after aborts."""

    def __init__(
        self, api: OpenAIChatAPI, prompt_ids: list[int], params: SamplingParams, top: int = 0
    ):
        self.api, self.prompt_ids, self.params = api, prompt_ids, params
        self.top = top  # top_logprobs asked for (0: none computed)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish = "length"
        self.seq: Sequence | None = None

    def snapshot(self) -> list[int]:
        """Tokens so far (read from the scheduler thread's list without locking: appends only)."""
        running = list(self.seq.output_ids) if self.seq is not None else []
        return self.ids + running

    def stop_early(self) -> None:
        if self.seq is not None:
            self.api.scheduler.abort_sequence(self.seq)

    async def run(self) -> None:
        for _ in range(MAX_RESUBMITS):
            left = self.params.max_new_tokens - len(self.ids)
            req = GenerateRequest(
                rid=uuid.uuid4().hex,
                input_ids=self.prompt_ids + self.ids,
                params=_replace_budget(self.params, left),
                return_logprob=True,
            )
            self.seq = seq = self.api.runner.new_sequence(req)
            seq.top_logprobs = self.top
            fut = self.api.scheduler.submit(seq)
            try:
                seq = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:
                self.api.scheduler.abort_sequence(seq)
                raise
            self.ids += seq.output_ids
            self.logprobs += seq.output_logprobs
            self.top_logprobs += seq.output_top_logprobs
            self.seq = None
            self.finish = seq.finish_reason["type"]
            if self.finish != "abort" or not self.api.scheduler.paused:
                break
            if len(self.ids) >= self.params.max_new_tokens:
                self.finish = "length"
                break
            while self.api.scheduler.paused:  # resubmitted work would be held anyway
                await asyncio.sleep(STREAM_POLL_S)
        if self.finish == "abort":
            self.finish = "stop"  # stopped on purpose (stop string / abort_request): not an error


def _replace_budget(p: SamplingParams, max_new_tokens: int) -> SamplingParams:
    return replace(p, max_new_tokens=max_new_tokens, min_new_tokens=0)


class OpenAIChatAPI:
    """The /v1 routes, generating through the same scheduler as /generate."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, model_name: str):
        self.runner = runner
        self.scheduler = scheduler
        self.model_name = model_name

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "arealite"}
        return web.json_response({"object": "list", "data": [card]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            req = parse_chat_request(decode_json_body(await request.read()))
            parser = tool_parser_for(self.runner.tokenizer, req)
            prompt_ids = encode_text(
                self.runner.tokenizer, render_prompt(self.runner.tokenizer, req)
            )
            params = [self._sampling_params(req, len(prompt_ids), i) for i in range(req.n)]
        except ChatRequestError as e:
            return _openai_error(400, str(e), e.param)
        except BadRequest as e:
            return _openai_error(400, str(e), "body")
        choices = [_Choice(self, prompt_ids, p, req.top_logprobs) for p in params]
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream and not (req.logprobs or parser):
            return await self._stream_incremental(request, req, choices, cid)
        await asyncio.gather(*(c.run() for c in choices))
        body = self._completion(req, parser, choices, cid, len(prompt_ids))
        if not req.stream:
            return web.json_response(body)
        # logprobs / tool calls: parsed from the whole output, then sent as chunks
        resp = await self._open_stream(request)
        for chunk in completion_chunks(body, req.include_usage):
            await resp.write(sse_event(chunk))
        await resp.write(sse_event("[DONE]"))
        await resp.write_eof()
        return resp

    def _sampling_params(self, req: ChatRequest, prompt_len: int, index: int) -> SamplingParams:
        room = self.runner.max_positions - prompt_len
        if room < 1:
            raise ChatRequestError(
                "messages",
                f"the prompt ({prompt_len} tokens) fills the context length {self.runner.max_positions}",
            )
        max_new = req.max_tokens if req.max_tokens is not None else room
        if max_new > room:
            raise ChatRequestError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({max_new}) exceeds the context "
                f"length {self.runner.max_positions}",
            )
        stop_ids = []
        for s in req.stop:
            ids = encode_text(self.runner.tokenizer, s)
            if len(ids) == 1:  # a one-token stop string stops generation on the spot
                stop_ids.append(ids[0])
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            stop_token_ids=tuple(stop_ids),
            seed=req.choice_seed(index),
        )

    def _completion(self, req, parser, choices: list[_Choice], cid: str, prompt_len: int) -> dict:
        built, used = [], 0
        for i, c in enumerate(choices):
            choice, kept = build_choice(
                self.runner.tokenizer, req, i, c.ids, c.logprobs, c.finish, parser, c.top_logprobs
            )
            built.append(choice)
            used += kept
        return completion_body(cid, req.model or self.model_name, built, prompt_len, used)

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        return resp

    async def _stream_incremental(self, request, req: ChatRequest, choices, cid: str):
        """Text deltas as tokens arrive (polled from the running sequences)."""
        model, created = req.model or self.model_name, int(time.time())
        resp = await self._open_stream(request)
        tasks = [asyncio.ensure_future(c.run()) for c in choices]
        try:
            for i in range(len(choices)):
                delta = delta_choice(i, {"role": "assistant", "content": ""})
                await resp.write(sse_event(chunk_body(cid, model, created, [delta])))
            sent = [0] * len(choices)
            while True:
                done = all(t.done() for t in tasks)
                for i, c in enumerate(choices):
                    text, final = self._visible_text(req, c, tasks[i].done())
                    if len(text) > sent[i]:
                        delta = delta_choice(i, {"content": text[sent[i] :]})
                        await resp.write(sse_event(chunk_body(cid, model, created, [delta])))
                        sent[i] = len(text)
                if done:
                    break
                await asyncio.sleep(STREAM_POLL_S)
            await self._finish_stream(resp, req, choices, cid, model, created)
        finally:
            for t in tasks:
                t.cancel()
        return resp

    def _visible_text(self, req: ChatRequest, c: _Choice, finished: bool) -> tuple[str, bool]:
        """The text that may be sent so far: nothing past a stop string, and while running,
        nothing that a stop string could still claim or that ends in a partial character."""
        ids = c.ids if finished else c.snapshot()
        cut = cut_at_stop(self.runner.tokenizer, ids, req.stop)
        if cut is not None:
            if not finished:
                c.stop_early()
            return cut[1], True
        text = self.runner.tokenizer.decode(ids, skip_special_tokens=True)
        if finished:
            return text, True
        hold = max((len(s) - 1 for s in req.stop), default=0)
        text = text[: len(text) - hold] if hold else text
        return text.rstrip("\ufffd"), False

    async def _finish_stream(self, resp, req, choices, cid, model, created) -> None:
        used = 0
        for i, c in enumerate(choices):
            choice, kept = build_choice(
                self.runner.tokenizer, req, i, c.ids, c.logprobs, c.finish, None
            )
            used += kept
            delta = delta_choice(i, {}, choice["finish_reason"])
            await resp.write(sse_event(chunk_body(cid, model, created, [delta])))
        if req.include_usage:
            n_prompt = len(choices[0].prompt_ids)
            usage = {
                "prompt_tokens": n_prompt,
                "completion_tokens": used,
                "total_tokens": n_prompt + used,
            }
            await resp.write(sse_event(chunk_body(cid, model, created, [], usage=usage)))
        await resp.write(sse_event("[DONE]"))
        await resp.write_eof()
