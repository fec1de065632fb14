"""`AgentWorkflow`: an agent written against the OpenAI SDK as a `RolloutWorkflow`.

The agent is `async def agent(client, data) -> reward | None`, where `client` behaves like
`openai.AsyncOpenAI` (`client.chat.completions.create`). Its episodes go through the
WorkflowExecutor like any workflow, so the same staleness bound applies; no HTTP is involved.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from tensordict import TensorDict

from arealite.agent.client import TrainingOpenAIClient
from arealite.agent.interactions import ExportStyle
from arealite.api.io_struct import GenerationHyperparameters
from arealite.api.workflow_api import RolloutWorkflow
from arealite.utils.data import concat_padded_tensors

logger = logging.getLogger("arealite.agent")

AgentFn = Callable[[TrainingOpenAIClient, dict[str, Any]], Awaitable[float | None]]


class AgentWorkflow(RolloutWorkflow):
    """Runs `agent(client, data)` `gconfig.n_samples` times per data item (a GRPO group).

    The returned reward (if not None) is the final reward (`client.set_final_reward`); the
    agent may also call `client.set_reward(completion_id, r)` per turn. Export:
    'concat' gives one row per conversation (per leaf of its tree), loss mask on the model's
    tokens only; 'individual' one row per completion. A run that exceeds `timeout` seconds or
    makes no completion is dropped and counted in `stats`; if every run of an item is
    dropped the episode is rejected (None).
    """

    def __init__(
        self,
        agent: AgentFn,
        tokenizer: Any,
        gconfig: GenerationHyperparameters,
        export_style: ExportStyle = "concat",
        turn_discount: float = 1.0,
        timeout: float | None = None,
        tool_parser: str = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        if export_style not in ("concat", "individual"):
            raise ValueError(f"export_style must be 'concat' or 'individual', got {export_style!r}")
        if not 0 <= turn_discount <= 1:
            raise ValueError(f"turn_discount must be in [0, 1], got {turn_discount}")
        self.agent = agent
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.export_style: ExportStyle = export_style
        self.turn_discount = turn_discount
        self.timeout = timeout
        self.tool_parser = tool_parser
        self.chat_template_kwargs = chat_template_kwargs
        self.stats: Counter[str] = Counter()

    @property
    def reward_stats(self) -> dict[str, int]:
        """runs / completions / timeouts / empty so far (what training scripts log)."""
        return dict(self.stats)

    def state_dict(self) -> dict[str, Any]:
        return {"stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = Counter({k: int(v) for k, v in state["stats"].items()})

    def new_client(self, engine: Any) -> TrainingOpenAIClient:
        return TrainingOpenAIClient(
            engine,
            self.tokenizer,
            self.gconfig.new(n_samples=1),
            tool_parser=self.tool_parser,
            chat_template_kwargs=self.chat_template_kwargs,
        )

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> TensorDict | None:
        runs = await asyncio.gather(
            *(self._run_once(engine, data) for _ in range(self.gconfig.n_samples))
        )
        kept = [td for td in runs if td is not None]
        return concat_padded_tensors(kept) if kept else None

    async def _run_once(self, engine: Any, data: dict[str, Any]) -> TensorDict | None:
        client = self.new_client(engine)
        self.stats["runs"] += 1
        try:
            reward = await asyncio.wait_for(self.agent(client, data), self.timeout)
        except asyncio.TimeoutError:
            self.stats["timeouts"] += 1
            logger.warning("agent run exceeded %ss; dropped", self.timeout)
            return None
        if len(client.tree) == 0:
            self.stats["empty"] += 1
            return None
        if reward is not None:
            client.set_final_reward(float(reward))
        self.stats["completions"] += len(client.tree)
        return client.export_samples(self.export_style, self.turn_discount)
