"""`AgentRoute`: the agent route of a GRPO run built from `config.agent` alone.

It is the training loop's workflow factory (`workflow_cls(reward_fn, gconfig, tokenizer,
reward_pool=...)`). The first call starts one AgentProxy and the agent's worker processes; every
call (training, then greedy evaluation) returns a workflow of that same proxy with its own
generation settings, so evaluation measures the agent itself (multi-turn, through HTTP)
without a second proxy or a second set of agents.
"""

from __future__ import annotations

import atexit
import secrets
from typing import Any

from arealite.agent.proxy import AgentProxy, ProxyWorkflow
from arealite.agent.workers import AgentWorkers
from arealite.api.agent_config import AgentConfig
from arealite.api.io_struct import GenerationHyperparameters


class AgentRoute:
    """See the module docstring; `close()` (also at exit) stops the agents, then the proxy."""

    def __init__(self, config: AgentConfig, tokenizer: Any, cwd: str | None = None):
        if not config.command:
            raise ValueError("AgentRoute needs agent.command (the agent program to run)")
        self.config, self.tokenizer, self.cwd = config, tokenizer, cwd
        self.proxy: AgentProxy | None = None
        self.workers: AgentWorkers | None = None

    def __call__(
        self,
        reward_fn: Any,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        reward_pool: Any = None,
        **_: Any,
    ) -> ProxyWorkflow:
        if self.proxy is None:
            self.start(gconfig)
        # Greedy evaluation reports the agent's own reward, undiscounted.
        discount = 1.0 if gconfig.greedy else self.config.turn_discount
        return self.proxy.workflow_for(gconfig, discount, reward_pool)

    def start(self, gconfig: GenerationHyperparameters) -> str:
        """Serve the proxy (a fresh random admin key: agents need only their session keys)."""
        c = self.config
        self.proxy = AgentProxy(
            self.tokenizer,
            gconfig,
            api_key=secrets.token_urlsafe(24),
            session_timeout=c.session_timeout,
            export_style=c.export_style,
            turn_discount=c.turn_discount,
        )
        url = self.proxy.start()
        self.workers = AgentWorkers(self.proxy, c, self.tokenizer, self.cwd)
        self.workers.start()
        atexit.register(self.close)
        return url

    def close(self) -> None:
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
