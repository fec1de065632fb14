"""AgentProxy: black-box agents in another process (importing only `openai`) train through
HTTP; finished sessions flow into the WorkflowExecutor; faults are dropped and counted."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from transformers import AutoTokenizer

from arealite.agent.proxy import AgentProxy
from arealite.api.io_struct import GenerationHyperparameters

pytest.importorskip("openai")
pytestmark = pytest.mark.integration

PROXY_KEY = "proxy-key"

# The agent process: only `openai` (+ stdlib). MODE: full | no_reward | abandon | quick.
AGENT_SCRIPT = r"""
import asyncio, json, sys
import openai

PROXY, MODE, COUNT = sys.argv[1], sys.argv[2], int(sys.argv[3])


async def one():
    admin = openai.AsyncOpenAI(base_url=PROXY + "/v1", api_key="proxy-key", max_retries=0)
    s = await admin.post("/sessions", body={"wait": 120}, cast_to=object)
    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    msgs = [{"role": "user", "content": s["data"]["question"]}]
    r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=4)
    out = {"i": s["data"]["i"], "id": r.id}
    if MODE == "abandon":
        return out  # never ends: the proxy must time the session out
    if MODE == "full":
        msgs += [r.choices[0].message, {"role": "user", "content": "Wrong, try again."}]
        stream = await client.chat.completions.create(
            model="policy", messages=msgs, max_tokens=4, stream=True
        )
        out["streamed"] = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.post("/reward", body={"reward": 0.5, "completion_id": r.id}, cast_to=object)
    if MODE != "no_reward":
        await client.post("/reward", body={"reward": float(s["data"]["i"])}, cast_to=object)
    out["end"] = (await client.post("/end", body={}, cast_to=object))["status"]
    try:
        await client.post("/end", body={}, cast_to=object)
    except openai.ConflictError:
        out["second_end"] = 409
    return out


async def main():
    outs = await asyncio.gather(*(one() for _ in range(COUNT)))
    print(json.dumps(outs))


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def proxy(tokenizer):
    gconfig = GenerationHyperparameters(max_new_tokens=4)
    p = AgentProxy(tokenizer, gconfig, api_key=PROXY_KEY, session_timeout=3.0, turn_discount=0.5)
    p.start()
    yield p
    p.stop()


def run_agents(tmp_path, proxy, mode: str, count: int) -> subprocess.Popen:
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    return subprocess.Popen(
        [sys.executable, str(script), proxy.url, mode, str(count)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rollout(tiny_executor, proxy, n: int):
    items = [{"question": f"What is {i}+1?", "i": i} for i in range(n)]
    out = {}
    t = threading.Thread(
        target=lambda: out.update(batch=tiny_executor.rollout_batch(items, proxy.workflow))
    )
    t.start()
    return t, out


def finish(agents: subprocess.Popen, t: threading.Thread, out: dict):
    stdout, stderr = agents.communicate(timeout=300)
    assert agents.returncode == 0, stderr[-3000:]
    t.join(300)
    assert not t.is_alive()
    return json.loads(stdout), out["batch"]


def test_agent_process_trains_through_the_proxy(tmp_path, tiny_executor, proxy):
    t, out = rollout(tiny_executor, proxy, 3)
    results, batch = finish(run_agents(tmp_path, proxy, "full", 3), t, out)
    assert sorted(r["i"] for r in results) == [0, 1, 2]
    assert all(r["end"] == "finished" and r["second_end"] == 409 for r in results)
    assert all(isinstance(r["streamed"], str) for r in results)
    # concat export, discount 0.5: turn 1 reward 0.5 + 0.5 * final reward i (turn 2)
    assert sorted(batch["rewards"].tolist()) == pytest.approx([0.5, 1.0, 1.5])
    assert batch["input_ids"].shape[0] == 3 and proxy.stats["finished"] == 3
    assert (batch["loss_mask"].sum(1) > 0).all() and (
        batch["versions"][batch["loss_mask"].bool()] == 0
    ).all()
    assert proxy.open_sessions == 0 and proxy.queued_tasks == 0


def test_sessions_without_reward_or_end_are_dropped_and_counted(tmp_path, tiny_executor, proxy):
    t, out = rollout(tiny_executor, proxy, 4)
    no_reward = run_agents(tmp_path, proxy, "no_reward", 2)
    abandon = run_agents(tmp_path, proxy, "abandon", 2)
    a_out, _ = abandon.communicate(timeout=300)
    results, batch = finish(no_reward, t, out)
    assert all(r["end"] == "dropped: no reward" for r in results)
    assert len(json.loads(a_out)) == 2
    assert batch.batch_size[0] == 0  # nothing trained
    assert proxy.stats["no_reward"] == 2 and proxy.stats["timed_out"] == 2
    stats = tiny_executor.stats()
    assert stats["rejected"] == 4 and stats["accepted"] == 0 and stats["running"] == 0
    assert proxy.open_sessions == 0 and proxy.queued_tasks == 0


def test_64_concurrent_sessions_nothing_leaks_nothing_twice(tmp_path, tiny_executor, proxy):
    proxy.session_timeout = 120.0  # 64 sessions share 2 cores: none should expire here
    t, out = rollout(tiny_executor, proxy, 64)
    results, batch = finish(run_agents(tmp_path, proxy, "quick", 64), t, out)
    assert sorted(r["i"] for r in results) == list(range(64))
    assert all(r["end"] == "finished" and r["second_end"] == 409 for r in results)
    assert sorted(batch["rewards"].tolist()) == [float(i) for i in range(64)]  # each once
    assert proxy.stats["finished"] == 64 and proxy.stats["started"] == 64
    assert proxy.open_sessions == 0 and proxy.queued_tasks == 0


def test_an_episode_is_a_grpo_group_of_n_samples_sessions(tmp_path, tiny_executor, tokenizer):
    """GRPO normalises over adjacent rows of one prompt: each episode must offer its item
    `n_samples` times and return those sessions together."""
    gconfig = GenerationHyperparameters(n_samples=3, max_new_tokens=4)
    p = AgentProxy(tokenizer, gconfig, api_key=PROXY_KEY, session_timeout=30.0)
    p.start()
    try:
        t, out = rollout(tiny_executor, p, 2)
        results, batch = finish(run_agents(tmp_path, p, "quick", 6), t, out)
    finally:
        p.stop()
    assert sorted(r["i"] for r in results) == [0, 0, 0, 1, 1, 1]
    rewards = batch["rewards"].tolist()
    assert len(rewards) == 6 and p.stats["offered"] == 6 and p.stats["finished"] == 6
    assert rewards[:3] in ([0.0] * 3, [1.0] * 3) and sorted(rewards) == [0, 0, 0, 1, 1, 1]
