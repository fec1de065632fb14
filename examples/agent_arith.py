"""GRPO on an agent written only against the `openai` SDK (examples/agent_arith_openai.py):
multi-turn arithmetic where a wrong answer gets "Wrong, try again." and later turns are
discounted. `grpo.py`'s loop with an agent workflow instead of RLVRWorkflow.

    AGENT_MODE=proxy|inprocess python -m arealite.launcher.local examples/agent_arith.py \
        --config examples/configs/agent_arith.yaml actor.path=<SFT model>

inprocess: `AgentWorkflow` runs `solve(client, row)` on a TrainingOpenAIClient (no HTTP).
proxy (default): an `AgentProxy` serves sessions and `--workers` agent processes run the same
script with only `base_url` changed. Held-out success is measured greedily on the first answer.
"""

import atexit
import logging
import os
import secrets
import subprocess
import sys

from agent_arith_openai import last_integer, solve
from grpo import main as grpo_main  # the GRPO loop; this folder is on sys.path

from arealite.agent import AgentWorkflow
from arealite.agent.proxy import AgentProxy
from arealite.lifecycle.fast_exit import run_then_exit_fast

TURN_DISCOUNT = 0.5
AGENT_WORKERS = 64  # concurrent sessions: enough for every group of the episodes in flight
HERE = os.path.dirname(os.path.abspath(__file__))


async def first_answer(client, row: dict) -> float:
    """Held-out success: the first answer only (greedy)."""
    r = await client.chat.completions.create(model="policy", messages=row["messages"])
    return float(last_integer(r.choices[0].message.content) == int(row["answer"]))


def start_proxy(tokenizer, gconfig):
    """The proxy on this trainer, and agent processes that know only its URL and key."""
    key = secrets.token_urlsafe(16)
    proxy = AgentProxy(
        tokenizer,
        gconfig,
        api_key=key,
        session_timeout=300,
        export_style="concat",
        turn_discount=TURN_DISCOUNT,
    )
    url = proxy.start()
    script = os.path.join(HERE, "agent_arith_openai.py")
    agents = subprocess.Popen(
        [sys.executable, script, "--proxy", url, "--workers", str(AGENT_WORKERS)],
        env={**os.environ, "OPENAI_API_KEY": key},  # never on the command line
    )
    atexit.register(agents.terminate)
    atexit.register(proxy.stop)
    return proxy.workflow


def make_workflow(reward_fn, gconfig, tokenizer, **_):
    """The loop's workflow factory: greedy evaluation in-process, training per AGENT_MODE."""
    if gconfig.greedy:
        return AgentWorkflow(first_answer, tokenizer, gconfig)
    if os.environ.get("AGENT_MODE", "proxy") == "inprocess":
        return AgentWorkflow(
            solve, tokenizer, gconfig, export_style="concat", turn_discount=TURN_DISCOUNT
        )
    return start_proxy(tokenizer, gconfig)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    run_then_exit_fast(grpo_main, sys.argv[1:], make_workflow)
