"""The agent route from `agent:` alone (AgentRoute, AgentWorkers) with real agent processes that
import only `openai`, and the proxy's answers to the real SDK's retries and to an empty task queue.

Faults never stop the run: an agent that crashes mid-session or answers garbage loses that
session (counted, logged, the worker restarted) and the next session is served.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import urllib.request

import pytest
from transformers import AutoTokenizer

from arealite.agent.route import AgentRoute
from arealite.api.agent_config import AgentConfig
from arealite.api.io_struct import GenerationHyperparameters

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "agents", "sum_then_add.py")

# An agent whose behaviour each row picks: ok | crash | garbage | score (no reward: `reward:`).
FAULTY_AGENT = r"""
import json, os, sys
import openai

client = openai.OpenAI()
for line in sys.stdin:
    task = json.loads(line)
    mode = task["data"]["mode"]
    r = client.chat.completions.create(model="p", messages=task["data"]["messages"], max_tokens=3)
    if mode == "crash":
        os._exit(3)
    if mode == "garbage":
        print("hello, I am done", flush=True)
    elif mode == "score":
        print("{}", flush=True)
    else:
        print(json.dumps({"reward": 1.0}), flush=True)
"""


def fixed_reward(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    """What `reward:` gives a session whose agent answers no reward (a module-level function:
    the reward pool pickles it)."""
    return 0.25 if completions is not None and row["mode"] == "score" else -1.0


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def rows(n: int, **extra) -> list[dict]:
    return [
        {
            "messages": [{"role": "user", "content": f"{i}+2="}],
            "answer": str(i + 2),
            "query_id": f"q{i}",
            **extra,
        }
        for i in range(n)
    ]


def test_example_agent_trains_from_config_alone(tmp_path, tiny_executor, tokenizer):
    """agent.command = the shipped example; two turns per session; greedy evaluation reuses the
    same proxy and workers; keys reach the agents in their environment, not their argv."""
    cfg = AgentConfig(command=f"{sys.executable} {EXAMPLE}", workers=4)
    route = AgentRoute(cfg, tokenizer)
    try:
        train = route(None, GenerationHyperparameters(n_samples=2, max_new_tokens=3), tokenizer)
        greedy = GenerationHyperparameters(n_samples=1, max_new_tokens=3, greedy=True)
        evaluate = route(None, greedy, tokenizer)
        assert evaluate.proxy is train.proxy  # one proxy, one set of agents
        batch = tiny_executor.rollout_batch(rows(3), train)
        assert batch["input_ids"].shape[0] == 6  # 3 groups of 2 sessions, one row each
        starts = (batch["loss_mask"][:, 1:].int() - batch["loss_mask"][:, :-1].int()) == 1
        assert (starts.sum(1) == 2).all()  # both turns' tokens are trained, in one row
        assert set(batch["rewards"].tolist()) <= {0.0, 1.0}
        assert tiny_executor.rollout_batch(rows(2), evaluate)["input_ids"].shape[0] == 2
        stats = train.reward_stats
        assert stats["finished"] == 8 and stats["agent_starts"] == 4
        assert not stats.get("agent_restarts")
        for w in route.workers.workers:
            argv = open(f"/proc/{w.proc.pid}/cmdline").read()
            assert w.key not in argv and route.proxy.api_key not in argv
            env = open(f"/proc/{w.proc.pid}/environ").read().split("\0")
            assert f"OPENAI_API_KEY={w.key}" in env
    finally:
        route.close()


def test_crash_and_garbage_are_dropped_counted_and_the_run_goes_on(
    tiny_executor, tokenizer, tmp_path
):
    from arealite.reward.pool import RewardPool

    script = tmp_path / "faulty_agent.py"
    script.write_text(FAULTY_AGENT)
    sys.path.insert(0, os.path.dirname(__file__))
    route = AgentRoute(AgentConfig(command=f"{sys.executable} {script}", workers=2), tokenizer)
    pool = RewardPool(fixed_reward, max_workers=1)
    try:
        wf = route(None, GenerationHyperparameters(max_new_tokens=3), tokenizer, reward_pool=pool)
        items = [
            r | {"mode": m} for r, m in zip(rows(5), ["crash", "ok", "garbage", "score", "ok"])
        ]
        batch = tiny_executor.rollout_batch(items, wf)
        assert sorted(batch["rewards"].tolist()) == [0.25, 1.0, 1.0]  # the run went on
        s = wf.reward_stats
        assert s["agent_exited"] == 1 and s["agent_bad_reply"] == 1 and s["finished"] == 3
        assert s["agent_restarts"] == 2  # after the crash and after the garbage
        assert tiny_executor.stats()["rejected"] >= 2
    finally:
        route.close()
        pool.close()


def _relay_dropping_first_answer(upstream: tuple[str, int]) -> tuple[int, dict]:
    """A TCP relay in front of the proxy that forwards the first request, waits for the proxy's
    answer and then drops the client's connection: the answer is lost on the way back."""
    seen = {"connections": 0}
    srv = socket.create_server(("127.0.0.1", 0))

    def pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                s.close()

    def serve():
        while True:
            client, _ = srv.accept()
            seen["connections"] += 1
            up = socket.create_connection(upstream)
            threading.Thread(target=pipe, args=(client, up), daemon=True).start()
            if seen["connections"] == 1:  # swallow the answer, then hang up
                seen["swallowed"] = b""
                while not seen["swallowed"].rstrip().endswith(b"}"):  # the whole JSON answer
                    data = up.recv(65536)
                    if not data:  # the proxy hung up first: nothing more will come
                        break
                    seen["swallowed"] += data
                for sock in (client, up):  # shutdown wakes the pipe thread's recv, which
                    try:  # may close both sockets before this loop reaches the second
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    sock.close()
            else:
                threading.Thread(target=pipe, args=(up, client), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], seen


def test_sdk_retry_after_a_lost_answer_replays_it(tiny_executor, tokenizer):
    """The SDK retries a dropped connection (x-stainless-retry-count: 1): the proxy answers
    with the recorded completion, so the session keeps one branch and one training row."""
    from arealite.agent.proxy import AgentProxy

    proxy = AgentProxy(tokenizer, GenerationHyperparameters(max_new_tokens=4), api_key="k")
    proxy.start()
    try:
        done = {}
        t = threading.Thread(
            target=lambda: done.update(batch=tiny_executor.rollout_batch(rows(1), proxy.workflow))
        )
        t.start()
        admin = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", timeout=90)
        s = admin.post("/sessions", body={"wait": 60}, cast_to=object)
        port, seen = _relay_dropping_first_answer((proxy.host, proxy.port))
        base = s["base_url"].replace(f":{proxy.port}/", f":{port}/")
        client = openai.OpenAI(base_url=base, api_key=s["api_key"], max_retries=2, timeout=30)
        r = client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "1+1="}]
        )
        assert seen["connections"] == 2 and r.id.encode() in seen["swallowed"]  # replayed
        client.post("/end", body={"reward": 1.0}, cast_to=object)
        t.join(60)
        assert done["batch"]["input_ids"].shape[0] == 1 and proxy.stats["retries_replayed"] == 1
    finally:
        proxy.stop()


def test_no_task_within_wait_is_204_and_the_sdk_gets_an_empty_body(tokenizer):
    """What the README's loop must handle: no task offered within `wait` (training paused or
    finished) is 204 No Content, which `client.post(..., cast_to=object)` returns as ''."""
    from arealite.agent.proxy import AgentProxy

    proxy = AgentProxy(tokenizer, GenerationHyperparameters(), api_key="k")
    proxy.start()
    try:
        admin = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k")
        req = urllib.request.Request(
            proxy.url + "/v1/sessions", data=b'{"wait": 0.2}', headers={"Authorization": "Bearer k"}
        )
        with urllib.request.urlopen(req, timeout=30) as raw:
            assert raw.status == 204
        assert not admin.post("/sessions", body={"wait": 0}, cast_to=object)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proxy.url + "/v1", api_key="bad", max_retries=0).post(
                "/sessions", body={"wait": 0}, cast_to=object
            )
    finally:
        proxy.stop()


def test_an_agent_that_never_works_stops_the_run_with_its_reason(
    tiny_executor, tokenizer, tmp_path
):
    """Every copy dies on import: after 2 x workers lost sessions the rollout raises, naming the
    command and the agent's last stderr line, instead of training on nothing."""
    script = tmp_path / "broken_agent.py"
    script.write_text("import no_such_agent_module\n")
    route = AgentRoute(AgentConfig(command=f"python {script}", workers=2), tokenizer)
    try:
        wf = route(None, GenerationHyperparameters(n_samples=2, max_new_tokens=3), tokenizer)
        assert route.workers.argv[0] == sys.executable  # `python` is this interpreter
        with pytest.raises(Exception, match="finished none") as err:
            tiny_executor.rollout_batch(rows(4), wf)
        said = "".join(str(e) for e in (err.value, err.value.__cause__) if e)
        assert "No module named 'no_such_agent_module'" in said and str(script) in said
    finally:
        route.close()


def test_agent_config_errors_are_clear():
    from arealite.api.cli_args import ConfigError

    with pytest.raises(ConfigError, match="agent.workers"):
        AgentConfig(command="python a.py", workers=0)
    with pytest.raises(ConfigError, match="agent.command is empty"):
        AgentConfig(command="  ")
