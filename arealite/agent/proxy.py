"""`AgentProxy`: train black-box agents (other processes, any OpenAI client) through HTTP.

The executor drives it like any workflow: each episode of `proxy.workflow` offers its data item
as `gconfig.n_samples` tasks (one GRPO group) and waits. An agent process claims a task with `POST /v1/sessions` and gets
`{session_id, base_url, api_key, data}`; it points its OpenAI client at `base_url` (the only
change to the agent), then `POST {base_url}/reward` and `POST {base_url}/end`. Completions go
through a `TrainingOpenAIClient` on the episode's engine, so the staleness bound applies to
sessions exactly as to any episode: no session starts unless the executor started an episode.

A finished session becomes that episode's training rows, once (ending twice is a 409). A session
that ends without a reward, or is not ended within `session_timeout` (agent stuck, crashed or
abandoned mid-way), is dropped: the episode returns None (counted as rejected by the executor)
and `stats` says why; its in-flight generations are cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import secrets
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from arealite.agent.client import TrainingOpenAIClient
from arealite.agent.interactions import ExportStyle
from arealite.api.io_struct import GenerationHyperparameters
from arealite.api.workflow_api import RolloutWorkflow
from arealite.utils.data import concat_padded_tensors
from arealite.utils.loop_thread import LoopThread

logger = logging.getLogger("arealite.agent")


class _LoopBoundEngine:
    """Runs `agenerate` on the executor's loop (where the engine's HTTP session lives) for a
    proxy handler on another loop; remembers the futures so a dropped session can cancel them."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.inflight: set[concurrent.futures.Future] = set()

    async def agenerate(self, req):
        fut = asyncio.run_coroutine_threadsafe(self.engine.agenerate(req), self.loop)
        self.inflight.add(fut)
        try:
            return await asyncio.wrap_future(fut)
        finally:
            self.inflight.discard(fut)

    def get_version(self) -> int:
        return self.engine.get_version()

    def cancel_all(self) -> None:
        for fut in list(self.inflight):
            fut.cancel()


@dataclass
class _Task:
    data: Any
    engine: _LoopBoundEngine
    workflow: ProxyWorkflow
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Session:
    id: str
    key: str
    task: _Task
    client: TrainingOpenAIClient
    deadline: float
    rewarded: bool = False
    replies: dict[str, Any] = field(default_factory=dict)  # request hash -> answer (retries)


class ProxyWorkflow(RolloutWorkflow):
    """One episode = `gconfig.n_samples` agent sessions on this data item (see AgentProxy).
    Several workflows (training, greedy evaluation) share one proxy and its agents; each
    session generates with its own workflow's settings. `reward_pool` scores sessions whose
    agent gives no reward (arealite.agent.workers)."""

    def __init__(
        self,
        proxy: AgentProxy,
        gconfig: GenerationHyperparameters,
        turn_discount: float,
        reward_pool: Any = None,
    ):
        self.proxy, self.reward_pool = proxy, reward_pool
        self.gconfig, self.group_size = gconfig.new(n_samples=1), gconfig.n_samples
        self.turn_discount = turn_discount

    @property
    def reward_stats(self) -> dict[str, int]:
        """Session counters: offered, started, finished, no_reward, timed_out, ..."""
        return dict(self.proxy.stats)

    def state_dict(self) -> dict[str, Any]:
        return {"stats": dict(self.proxy.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.proxy.stats.update({k: int(v) for k, v in state["stats"].items()})

    async def arun_episode(self, engine: Any, data: dict[str, Any]):
        """`gconfig.n_samples` sessions on this item (a GRPO group: adjacent rows of one
        prompt); the group is rejected (None) if any session is dropped."""
        bound = _LoopBoundEngine(engine, asyncio.get_running_loop())
        tasks = [_Task(data, bound, self) for _ in range(self.group_size)]
        for task in tasks:
            self.proxy.offer(task)
        try:
            rows = await asyncio.gather(*(asyncio.wrap_future(t.result) for t in tasks))
        except asyncio.CancelledError:
            for task in tasks:
                self.proxy.withdraw(task)
            raise
        if self.proxy.fatal is not None:
            raise self.proxy.fatal
        if any(r is None for r in rows):
            return None
        return rows[0] if len(rows) == 1 else concat_padded_tensors(list(rows))


class AgentProxy:
    """See the module docstring. `start()` serves on a background thread and returns the URL."""

    def __init__(
        self,
        tokenizer: Any,
        gconfig: GenerationHyperparameters,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        session_timeout: float = 300.0,
        export_style: ExportStyle = "concat",
        turn_discount: float = 1.0,
        tool_parser: str = "auto",
    ):
        self.tokenizer = tokenizer
        self.host, self.port, self.api_key = host, port, api_key
        self.session_timeout = session_timeout
        self.export_style: ExportStyle = export_style
        self.turn_discount = turn_discount
        self.tool_parser = tool_parser
        self.stats: Counter[str] = Counter()
        self.fatal: Exception | None = None  # the agent can never work: episodes raise it
        self.workflow = self.workflow_for(gconfig)
        self._aliases: dict[str, tuple[str, str | None]] = {}  # worker id -> (key, session id)
        self._tasks: deque[_Task] = deque()
        self._sessions: dict[str, _Session] = {}
        self._closed: set[str] = set()  # ended or expired session ids (answered with 409)
        self._lock = threading.Lock()
        self._task_ready: asyncio.Event | None = None
        self._loop = LoopThread("agent-proxy")
        self._reaper: asyncio.Task | None = None  # drops sessions past their deadline

    def workflow_for(
        self,
        gconfig: GenerationHyperparameters,
        turn_discount: float | None = None,
        reward_pool: Any = None,
    ) -> ProxyWorkflow:
        """Episodes of `gconfig.n_samples` sessions generating with `gconfig` (e.g. greedy
        evaluation beside training), served by this proxy's agents."""
        discount = self.turn_discount if turn_discount is None else turn_discount
        return ProxyWorkflow(self, gconfig, discount, reward_pool)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The proxy's event loop (its own thread), once started."""
        if self._loop.loop is None:
            raise RuntimeError("AgentProxy is not started")
        return self._loop.loop

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    @property
    def queued_tasks(self) -> int:
        with self._lock:
            return len(self._tasks)

    # ---- the executor's side (any thread) -----------------------------------------------------
    def offer(self, task: _Task) -> None:
        with self._lock:
            self._tasks.append(task)
        self.stats["offered"] += 1
        if self._task_ready is not None:
            self._loop.call_soon(self._task_ready.set)

    def withdraw(self, task: _Task) -> None:
        """The episode was cancelled: forget its task or session."""
        with self._lock:
            if task in self._tasks:
                self._tasks.remove(task)
            for sid, s in list(self._sessions.items()):
                if s.task is task:
                    del self._sessions[sid]
                    s.task.engine.cancel_all()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> str:
        """Serve on the proxy's own loop thread; its URL once it listens."""
        self._loop.start()
        try:
            self._loop.run(self._serve()).result(30)
        except concurrent.futures.TimeoutError:
            raise RuntimeError("agent proxy did not start within 30s") from None
        return self.url

    def stop(self) -> None:
        """Stop serving (the loop cancels the reaper and the handlers, then closes the site),
        then end every session and queued task with no result."""
        self._loop.stop()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
            tasks, self._tasks = list(self._tasks), deque()
        for t in [s.task for s in sessions] + tasks:
            t.engine.cancel_all()
            if not t.result.done():
                t.result.set_result(None)

    async def _serve(self) -> None:
        self._task_ready = asyncio.Event()
        runner = web.AppRunner(self._build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        self._loop.add_shutdown_hook(runner.cleanup)
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._reaper = asyncio.ensure_future(self._reap_expired())

    def _build_app(self) -> web.Application:
        from arealite.agent.proxy_routes import add_routes

        app = web.Application(client_max_size=64 * 1024**2)
        add_routes(app, self)
        return app

    # ---- sessions (proxy loop) ----------------------------------------------------------------
    async def claim(self, wait: float) -> _Session | None:
        """The oldest offered task as a new session, waiting up to `wait` seconds for one."""
        deadline = time.monotonic() + wait
        while True:
            with self._lock:
                task = self._tasks.popleft() if self._tasks else None
                if task is not None:
                    return self._open(task)
                self._task_ready.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._task_ready.wait(), left)
            except asyncio.TimeoutError:
                return None

    def _open(self, task: _Task) -> _Session:
        client = TrainingOpenAIClient(
            task.engine, self.tokenizer, task.workflow.gconfig, self.tool_parser
        )
        sid = secrets.token_hex(8)
        session = _Session(
            sid, secrets.token_urlsafe(24), task, client, time.monotonic() + self.session_timeout
        )
        self._sessions[sid] = session
        self.stats["started"] += 1
        return session

    def bind(self, alias: str, key: str, sid: str | None) -> None:
        """`/sessions/{alias}/v1` (Bearer `key`) now means session `sid`: a worker's fixed
        OPENAI_BASE_URL follows whichever session it is serving."""
        with self._lock:
            self._aliases[alias] = (key, sid)

    def session(self, sid: str, authorization: str) -> _Session:
        with self._lock:
            if sid in self._aliases:
                key, sid = self._aliases[sid]
                if not hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode()):
                    raise web.HTTPUnauthorized(reason="wrong or missing worker key")
                if sid is None:
                    raise web.HTTPNotFound(reason="this agent worker has no session now")
                authorization = f"Bearer {self._sessions[sid].key}" if sid in self._sessions else ""
            s = self._sessions.get(sid)
            closed = sid in self._closed
        if closed:
            raise web.HTTPConflict(reason=f"session {sid!r} already ended or expired")
        if s is None:
            raise web.HTTPNotFound(reason=f"session {sid!r} is unknown, ended or expired")
        if not hmac.compare_digest(authorization.encode(), f"Bearer {s.key}".encode()):
            raise web.HTTPUnauthorized(reason="wrong or missing session key (Bearer <api_key>)")
        return s

    def _close(self, s: _Session) -> bool:
        with self._lock:
            if self._sessions.pop(s.id, None) is None:
                return False
            self._closed.add(s.id)
            return True

    def fail_every_episode(self, error: Exception) -> None:
        """The agent can never work (say, it loses every session): from now on each episode
        raises `error`, so the run stops naming it. The first error given is kept."""
        if self.fatal is None:
            self.fatal = error

    def is_open(self, sid: str) -> bool:
        with self._lock:
            return sid in self._sessions

    def drop(self, s: _Session, why: str | None) -> bool:
        """End `s` without training rows (its episode's group is rejected), counted as `why`
        (unless None); False if it had ended already."""
        if not self._close(s):
            return False
        if why is not None:
            self.stats[why] += 1
        s.task.engine.cancel_all()
        s.task.result.set_result(None)
        return True

    def end(self, s: _Session) -> tuple[int, str]:
        """Close `s`: its rows go to its episode (or it is dropped without a reward)."""
        if not s.rewarded or len(s.client.tree) == 0:
            why = "no_reward" if not s.rewarded else "no_completions"
            return (
                (0, f"dropped: {why.replace('_', ' ')}")
                if self.drop(s, why)
                else (0, "already ended")
            )
        if not self._close(s):
            return 0, "already ended"
        rows = s.client.export_samples(self.export_style, s.task.workflow.turn_discount)
        self.stats["finished"] += 1
        s.task.result.set_result(rows)
        return int(rows.batch_size[0]), "finished"

    async def _reap_expired(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            with self._lock:
                expired = [s for s in self._sessions.values() if s.deadline < now]
                for s in expired:
                    del self._sessions[s.id]
                    self._closed.add(s.id)
            for s in expired:
                logger.warning(
                    "agent session %s not ended within %ss; dropped", s.id, self.session_timeout
                )
                self.stats["timed_out"] += 1
                s.task.engine.cancel_all()
                s.task.result.set_result(None)
