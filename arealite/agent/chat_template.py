"""A compact Qwen2.5-style (Hermes) chat template with tools, for models that ship without one.

The tiny offline test model's template renders plain messages only; this one adds Qwen2.5's
tool protocol (tool schemas in the system turn, `<tool_call>{json}</tool_call>` in assistant
turns, `<tool_response>` blocks in a user turn) without Qwen's preamble and with each tool's
`function` object only, so a small model learns to call tools within a short context (a tiny
model learns the call format from SFT, not from instructions; fewer prompt tokens make every
training step cheaper).
"""

from __future__ import annotations

import json
import os

HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}"
    "{{- (tool.function if tool.function is defined else tool) | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def install_chat_template(model_dir: str, template: str = HERMES_TOOLS_TEMPLATE) -> None:
    """Write `template` into a HF model directory's tokenizer config (and drop a stale
    chat_template.jinja), so every `AutoTokenizer.from_pretrained(model_dir)` renders with it."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, "w") as f:
            f.write(template)
