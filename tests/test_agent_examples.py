"""The agent examples' own pieces (fast; the training runs are `examples/run_agent_demo.sh`):
the calculator tool, and the SFT traces the scripted teacher writes through the real
TrainingOpenAIClient (tool call, tool response, answer; loss only on the model's tokens)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import agent_calculator  # noqa: E402


@pytest.mark.parametrize(
    "expression, value",
    [("625-648", "-0023"), ("2+3*4-5", "+0009"), ("07*28", "+0196"), (" 12 * 3 ", "+0036")],
)
def test_calculator_evaluates_integer_expressions(expression, value):
    assert agent_calculator.calculator(expression) == value


@pytest.mark.parametrize("bad", ["__import__('os')", "2**99", "1/0", "", None, 7])
def test_calculator_refuses_anything_else(bad):
    assert agent_calculator.calculator(bad).startswith("error:")


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_model_dir, tmp_path_factory):
    """The tiny model's tokenizer with the compact tool-aware chat template and the tool
    protocol's tokens."""
    model = str(tmp_path_factory.mktemp("calculator") / "model")
    return agent_calculator.tool_model_dir(tiny_model_dir, model)


def test_teacher_traces_are_the_clients_tokens(tool_tokenizer):
    tok = tool_tokenizer
    rows = [{"messages": [{"role": "user", "content": "6-48="}], "answer": "-42"}]
    ((ids, mask),) = agent_calculator.tool_traces(tok, rows)
    text, trained = tok.decode(ids), tok.decode([i for i, m in zip(ids, mask) if m])
    assert "06-48=" in text  # operands at a fixed width
    assert '"expr": "06-48"' in text and "<tool_response>\n-0042\n</tool_response>" in text
    assert trained.startswith("<tool_call>") and trained.endswith("-0042<|im_end|>")
    assert "tool_response" not in trained and "06-48=" not in trained


def test_protocol_tokens_bring_the_copies_closer(tool_tokenizer):
    """Each protocol string is one token, so every digit to copy sits 12 tokens back, in both
    copies (question -> call, tool result -> answer) of every trace."""
    tok = tool_tokenizer
    rows = [
        {"messages": [{"role": "user", "content": q}], "answer": a}
        for q, a in [("7*61=", "427"), ("93-5=", "88")]
    ]
    for ids, _ in agent_calculator.tool_traces(tok, rows):
        pieces = [tok.decode([i]) for i in ids]
        for protocol in agent_calculator.PROTOCOL_TOKENS:
            assert protocol in pieces
        digits = [i for i, p in enumerate(pieces) if p.isdigit()]
        question, call, result, answer = (digits[k : k + 4] for k in range(0, 16, 4))
        assert [c - q for q, c in zip(question, call)] == [12] * 4
        assert [a - r for r, a in zip(result, answer)] == [12] * 4


def test_copy_drill_is_the_trace_without_its_system_turn(tool_tokenizer):
    tok = tool_tokenizer
    rows = [{"messages": [{"role": "user", "content": "7*61="}], "answer": "427"}]
    ((ids, mask),) = agent_calculator.tool_traces(tok, rows)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    drill_ids, drill_mask = agent_calculator.without_system_turn((ids, mask), im_end)
    assert tok.decode(drill_ids).startswith("<|im_start|>user\n07*61=")
    assert "<tools>" in tok.decode(ids) and "<tools>" not in tok.decode(drill_ids)
    assert ids[-len(drill_ids) :] == drill_ids and mask[-len(drill_mask) :] == drill_mask
    assert sum(drill_mask) == sum(mask)  # every trained token kept


def test_shared_prefix_sft_loss_equals_the_padded_loss(tiny_model_dir, tmp_path):
    """The SFT runs the common system turn once per batch: same loss and gradients as padding
    the full traces."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = str(tmp_path / "model")
    tok = agent_calculator.tool_model_dir(tiny_model_dir, model_dir)
    rows = [
        {"messages": [{"role": "user", "content": q}], "answer": a}
        for q, a in [("47*28=", "1316"), ("5-93=", "-88"), ("81+9=", "90")]
    ]
    traces = agent_calculator.tool_traces(tok, rows)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    shared = agent_calculator.trace_loss(model, traces, tok.pad_token_id)
    shared.backward()
    shared_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    width = max(len(ids) for ids, _ in traces)
    ids = torch.full((len(traces), width), tok.pad_token_id)
    labels = torch.full((len(traces), width), -100)
    for i, (x, mask) in enumerate(traces):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(x)] = torch.where(torch.tensor(mask).bool(), torch.tensor(x), -100)
    padded = model(input_ids=ids, labels=labels).loss
    padded.backward()
    assert shared.item() == pytest.approx(padded.item(), abs=1e-6)
    for a, p in zip(shared_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


def test_partial_credit_counts_digits_copied_in_place():
    credit = agent_calculator._copy_credit
    assert credit([("07+61", "07+61"), ("+0068", "+0068")]) == 0.5  # (a right answer is 1.0)
    assert credit([("07+61", "07+69"), ("+0068", "+0000")]) == pytest.approx(0.2 + 0.15)
    assert credit([("07+61", "")]) == 0.0 and credit([]) == 0.0
