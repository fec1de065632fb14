"""The OpenAI chat-completions wire format, shared by the embedded server's `/v1` endpoint and
the training client (arealite/agent): request validation, prompt rendering through the model's
own chat template, and the response / stream-chunk bodies.

Everything here works on plain dicts (no `openai` import), so the server does not need the SDK.
Every malformed request raises `ChatRequestError` naming the offending field (`param`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from arealite.utils.tool_calls import ToolParserError, parse_tool_calls, parser_for_template

MAX_N = 64
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields accepted only at their neutral value (honouring them is not implemented).
_NEUTRAL = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "parallel_tool_calls": (True,),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
}
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options"}
_KNOWN = {
    "messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "max_tokens",
    "max_completion_tokens", "n", "stop", "seed", "logprobs", "top_logprobs", "stream",
}  # fmt: skip


class ChatRequestError(ValueError):
    """A client error in a chat-completions request; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class ChatRequest:
    """A validated chat-completions request, messages in the form chat templates expect."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # None: tools not rendered, output not parsed
    n: int = 1
    max_tokens: int | None = None  # None: the caller's default
    temperature: float | None = None  # None: the caller's default
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # most likely tokens per position (only with logprobs)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None

    def choice_seed(self, index: int) -> int | None:
        """Per-choice seeds: the n choices of one seeded request must differ."""
        if self.seed is None:
            return None
        digest = hashlib.blake2b(json.dumps([self.seed, index]).encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "big") >> 1


def _dump(v: Any) -> str:
    try:
        return json.dumps(v)[:60]
    except (TypeError, ValueError):
        return repr(v)[:60]


def _number(body: dict, key: str, low: float, high: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ChatRequestError(key, f"expected a number, got {_dump(v)}")
    if not low <= v <= high:
        raise ChatRequestError(key, f"must be in [{low}, {high}], got {v}")
    return float(v)


def _integer(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ChatRequestError(key, f"expected an integer, got {_dump(v)}")
    if v < low or (high is not None and v > high):
        raise ChatRequestError(
            key, f"must be in [{low}, {high if high is not None else 'inf'}], got {v}"
        )
    return v


def _check_fields(body: dict) -> None:
    for key, value in body.items():
        if key in _KNOWN or key in _IGNORED or value is None:
            continue
        if key in _NEUTRAL:
            if value in _NEUTRAL[key]:
                continue
            raise ChatRequestError(key, f"value {_dump(value)} is not supported by this server")
        raise ChatRequestError(key, "unknown field")


def _text_content(content: Any, param: str) -> str:
    """OpenAI content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatRequestError(param, f"expected a string or a list of parts, got {_dump(content)}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatRequestError(f"{param}[{i}]", f"only text parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ChatRequestError(f"{param}[{i}].text", "expected a string")
        texts.append(part["text"])
    return "".join(texts)


def _tool_call_for_template(call: Any, param: str) -> dict[str, Any]:
    """OpenAI's JSON-string `arguments` become a dict: templates `tojson` them themselves."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ChatRequestError(param, "expected {'type': 'function', 'function': {...}}")
    fn = call["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatRequestError(f"{param}.function.name", "required (a string)")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatRequestError(
                f"{param}.function.arguments", f"not valid JSON ({e.msg})"
            ) from None
    if not isinstance(args, dict):
        raise ChatRequestError(f"{param}.function.arguments", "expected a JSON object")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def normalize_message(msg: Any, i: int) -> dict[str, Any]:
    """One OpenAI message (dict or SDK object) -> the dict chat templates render."""
    p = f"messages[{i}]"
    if hasattr(msg, "model_dump"):
        msg = msg.model_dump(exclude_none=True)
    if not isinstance(msg, dict):
        raise ChatRequestError(p, f"expected an object, got {_dump(msg)}")
    role = msg.get("role")
    if role not in ROLES:
        raise ChatRequestError(
            f"{p}.role", f"unknown role {_dump(role)}; expected one of {list(ROLES)}"
        )
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text_content(msg.get("content"), f"{p}.content"),
    }
    calls = msg.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise ChatRequestError(f"{p}.tool_calls", "a list, on assistant messages only")
        out["tool_calls"] = [
            _tool_call_for_template(c, f"{p}.tool_calls[{j}]") for j, c in enumerate(calls)
        ]
    if role == "tool":
        if not isinstance(msg.get("tool_call_id"), str):
            raise ChatRequestError(f"{p}.tool_call_id", "required on tool messages")
        out["tool_call_id"] = msg["tool_call_id"]
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    return out


def _tools(body: dict) -> list[dict[str, Any]] | None:
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ChatRequestError(
            "tool_choice",
            f"{_dump(choice)} is not supported (no constrained decoding); use 'auto' or 'none'",
        )
    tools = body.get("tools")
    if tools is None or tools == [] or choice == "none":
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools", f"expected a list of tools, got {_dump(tools)}")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ChatRequestError(f"tools[{i}].type", "only 'function' tools are supported")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatRequestError(f"tools[{i}].function.name", "required (a string)")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ChatRequestError(
                f"tools[{i}].function.parameters", "expected a JSON schema object"
            )
    return tools


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise ChatRequestError("stop", "expected a non-empty string or a list of up to 4")
    return stops


def parse_chat_request(body: Any) -> ChatRequest:
    """A chat-completions body (dict) -> ChatRequest, or ChatRequestError naming the field."""
    if not isinstance(body, dict):
        raise ChatRequestError("body", f"expected a JSON object, got {type(body).__name__}")
    _check_fields(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages", "required (a non-empty list of messages)")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ChatRequestError("logprobs", f"expected true or false, got {_dump(logprobs)}")
    top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise ChatRequestError("top_logprobs", "needs logprobs: true")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ChatRequestError("stream", f"expected true or false, got {_dump(stream)}")
    opts = body.get("stream_options") or {}
    top_k = _integer(body, "top_k", -1)
    return ChatRequest(
        messages=[normalize_message(m, i) for i, m in enumerate(messages)],
        tools=_tools(body),
        n=_integer(body, "n", 1, MAX_N) or 1,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 1e-9, 1.0),
        top_k=None if top_k in (None, 0, -1) else top_k,
        stop=_stop(body),
        seed=_integer(body, "seed", 0, (1 << 63) - 1),
        logprobs=bool(logprobs),
        top_logprobs=top_logprobs,
        stream=bool(stream),
        include_usage=isinstance(opts, dict) and bool(opts.get("include_usage")),
        model=body.get("model") if isinstance(body.get("model"), str) else None,
    )


def tool_parser_for(tokenizer: Any, req: ChatRequest, requested: str = "auto") -> str | None:
    """The tool-call parser for this request (None without tools); ChatRequestError('tools')
    when the model's template cannot render or parse tool calls."""
    if req.tools is None:
        return None
    try:
        return parser_for_template(getattr(tokenizer, "chat_template", None), requested)
    except ToolParserError as e:
        raise ChatRequestError("tools", str(e)) from None


def render_prompt(tokenizer: Any, req: ChatRequest, **template_kwargs) -> str:
    """The prompt text: the model's own chat template over messages and tools."""
    kwargs = {"tools": req.tools} if req.tools is not None else {}
    try:
        return tokenizer.apply_chat_template(
            req.messages, tokenize=False, add_generation_prompt=True, **kwargs, **template_kwargs
        )
    except Exception as e:  # jinja raise_exception / TemplateError: the conversation's fault
        raise ChatRequestError("messages", f"the chat template rejected them: {e}") from None


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


# ---- responses ------------------------------------------------------------------------------
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
