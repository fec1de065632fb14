"""`AgentWorkers`: keep `agent.workers` copies of an agent program running and hand each one
AgentProxy session at a time, through its stdin and stdout only (no protocol code in the agent).

Each task is one JSON line on the agent's stdin: `{"data": row, "base_url", "api_key",
"session_id"}`. The agent answers one JSON line on stdout: `{"reward": r}`, or `{}` (or a null
reward) to have the workflow's reward function score the session's last assistant message
against the row. A worker's environment holds `OPENAI_BASE_URL` / `OPENAI_API_KEY`, which always
point at the session it is serving, so an agent that does one task at a time can use
`openai.OpenAI()` as is. Keys travel in the environment and on stdin, never on a command line.

Faults do not stop the run: a worker that exits mid-session, answers something other than a
JSON object, or stays silent past `session_timeout` has its session dropped (the GRPO group is
rejected), is counted in the proxy's stats (agent_exited / agent_bad_reply / agent_timeout)
with a logged reason and the last line of its stderr, and is restarted for the next task. An
agent that never works (its first `2 x agent.workers` sessions all lost, none finished: a missing
module, a wrong path) stops the run with that reason instead of training on nothing.

A leading `python` / `python3` in `agent.command` is the interpreter running the trainer (its
virtual environment), not whatever `python` is first on PATH.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import shlex
import sys
from collections import deque
from typing import Any

from arealite.api.agent_config import AgentConfig
from arealite.workflow.rlvr import reward_row

logger = logging.getLogger("arealite.agent")

REPLY_HELP = (
    'answer one JSON object line per task on stdout, {"reward": r} or {} (then `reward:` '
    "scores the last assistant message); print logs to stderr"
)


class AgentFault(Exception):
    """A session lost to the agent; `kind` is the stats counter, `restart` the worker's fate."""

    def __init__(self, kind: str, message: str, restart: bool = True):
        super().__init__(message)
        self.kind, self.restart = kind, restart


def parse_reply(line: bytes) -> float | None:
    """The agent's answer line -> its reward (None: let the reward function score it)."""
    text = line.decode(errors="replace").strip()
    try:
        reply = json.loads(text)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise AgentFault("agent_bad_reply", f"answered {text[:200]!r}: {REPLY_HELP}")
    r = reply.get("reward")
    if r is None:
        return None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise AgentFault("agent_bad_reply", f"answered reward {r!r}, not a finite number")
    return float(r)


def agent_argv(command: str) -> list[str]:
    """`agent.command` split as a shell would, `python` meaning this interpreter."""
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


class _Worker:
    """One copy of the agent program and the session it serves."""

    def __init__(self, index: int, proxy: Any):
        self.index, self.proxy, self.proc = index, proxy, None
        self.alias, self.key = f"worker{index}-{secrets.token_hex(6)}", secrets.token_urlsafe(24)
        self.stderr_tail: deque[str] = deque(maxlen=5)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "OPENAI_BASE_URL": f"{self.proxy.url}/sessions/{self.alias}/v1",
            "OPENAI_API_KEY": self.key,
            "AREALITE_AGENT_WORKER": str(self.index),
        }

    async def ensure_running(self, argv: list[str], cwd: str | None) -> None:
        if self.proc is not None and self.proc.returncode is None:
            return
        self.proxy.stats["agent_restarts" if self.proc is not None else "agent_starts"] += 1
        self.proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env(),
            cwd=cwd,
            limit=64 * 1024**2,
        )
        asyncio.ensure_future(self._relay_stderr(self.proc))

    async def _relay_stderr(self, proc: Any) -> None:
        """The agent's stderr goes on to ours, prefixed; its last lines explain a crash."""
        while line := await proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self.stderr_tail.append(text)
            print(f"[agent {self.index}] {text}", file=sys.stderr, flush=True)

    def last_words(self) -> str:
        said = [t for t in self.stderr_tail if t.strip()]
        return f"; its stderr ended with: {said[-1].strip()[:300]}" if said else ""

    async def ask(self, s: Any, timeout: float) -> float | None:
        """Hand session `s` over and wait for the answer line."""
        task = {
            "data": s.task.data,
            "base_url": f"{self.proxy.url}/sessions/{s.id}/v1",
            "api_key": s.key,
            "session_id": s.id,
        }
        try:
            self.proc.stdin.write((json.dumps(task, default=str) + "\n").encode())
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        except asyncio.TimeoutError:
            raise AgentFault("agent_timeout", f"no answer within {timeout:.0f}s") from None
        if not line:
            code = await self.proc.wait()
            await asyncio.sleep(0.05)  # let the stderr relay read the last lines
            raise AgentFault(
                "agent_exited", f"exited with code {code} mid-session{self.last_words()}"
            )
        return parse_reply(line)

    async def kill(self, grace: float = 3.0) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.stdin.close()  # a well-behaved agent ends on EOF
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class AgentWorkers:
    """See the module docstring. Runs on the proxy's event loop; `start()` / `stop()` from any
    other thread."""

    def __init__(self, proxy: Any, config: AgentConfig, tokenizer: Any, cwd: str | None = None):
        self.proxy, self.config, self.tokenizer, self.cwd = proxy, config, tokenizer, cwd
        self.argv = agent_argv(config.command)
        self.workers = [_Worker(i, proxy) for i in range(config.workers)]
        self._futures: list = []
        self._lost_before_any_finished = 0

    def start(self) -> None:
        loop = self.proxy.loop
        self._futures = [
            asyncio.run_coroutine_threadsafe(self._serve(w), loop) for w in self.workers
        ]

    def stop(self, timeout: float = 15.0) -> None:
        """Cancel the hand-overs, close the agents' stdin, kill those that linger."""
        loop = self.proxy.loop
        for f in self._futures:
            loop.call_soon_threadsafe(f.cancel)

        async def kill_all():
            await asyncio.gather(*(w.kill() for w in self.workers))

        asyncio.run_coroutine_threadsafe(kill_all(), loop).result(timeout)

    async def _serve(self, w: _Worker) -> None:
        while True:
            s = await self.proxy.claim(1.0)
            if s is None:
                continue
            self.proxy.bind(w.alias, w.key, s.id)
            try:
                await w.ensure_running(self.argv, self.cwd)
                reward = await w.ask(s, self.config.session_timeout + 5.0)
                await self._finish(s, reward)
            except AgentFault as e:
                self.proxy.stats[e.kind] += 1
                logger.error(
                    "agent worker %d (`%s`): %s; session %s dropped%s",
                    w.index,
                    self.config.command,
                    e,
                    s.id,
                    ", worker restarted" if e.restart else "",
                )
                self._check_it_ever_works(e)
                self.proxy.drop(s, None)
                if e.restart:
                    await w.kill(grace=0.5)
            except OSError as e:  # the command itself cannot start: say so, keep serving
                self.proxy.stats["agent_start_failed"] += 1
                logger.error("agent command %r failed to start: %s", self.config.command, e)
                self._check_it_ever_works(AgentFault("agent_start_failed", f"cannot start: {e}"))
                self.proxy.drop(s, None)
                await asyncio.sleep(1.0)
            finally:
                self.proxy.bind(w.alias, w.key, None)

    def _check_it_ever_works(self, fault: AgentFault) -> None:
        """Past 2 x workers lost sessions with none finished, the agent is broken, not unlucky:
        the proxy's episodes raise this (the run stops naming the command and the reason)."""
        if self.proxy.stats["finished"]:
            return
        self._lost_before_any_finished += 1
        if self._lost_before_any_finished >= 2 * len(self.workers):
            self.proxy.fail_every_episode(
                RuntimeError(
                    f"agent.command {self.config.command!r} lost its first "
                    f"{self._lost_before_any_finished} sessions and finished none; the last: {fault}"
                )
            )

    async def _finish(self, s: Any, reward: float | None) -> None:
        """Reward (the agent's, else the reward function's) and end the session."""
        if not self.proxy.is_open(s.id):  # the agent ended it over HTTP, or it expired
            return
        if reward is None and not s.rewarded and len(s.client.tree) > 0:
            pool = s.task.workflow.reward_pool
            if pool is None:
                raise AgentFault(
                    "agent_no_reward",
                    "answered no reward and `reward:` is not "
                    'set: answer {"reward": r} or set reward:',
                    restart=False,
                )
            last = s.client.interactions[-1]
            reward = await pool(
                prompt=last.prompt_text,
                completions=last.message.get("content") or "",
                prompt_ids=last.prompt_ids,
                completion_ids=last.output_ids,
                **reward_row(s.task.data),
            )
        if reward is not None and len(s.client.tree) > 0:
            s.client.set_final_reward(reward)
            s.rewarded = True
        self.proxy.end(s)
