"""The training client (arealite/agent): conversation trees and rewards, token exactness
against a real server, tool calls, n > 1, streaming, and AgentWorkflow through the executor."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from _engine_recorder import Recorder
from transformers import AutoTokenizer

from arealite.agent import AgentWorkflow, Interaction, InteractionTree, TrainingOpenAIClient
from arealite.api.io_struct import GenerationHyperparameters
from arealite.openai_wire.request import ChatRequestError

openai = pytest.importorskip("openai")

FEEDBACK = "Wrong, try again."


def _it(name: str, prompt: list[int], out: list[int]) -> Interaction:
    return Interaction(
        completion_id=name,
        choice_index=0,
        messages=[],
        tools=None,
        prompt_text="",
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-0.1 * t for t in out],
        output_versions=[7] * len(out),
        stop_reason="stop",
        message={},
    )


def test_reward_propagates_back_along_a_branching_tree():
    """A -> {B, C}, B -> D; rewards B=0.2, C=0.5, D=1 (A unset), discount 0.5."""
    tree = InteractionTree()
    for it in [
        _it("A", [1, 2], [3]),
        _it("B", [1, 2, 3, 4], [5]),
        _it("C", [1, 2, 3, 6], [7]),
        _it("D", [1, 2, 3, 4, 5, 8], [9]),
        _it("E", [1, 9], [2]),  # unrelated root
    ]:
        tree.add(it)
    assert [(it.completion_id, it.parent and it.parent.completion_id) for it in tree] == [
        ("A", None),
        ("B", "A"),
        ("C", "A"),
        ("D", "B"),
        ("E", None),
    ]
    tree.set_reward("B", 0.2)
    tree.set_reward("C", 0.5)
    tree.set_reward("D", 1.0)
    returns = tree.returns(0.5)
    # D = 1; C = 0.5; B = 0.2 + 0.5 * 1 = 0.7; A = 0.5 * mean(0.7, 0.5) = 0.3; E = 0
    assert {k[0]: v for k, v in returns.items()} == pytest.approx(
        {"A": 0.3, "B": 0.7, "C": 0.5, "D": 1.0, "E": 0.0}
    )
    ind = tree.export("individual", 0.5)
    assert ind["rewards"].tolist() == pytest.approx([0.3, 0.7, 0.5, 1.0, 0.0])
    assert ind["loss_mask"].sum(1).tolist() == [1, 1, 1, 1, 1]
    cat = tree.export("concat", 0.5)  # leaves C, D, E
    # C: A(0) + 0.5 * 0.5 = 0.25; D: 0 + 0.5 * 0.2 + 0.25 * 1 = 0.35
    assert cat["rewards"].tolist() == pytest.approx([0.25, 0.35, 0.0])
    d = cat[1]
    assert d["input_ids"].tolist() == [1, 2, 3, 4, 5, 8, 9]
    assert d["loss_mask"].tolist() == [0, 0, 1, 0, 1, 0, 1]
    assert d["logprobs"].tolist() == pytest.approx([0, 0, -0.3, 0, -0.5, 0, -0.9])
    assert d["versions"].tolist() == [-1, -1, 7, -1, 7, -1, 7]
    tree.set_final_reward(2.0)
    assert tree.get("E").reward == 2.0
    with pytest.raises(KeyError, match="no completion 'Z'"):
        tree.set_reward("Z", 1.0)


# ---- against a real server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tool_model_dir):
    return AutoTokenizer.from_pretrained(tool_model_dir)


@pytest.fixture(scope="module")
def engine(tool_model_dir):
    from _rollout import remote_engine

    from arealite.server.process import launch_server

    server = launch_server(tool_model_dir, env={"OMP_NUM_THREADS": "1"}, dtype="float32")
    with server, remote_engine(server.address, consumer_batch_size=4) as e:
        yield e


def _client(engine, tokenizer, **g) -> tuple[TrainingOpenAIClient, Recorder]:
    rec = Recorder(engine)
    gconfig = GenerationHyperparameters(**{"max_new_tokens": 6, **g})
    return TrainingOpenAIClient(rec, tokenizer, gconfig), rec


async def _three_turns(client) -> list:
    messages = [{"role": "user", "content": "What is 4+4?"}]
    out = []
    for _ in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages)
        out.append(r)
        messages += [r.choices[0].message, {"role": "user", "content": FEEDBACK}]
    return out


@pytest.mark.integration
def test_three_turn_export_is_token_exact(engine, tokenizer):
    client, rec = _client(engine, tokenizer)
    resps = asyncio.run(_three_turns(client))
    assert len(rec.calls) == 3
    for (prev_in, prev), (nxt_in, _) in zip(rec.calls, rec.calls[1:]):
        head = prev_in + prev.output_tokens  # the next prompt extends it token for token
        assert nxt_in[: len(head)] == head
    chain = client.interactions
    assert [it.parent for it in chain] == [None, chain[0], chain[1]]
    assert [it.completion_id for it in chain] == [r.id for r in resps]
    (row,) = client.export_samples("concat")
    mask = row["loss_mask"].bool()
    model_tokens = [t for _, r in rec.calls for t in r.output_tokens]
    assert row["input_ids"][mask].tolist() == model_tokens
    lps = torch.tensor([lp for _, r in rec.calls for lp in r.output_logprobs], dtype=torch.float32)
    assert torch.equal(row["logprobs"][mask], lps)  # byte for byte
    assert row["input_ids"].tolist() == rec.calls[-1][0] + rec.calls[-1][1].output_tokens
    assert (row["versions"][mask] == 0).all() and (row["versions"][~mask] == -1).all()
    assert (row["logprobs"][~mask] == 0).all()
    feedback_ids = tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(row["input_ids"][~mask].tolist())
    assert text.count(FEEDBACK) == 2 and len(feedback_ids) > 0  # feedback is prompt, not trained
    client.set_final_reward(1.0)
    ind = client.export_samples("individual", turn_discount=0.5)
    assert ind["rewards"].tolist() == [0.25, 0.5, 1.0]
    assert client.export_samples("concat", 0.5)["rewards"].tolist() == [0.25]


@pytest.mark.integration
def test_tool_call_round_trip_through_the_client(engine, tokenizer):
    from _agent_models import ADD_TOOL, FINAL_ANSWER, QUESTION

    async def agent(client):
        msgs = [{"role": "user", "content": QUESTION}]
        r = await client.chat.completions.create(messages=msgs, tools=[ADD_TOOL], temperature=0)
        call = r.choices[0].message.tool_calls[0]
        result = sum(json.loads(call.function.arguments).values())
        msgs += [
            r.choices[0].message,
            {"role": "tool", "tool_call_id": call.id, "content": str(result)},
        ]
        r2 = await client.chat.completions.create(messages=msgs, tools=[ADD_TOOL], temperature=0)
        return r, r2

    client, _ = _client(engine, tokenizer, max_new_tokens=100)
    r, r2 = asyncio.run(agent(client))
    assert r.choices[0].finish_reason == "tool_calls"
    assert r2.choices[0].message.content == FINAL_ANSWER
    first, second = client.interactions
    assert second.parent is first
    (row,) = client.export_samples("concat")
    decoded = tokenizer.decode(row["input_ids"].tolist())
    assert "<tool_response>\n5\n</tool_response>" in decoded
    trained = tokenizer.decode(row["input_ids"][row["loss_mask"].bool()].tolist())
    assert "<tool_call>" in trained and FINAL_ANSWER in trained and "tool_response" not in trained


@pytest.mark.integration
def test_n_choices_are_separate_interactions_and_streaming_works(engine, tokenizer):
    client, rec = _client(engine, tokenizer)
    msgs = [{"role": "user", "content": "Hi"}]

    async def run():
        r = await client.chat.completions.create(messages=msgs, n=3, seed=5, logprobs=True)
        stream = await client.chat.completions.create(messages=msgs, stream=True)
        chunks = [c async for c in stream]
        return r, chunks

    r, chunks = asyncio.run(run())
    assert len(r.choices) == 3 and len(client.interactions) == 4
    for i, c in enumerate(r.choices):
        it = client.tree.get(r.id, i)
        assert [t.logprob for t in c.logprobs.content] == pytest.approx(it.output_logprobs)
        client.set_reward(r.id, float(i), choice_index=i)
    assert client.export_samples()["rewards"].tolist() == [0.0, 1.0, 2.0, 0.0]
    assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(ChatRequestError, match="n: must be in"):
        asyncio.run(client.chat.completions.create(messages=msgs, n=0))
    with pytest.raises(ChatRequestError, match="top_logprobs: not available"):
        asyncio.run(client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2))
    assert len(client.interactions) == 4  # refused requests record nothing


@pytest.mark.integration
def test_agent_workflow_runs_through_the_executor(engine, tokenizer):
    from arealite.rollout import WorkflowExecutor

    async def agent(client, data):
        msgs = [{"role": "user", "content": data["question"]}]
        r = await client.chat.completions.create(messages=msgs)
        msgs += [r.choices[0].message, {"role": "user", "content": FEEDBACK}]
        await client.chat.completions.create(messages=msgs)
        return 1.0 if data["question"].endswith("1?") else 0.0

    async def slow_agent(client, data):
        await asyncio.sleep(30)

    gconfig = GenerationHyperparameters(n_samples=2, max_new_tokens=4)
    wf = AgentWorkflow(agent, tokenizer, gconfig, export_style="concat", turn_discount=0.5)
    ex = WorkflowExecutor(engine.config, engine)
    ex.initialize()
    try:
        batch = ex.rollout_batch([{"question": "What is 1+1?"}, {"question": "What is 2+2?"}], wf)
        assert batch["input_ids"].shape[0] == 4  # 2 items x 2 runs, one conversation each
        assert batch["rewards"].tolist() == [0.5, 0.5, 0.0, 0.0]  # final reward on turn 2
        assert wf.stats["runs"] == 4 and wf.stats["completions"] == 8
        slow = AgentWorkflow(slow_agent, tokenizer, gconfig.new(n_samples=1), timeout=0.5)
        assert asyncio.run(slow.arun_episode(engine, {"question": "x"})) is None
        assert slow.stats["timeouts"] == 1
    finally:
        ex.destroy()
