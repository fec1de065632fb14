"""The embedded server's OpenAI-compatible endpoint, driven by the real `openai` client.

One server process per module, serving the tiny model with a tools template, taught one tool
round trip (tests/_agent_models.py) so greedy decoding produces real `<tool_call>` output.
"""

from __future__ import annotations

import json

import pytest
import requests

from arealite.openai_wire.request import ChatRequestError, parse_chat_request
from arealite.openai_wire.tool_calls import (
    HERMES,
    ToolParserError,
    parse_tool_calls,
    parser_for_template,
)
from arealite.server.process import launch_server

openai = pytest.importorskip("openai")

API_KEY = "openai-test-key"


# ---- pure parsing (no server) --------------------------------------------------------------------
def test_hermes_parser_splits_content_and_calls():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me add."
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, HERMES) == (broken, [])


def test_parser_is_picked_from_the_template():
    assert parser_for_template("{% for t in tools %}<tool_call>{% endfor %}") == HERMES
    with pytest.raises(ToolParserError, match="does not render `tools`"):
        parser_for_template("{{ messages }}")
    with pytest.raises(ToolParserError, match="known formats"):
        parser_for_template("{% for t in tools %}[TOOL_CALLS]{% endfor %}")
    with pytest.raises(ToolParserError, match="unknown"):
        parser_for_template("x", requested="mistral")


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]},
            "tools[0].type",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ],
)
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(ChatRequestError) as e:
        parse_chat_request(body)
    assert e.value.param == param


# ---- a real server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tool_model_dir):
    env = {"OMP_NUM_THREADS": "1"}
    with launch_server(tool_model_dir, api_key=API_KEY, env=env, dtype="float32") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


HELLO = [{"role": "user", "content": "What is 12+7?"}]


@pytest.mark.integration
def test_models_lists_the_served_model(client, tool_model_dir):
    assert [m.id for m in client.models.list().data] == [tool_model_dir]


@pytest.mark.integration
def test_plain_chat_is_a_valid_chat_completion(client):
    r = client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, logprobs=True)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(choice.logprobs.content) <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert all(t.logprob <= 0 for t in choice.logprobs.content)


@pytest.mark.integration
def test_logprobs_equal_the_native_generate_endpoint(client, server, tool_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    ids = tok(
        tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    native = requests.post(
        f"{server.url}/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "return_logprob": True,
        },
        headers=server.headers,
        timeout=120,
    ).json()
    r = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=6, temperature=0, logprobs=True
    )
    assert r.usage.prompt_tokens == len(ids)
    native_lps = [lp for lp, _, _ in native["meta_info"]["output_token_logprobs"]]
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(native_lps, abs=1e-5)
    assert r.choices[0].message.content == native["text"]


@pytest.mark.integration
def test_top_logprobs_are_the_models_log_softmax(client, server, tool_model_dir):
    """top_logprobs at temperature 1 = log_softmax of the model's logits (HF forward over prompt
    + the sampled tokens, which the native endpoint reproduces from the same seed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    ids = tok(
        tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    k, seed = 5, 11
    r = client.chat.completions.create(
        model="m",
        messages=HELLO,
        max_tokens=8,
        temperature=1.0,
        seed=seed,
        logprobs=True,
        top_logprobs=k,
    )
    choice_seed = parse_chat_request({"messages": HELLO, "seed": seed}).choice_seed(0)
    native = requests.post(
        f"{server.url}/generate",
        json={
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 1.0,
                "sampling_seed": choice_seed,
            },
            "return_logprob": True,
        },
        headers=server.headers,
        timeout=120,
    ).json()
    out = native["output_ids"]
    assert r.choices[0].message.content == native["text"]  # the same draw
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    content = r.choices[0].logprobs.content
    assert len(content) == len(out)
    tol = dict(abs=1e-5, rel=1e-5)
    for pos, (entry, token) in enumerate(zip(content, out)):
        values, top_ids = ref[pos].topk(k)
        # 1e-5 + 1e-5 relative: the server decodes with a KV cache, the reference in one pass
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), **tol)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in top_ids]
        assert entry.logprob == pytest.approx(ref[pos, token].item(), **tol)
        if token in top_ids.tolist():  # the sampled token's entry carries its own logprob
            listed = entry.top_logprobs[top_ids.tolist().index(token)]
            assert listed.logprob == pytest.approx(entry.logprob, abs=1e-6)
        else:
            assert entry.logprob <= entry.top_logprobs[-1].logprob + 1e-6
    plain = client.chat.completions.create(model="m", messages=HELLO, max_tokens=2, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


@pytest.mark.integration
def test_n_choices_with_a_seed_differ_and_repeat(client):
    kw = dict(model="m", messages=HELLO, max_tokens=8, n=3, seed=123, temperature=1.0)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # each choice has its own seed


@pytest.mark.integration
def test_streaming_deltas_add_up_to_the_completion(client):
    kw = dict(model="m", messages=HELLO, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.integration
def test_stop_string_ends_the_content(client):
    for seed in range(16):  # seeded draws repeat; the taught model often ends its turn early
        kw = dict(model="m", messages=HELLO, max_tokens=12, temperature=1.0, seed=seed)
        text = client.chat.completions.create(**kw).choices[0].message.content
        if len(text) >= 4:
            break
    else:
        pytest.skip(f"16 seeded outputs too short to pick a stop string from (last {text!r})")
    stop = text[2:4]
    r = client.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].message.content == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.integration
def test_tool_call_round_trip(client):
    from _agent_models import ADD_TOOL, FINAL_ANSWER, QUESTION

    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(
        model="m", messages=messages, tools=[ADD_TOOL], temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    messages.append(choice.message)  # the SDK object goes back in as-is
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    r2 = client.chat.completions.create(
        model="m", messages=messages, tools=[ADD_TOOL], temperature=0
    )
    assert r2.choices[0].message.content == FINAL_ANSWER
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages[:1], tools=[ADD_TOOL], temperature=0, stream=True
        )
    )
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == ["add"]


@pytest.mark.integration
@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (
            dict(messages=HELLO, tools=[{"type": "function", "function": {}}]),
            "tools[0].function.name",
        ),
        (dict(messages=HELLO, n=0), "n"),
        (dict(messages=HELLO, max_tokens=10**7), "max_tokens"),
        (
            dict(
                messages=HELLO,
                tool_choice="required",
                tools=[{"type": "function", "function": {"name": "f"}}],
            ),
            "tool_choice",
        ),
        (dict(messages=HELLO, logprobs=True, top_logprobs=99), "top_logprobs"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(client, server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and param in e.value.body["message"]
    assert server.healthy()


@pytest.mark.integration
def test_raw_garbage_body_is_a_400_and_the_server_keeps_serving(server, client):
    r = requests.post(
        f"{server.url}/v1/chat/completions", data=b"{nope", headers=server.headers, timeout=30
    )
    assert r.status_code == 400 and "body" in r.json()["error"]["message"]
    r = requests.post(f"{server.url}/v1/chat/completions", json={"messages": HELLO}, timeout=30)
    assert r.status_code == 401  # the server's API key guards /v1 like every other route
    ok = client.chat.completions.create(model="m", messages=HELLO, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"
