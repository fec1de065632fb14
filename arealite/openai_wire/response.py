"""The OpenAI chat-completions response side: cutting a generation at its stop strings, the
`choice` (content or tool calls, logprobs), the completion body, the stream chunks and their
server-sent events, and error bodies. The request side is `request.py`.

Everything here works on plain dicts (no `openai` import), so the server does not need the SDK.
"""

from __future__ import annotations

import json
import time
from typing import Any

from arealite.openai_wire.request import ChatRequest
from arealite.openai_wire.tool_calls import parse_tool_calls


def cut_at_stop(tokenizer: Any, ids: list[int], stops: list[str], skip_special: bool = True):
    """(number of tokens to keep, text before the first stop string) or None if none occurs.

    The kept tokens end with the token that completed the stop string: they are exactly what
    was sampled (a prefix of the generation), so they stay valid training tokens.
    """
    if not stops:
        return None
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return None
    at, stop = min(hits)
    for n in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:n], skip_special_tokens=skip_special)) >= at + len(stop):
            return n, text[:at]
    return len(ids), text[:at]


TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


def _logprob_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def token_logprobs(
    tokenizer: Any,
    ids: list[int],
    logprobs: list[float],
    top: list[TopLogprobs] | None = None,
) -> dict[str, Any]:
    """OpenAI `choice.logprobs`: one entry per generated token, with its `top` alternatives
    when they were computed (`top_logprobs` requested), else an empty list."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, logprobs)):
        entry = _logprob_entry(tokenizer, t, lp)
        alternatives = top[i] if top is not None and i < len(top) else []
        entry["top_logprobs"] = [_logprob_entry(tokenizer, a, alp) for a, alp in alternatives]
        content.append(entry)
    return {"content": content, "refusal": None}


def build_choice(
    tokenizer: Any,
    req: ChatRequest,
    index: int,
    output_ids: list[int],
    output_logprobs: list[float],
    finish: str,
    parser: str | None,
    output_top_logprobs: list[TopLogprobs] | None = None,
) -> tuple[dict[str, Any], int]:
    """One OpenAI choice from generated tokens, and how many of them it keeps (stop strings
    end a choice at the token that completed them)."""
    cut = cut_at_stop(tokenizer, output_ids, req.stop)
    if cut is not None:
        kept, text = cut
        finish = "stop"
    else:
        kept, text = len(output_ids), tokenizer.decode(output_ids, skip_special_tokens=True)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parser is not None:
        content, calls = parse_tool_calls(text, parser)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = "tool_calls" if finish == "stop" else finish
    choice = {
        "index": index,
        "message": message,
        "finish_reason": finish,
        "logprobs": (
            token_logprobs(
                tokenizer, output_ids[:kept], output_logprobs[:kept], output_top_logprobs
            )
            if req.logprobs
            else None
        ),
    }
    return choice, kept


def completion_body(
    completion_id: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "system_fingerprint": None,
    }


def chunk_body(
    completion_id: str, model: str, created: int, choices: list[dict], usage=None
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def delta_choice(index: int, delta: dict, finish_reason=None, logprobs=None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_chunks(body: dict[str, Any], include_usage: bool = False) -> list[dict[str, Any]]:
    """A finished completion as the chunk sequence a streaming client expects."""
    cid, model, created = body["id"], body["model"], body["created"]
    chunks = []
    for c in body["choices"]:
        i, msg = c["index"], c["message"]
        chunks.append(
            chunk_body(cid, model, created, [delta_choice(i, {"role": "assistant", "content": ""})])
        )
        if msg.get("content"):
            delta = delta_choice(i, {"content": msg["content"]}, logprobs=c.get("logprobs"))
            chunks.append(chunk_body(cid, model, created, [delta]))
        if msg.get("tool_calls"):
            calls = [{"index": j, **call} for j, call in enumerate(msg["tool_calls"])]
            chunks.append(chunk_body(cid, model, created, [delta_choice(i, {"tool_calls": calls})]))
        chunks.append(chunk_body(cid, model, created, [delta_choice(i, {}, c["finish_reason"])]))
    if include_usage:
        chunks.append(chunk_body(cid, model, created, [], usage=body["usage"]))
    return chunks


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (`data: [DONE]` ends an OpenAI stream)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error"):
    """OpenAI's error shape, which every OpenAI client knows how to surface."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
