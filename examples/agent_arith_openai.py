"""An arithmetic agent written only against the `openai` SDK (no arealite import).

`solve(client, row)` answers, and after a wrong answer gets "Wrong, try again." (up to
MAX_TURNS); it returns 1.0 on a correct answer, else 0.0. The trainer discounts later turns.
In-process it runs on arealite's TrainingOpenAIClient (examples/agent_arith.py); as a separate
process it trains through the AgentProxy, changing only `base_url`:

    OPENAI_API_KEY=KEY python examples/agent_arith_openai.py --proxy http://127.0.0.1:PORT --workers 16

The key comes from the environment (OPENAI_API_KEY), never from the command line (`ps` shows it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re

import openai

MAX_TURNS = 3
FEEDBACK = "Wrong, try again."


def last_integer(text: str) -> int | None:
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


async def solve(client, row: dict) -> float:
    """Answer `row["messages"]`; retry after feedback; 1.0 if some turn is right."""
    messages = list(row["messages"])
    for _ in range(MAX_TURNS):
        r = await client.chat.completions.create(model="policy", messages=messages)
        msg = r.choices[0].message
        if last_integer(msg.content) == int(row["answer"]):
            return 1.0
        messages += [msg, {"role": "user", "content": FEEDBACK}]
    return 0.0


async def _session(proxy: str, key: str) -> bool:
    admin = openai.AsyncOpenAI(base_url=f"{proxy}/v1", api_key=key, max_retries=0)
    s = await admin.post("/sessions", body={"wait": 30}, cast_to=object)
    if not s:  # 204: no task offered within the wait (training paused or finished)
        return False
    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    reward = await solve(client, s["data"])
    await client.post("/end", body={"reward": reward}, cast_to=object)
    return True


async def _worker(proxy: str, key: str) -> None:
    while True:
        try:
            await _session(proxy, key)
        except openai.APIConnectionError:  # the trainer shut the proxy down: done
            return
        except openai.APIStatusError as e:  # e.g. the session expired: take the next one
            print(f"session failed: {e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proxy", required=True, help="AgentProxy URL")
    p.add_argument("--workers", type=int, default=16, help="concurrent sessions")
    a = p.parse_args()

    async def run():
        await asyncio.gather(
            *(_worker(a.proxy, os.environ.get("OPENAI_API_KEY", "")) for _ in range(a.workers))
        )

    asyncio.run(run())


if __name__ == "__main__":
    main()
