"""A two-turn agent written only against `openai` and the standard library.

Turn 1 asks the row's sum ("3+4="); turn 2 says "add C" ("+5=") with C derived from the row.
The reward is 1.0 when both answers are right. arealite runs this file as it is
(`agent.command: python examples/agents/sum_then_add.py`, see sum_then_add.yaml): each task is
one JSON line on stdin, the answer one JSON line on stdout. `OPENAI_BASE_URL` and
`OPENAI_API_KEY` in the environment point at the session being served, so the client needs no
arguments; an `openai` SDK retry never trains twice (the proxy replays its answer).
"""

import json
import re
import sys
import zlib

import openai


def added(row: dict) -> int:
    """The second turn's C: 1..9, fixed per row."""
    return zlib.crc32(row["query_id"].encode()) % 9 + 1


def last_integer(text: str | None):
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


def solve(client: openai.OpenAI, row: dict) -> float:
    """1.0 if the sum and then the sum + C are both right."""
    total, c = int(row["answer"]), added(row)
    messages = list(row["messages"])
    first = client.chat.completions.create(model="policy", messages=messages)
    answer = first.choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"+{c}="}]
    second = client.chat.completions.create(model="policy", messages=messages)
    ok = last_integer(answer) == total
    return float(ok and last_integer(second.choices[0].message.content) == total + c)


def main() -> None:
    client = openai.OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY: this worker's session
    for line in sys.stdin:  # one task a line; EOF when the trainer stops
        task = json.loads(line)
        print(json.dumps({"reward": solve(client, task["data"])}), flush=True)


if __name__ == "__main__":
    main()
