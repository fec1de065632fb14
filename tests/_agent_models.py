"""Tiny models for the OpenAI-API and agent tests: the offline tiny Qwen2 with a tool-aware
chat template, optionally taught (a few seconds of Adam) to answer given prompts with given
replies, so greedy decoding makes real tool calls through the real server."""

from __future__ import annotations

import shutil

import torch

from arealite.agent.chat_template import install_chat_template

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOL_CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
QUESTION = "What is 2+3?"
FINAL_ANSWER = "The answer is 5."


def tool_conversation(call_id: str = "call_1") -> list[list[dict]]:
    """The message lists of the two turns of the taught tool round trip."""
    first = [{"role": "user", "content": QUESTION}]
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
    }
    second = first + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "5"},
    ]
    return [first, second]


def _for_template(messages: list[dict]) -> list[dict]:
    from arealite.openai_wire.request import normalize_message

    return [normalize_message(m, i) for i, m in enumerate(messages)]


def teach(model_dir: str, pairs: list[tuple[list[int], list[int]]], steps: int = 600) -> None:
    """Fit (prompt ids -> reply ids) pairs with Adam until greedy decoding reproduces them.

    Stops on the greedy check, not on a loss threshold: the step at which every reply token
    becomes the argmax differs between CPUs' kernels (a threshold that sufficed on one CPU left
    one token wrong on another)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        loss = 0.0
        for prompt, reply in pairs:
            ids = torch.tensor([prompt + reply])
            labels = ids.clone()
            labels[0, : len(prompt)] = -100
            loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01 * len(pairs) and step % 5 == 0 and _greedy_reproduces(model, pairs):
            break
    else:
        raise AssertionError(f"greedy decoding does not reproduce the replies after {steps} steps")
    model.save_pretrained(model_dir, safe_serialization=True)


def _greedy_reproduces(model, pairs: list[tuple[list[int], list[int]]]) -> bool:
    """Every reply token is the argmax given the prompt and the reply so far (teacher forcing
    equals greedy decoding when each step's argmax is the next reply token)."""
    with torch.no_grad():
        for prompt, reply in pairs:
            logits = model(input_ids=torch.tensor([prompt + reply])).logits[0]
            predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
            if predicted != reply:
                return False
    return True


def build_tool_model(base_dir: str, out_dir: str) -> str:
    """Copy of the tiny model with the Hermes tools template, taught the add-tool round trip:
    QUESTION -> TOOL_CALL_TEXT, then (tool result 5) -> FINAL_ANSWER."""
    from transformers import AutoTokenizer

    shutil.copytree(base_dir, out_dir)
    install_chat_template(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    eos = [tok.eos_token_id]
    pairs = []
    for messages, reply in zip(tool_conversation(), [TOOL_CALL_TEXT, FINAL_ANSWER]):
        text = tok.apply_chat_template(
            _for_template(messages), tools=[ADD_TOOL], tokenize=False, add_generation_prompt=True
        )
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        pairs.append((prompt, tok(reply, add_special_tokens=False)["input_ids"] + eos))
    teach(out_dir, pairs)
    return out_dir
