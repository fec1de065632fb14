"""Agents through the OpenAI API: train an agent written against the `openai` SDK.
Imports arealite.api, arealite.utils, arealite.openai_wire, arealite.workflow, arealite.rollout
and arealite.reward.

- `TrainingOpenAIClient`: `AsyncOpenAI`-shaped, backed by an InferenceEngine, records tokens,
  logprobs and versions per completion; rewards with discount along the conversation tree.
- `AgentWorkflow`: `async def agent(client, data) -> reward` as a RolloutWorkflow.
- `AgentProxy` (arealite.agent.proxy): an HTTP service for agents in other processes.
"""

from arealite.agent.chat_template import HERMES_TOOLS_TEMPLATE, install_chat_template
from arealite.agent.client import TrainingOpenAIClient
from arealite.agent.interactions import Interaction, InteractionTree
from arealite.agent.workflow import AgentWorkflow

__all__ = [
    "HERMES_TOOLS_TEMPLATE",
    "AgentWorkflow",
    "Interaction",
    "InteractionTree",
    "TrainingOpenAIClient",
    "install_chat_template",
]
