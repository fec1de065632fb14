"""The OpenAI chat-completions wire format, shared by the embedded server's `/v1` endpoint and
the training client (arealite/agent): request validation and prompt rendering through the
model's own chat template. The response / stream-chunk bodies are in `response.py`.

Everything here works on plain dicts (no `openai` import), so the server does not need the SDK.
Every malformed request raises `ChatRequestError` naming the offending field (`param`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from arealite.openai_wire.tool_calls import ToolParserError, parser_for_template

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
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
}


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
