"""Tool calls in a model's text output -> OpenAI `tool_calls`.

The chat template decides how a model writes a tool call, so the parser is picked from the
template: Qwen2.5 / Qwen3 / Hermes templates tell the model to answer with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A template whose format we cannot
parse is an error at request time (naming `tools`), never a silently ignored tool call.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

HERMES = "hermes"
KNOWN_PARSERS = (HERMES,)

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolParserError(ValueError):
    """The served model's chat template has no tool-call format we can parse."""


def parser_for_template(template: str | None, requested: str = "auto") -> str:
    """The parser name for `template` ('auto' detects it; an explicit name is checked)."""
    if requested != "auto":
        if requested not in KNOWN_PARSERS:
            raise ToolParserError(
                f"tool parser {requested!r} is unknown; known parsers: {list(KNOWN_PARSERS)}"
            )
        return requested
    if not template or "tools" not in template:
        raise ToolParserError(
            "the model's chat template does not render `tools`; use a tool-aware template "
            "(e.g. Qwen2.5's, or arealite.agent.chat_template.HERMES_TOOLS_TEMPLATE)"
        )
    if "<tool_call>" in template:
        return HERMES
    raise ToolParserError(
        "cannot tell how the model writes tool calls: its chat template uses none of the "
        f"known formats {list(KNOWN_PARSERS)} (hermes: <tool_call>{{json}}</tool_call>)"
    )


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _hermes_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models already emit a JSON string
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model text into (content, OpenAI tool_calls).

    A block that is not valid JSON with a "name" stays in the content (the agent then sees
    what the model wrote, as vLLM does); content is None when only tool calls remain.
    """
    if parser != HERMES:
        raise ToolParserError(f"tool parser {parser!r} is unknown; known: {list(KNOWN_PARSERS)}")
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _HERMES_BLOCK.finditer(text):
        call = _hermes_call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls
